"""What a check-engine run reports, and how it is shown: a rich table, or JSON for ``--json``.

The report's shape is the command's interface (check names, needed or reported, the JSON keys,
``ok``): the README and docs/engines.md describe it and scripts read it.
"""

from __future__ import annotations

from typing import Any

import msgspec


class Finding(msgspec.Struct, frozen=True, kw_only=True):
    """One checked property. ``holds`` None: not applicable to this engine (``detail`` says
    why). ``required``: the ledger relies on it (a failure makes the command exit non-zero)."""

    check: str
    holds: bool | None
    required: bool
    detail: str


class Report(msgspec.Struct, frozen=True, kw_only=True):
    kind: str
    url: str
    engine_version: str
    incarnation: str
    findings: tuple[Finding, ...]

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def failures(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.required and f.holds is False)


def render(report: Report) -> Any:
    """A rich table: one row per check, what holds and what does not."""
    from rich.table import Table
    from rich.text import Text

    table = Table(
        title=f"{report.kind} engine at {report.url}: {report.engine_version}",
        caption=(
            "every property the ledger needs holds"
            if report.ok
            else f"{len(report.failures)} property(ies) the ledger needs do not hold"
        ),
    )
    table.add_column("check")
    table.add_column("holds")
    table.add_column("needed")
    table.add_column("detail", overflow="fold")
    for f in report.findings:
        if f.holds is None:
            mark = Text("n/a", style="dim")
        elif f.holds:
            mark = Text("yes", style="green")
        else:
            mark = Text("NO", style="bold red" if f.required else "yellow")
        table.add_row(f.check, mark, "yes" if f.required else "no", f.detail)
    return table


def as_json(report: Report) -> dict[str, Any]:
    data: dict[str, Any] = msgspec.to_builtins(report)
    data["ok"] = report.ok
    return data
