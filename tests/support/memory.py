"""The peak resident memory of a process over one step of a test, as the kernel counts it.

``VmHWM`` (``/proc/PID/status``) is the highest resident size the process reached; writing
``5`` to ``/proc/PID/clear_refs`` resets it to the current size. So a test warms the process up
(imports, first requests), starts :class:`PeakGrowth`, does the step, and reads how far the
peak rose above where it stood: every copy the step held at once, freed or not, counts."""

from __future__ import annotations

from pathlib import Path

import anyio


def memory_kib(pid: int | str) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of ``pid`` (``"self"`` for this process), KiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields


class PeakGrowth:
    """How far the peak resident memory of ``pid`` rose since :meth:`start`."""

    def __init__(self, pid: int, before_kib: int) -> None:
        self.pid = pid
        self.before_kib = before_kib

    @classmethod
    async def start(cls, pid: int) -> PeakGrowth:
        await anyio.Path(f"/proc/{pid}/clear_refs").write_text("5")
        return cls(pid, memory_kib(pid)["VmRSS"])

    def bytes(self) -> int:
        return (memory_kib(self.pid)["VmHWM"] - self.before_kib) * 1024
