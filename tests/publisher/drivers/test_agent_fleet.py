"""Publication without any shared directory: two engine hosts, each an SGLang-compatible engine
(the local engine's SGLang face, loading adapters by path) whose artifact root only its own
agent writes (``python -m engines.agent``, a separate process per host). The trainer side (the
control plane and its artifact store) never writes into either root, and each engine refuses
any path outside its own root, so every successful load proves the agent wrote the directory
on that host.

One scenario, in order: publication, reclaim, an engine restart and its repair through the
agent, and an agent killed between writing a version and loading it (its process exits in the
fault mode), which resolves as an ambiguous attempt and is repaired once the agent is back.

Every process is started on 127.0.0.1 and stopped by its PID.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.abc
import pytest

from engines.agent import EXIT_AFTER_WRITE, AgentEngine
from engines.local.engine import LocalEngine
from engines.local.server import serve
from engines.sglang import SGLangEngine
from evlog.events import AttemptFailed, EngineRepaired, VersionRestored
from projections.registry import VersionState
from publisher.drivers.publication import PublicationError, PublicationStatus
from tests.publisher.plane_kit import (
    GREEDY,
    LIMITS,
    PEFT_WARNINGS,
    PROMPT,
    adapter_copy,
    names,
    open_plane,
)
from tests.support.log import events, of_type
from tests.support.paths import REPO
from tests.support.waiting import wait_for
from tests.tools.conftest import script_env

pytestmark = [pytest.mark.anyio, PEFT_WARNINGS]


class EngineHost:
    """One engine host: a local engine served on a fixed port, restartable (a new process
    life on the same port: new incarnation, nothing loaded)."""

    def __init__(self, engine_id: str, root: Path) -> None:
        self.engine_id = engine_id
        self.root = root
        self.port = 0
        self.engine: LocalEngine | None = None
        self._stop = anyio.Event()
        self._stopped = anyio.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def life(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        self._stop, self._stopped = anyio.Event(), anyio.Event()
        try:
            async with (
                LocalEngine(self.engine_id, limits=LIMITS, artifact_root=self.root) as engine,
                serve(engine, port=self.port) as url,
            ):
                self.engine = engine
                self.port = int(url.rsplit(":", 1)[1])
                task_status.started()
                await self._stop.wait()
        finally:
            self._stopped.set()

    async def restart(self, tg: anyio.abc.TaskGroup) -> None:
        self._stop.set()
        await self._stopped.wait()
        await tg.start(self.life)


class AgentProcess:
    """``python -m engines.agent`` for one host, stopped by its PID."""

    def __init__(self, engine_id: str, engine_url: str, root: Path) -> None:
        self.args = [
            sys.executable,
            "-m",
            "engines.agent",
            "--engine",
            f"sglang:{engine_url}",
            "--artifacts",
            str(root),
            "--id",
            engine_id,
        ]
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [*self.args, "--port", str(self.port), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd=REPO,
            env=script_env(),
        )
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline().strip())

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextlib.asynccontextmanager
async def two_hosts(
    tmp_path: Path,
) -> AsyncIterator[tuple[anyio.abc.TaskGroup, list[EngineHost], list[AgentProcess]]]:
    hosts = [EngineHost(f"e{i}", tmp_path / f"host{i}") for i in range(2)]
    agents: list[AgentProcess] = []
    async with anyio.create_task_group() as tg:
        try:
            for host in hosts:
                host.root.mkdir()
                await tg.start(host.life)
                agent = AgentProcess(host.engine_id, host.url, host.root)
                agent.start()
                agents.append(agent)
            yield tg, hosts, agents
        finally:
            for agent in agents:
                agent.stop()
            tg.cancel_scope.cancel()


async def test_publication_reclaim_restart_and_agent_kill_without_a_shared_directory(
    tmp_path: Path,
) -> None:
    async with two_hosts(tmp_path) as (tg, hosts, agents):
        members = [
            AgentEngine(agent.url, SGLangEngine(host.url, host.engine_id))
            for host, agent in zip(hosts, agents, strict=True)
        ]
        trainer = tmp_path / "artifacts"
        try:
            async with open_plane(members, tmp_path, probe_interval_s=0.05) as plane:
                ledger = plane.ledger
                # publication: each host's directory written by its agent, loaded by path
                v1 = await plane.publisher.publish(adapter_copy(1), version_id=1)
                assert v1.status == PublicationStatus.PUBLISHED
                digest1 = ledger.state.versions[1].digest
                assert v1.lora_name is not None
                for host, member in zip(hosts, members, strict=True):
                    assert (host.root / digest1).is_dir()
                    entries = {e.lora_name: e for e in (await member.inventory()).adapters}
                    assert entries[v1.lora_name].path == str(host.root / digest1)
                    assert entries[v1.lora_name].digest == digest1
                assert not any(p.is_relative_to(trainer) for h in hosts for p in h.root.iterdir())
                out = await members[0].generate(PROMPT, v1.lora_name, GREEDY)
                assert out.lora_name == v1.lora_name and len(out.token_ids) == GREEDY.max_tokens

                # reclaim: v2 published, v1 unloaded everywhere
                v2 = await plane.publisher.publish(adapter_copy(2), version_id=2)
                await wait_for(
                    "v1 reclaimed", lambda: ledger.state.versions[1].state is VersionState.RECLAIMED
                )
                for member in members:
                    assert await names(member) == {v2.lora_name}

                # an engine restart: repaired through its agent before it is routable again
                seq = ledger.state.last_seq
                old = ledger.state.engines["e1"].incarnation
                await hosts[1].restart(tg)
                member1 = ledger.state.engines["e1"]
                await wait_for(
                    "e1's new life to be recorded and repaired",
                    lambda: member1.incarnation != old and member1.routable,
                )
                log = await events(ledger, after=seq)
                assert [r.version_id for r in of_type(log, VersionRestored)] == [2]
                assert of_type(log, EngineRepaired)
                assert await names(members[1]) == {v2.lora_name}

                # an agent killed between the write and the load
                agents[0].stop()
                agents[0].start("--exit-after-write")
                seq = ledger.state.last_seq
                with pytest.raises(PublicationError):
                    await plane.publisher.publish(adapter_copy(3), version_id=3)
                assert agents[0].proc is not None
                assert agents[0].proc.wait(timeout=20) == EXIT_AFTER_WRITE
                failed = of_type(await events(ledger, after=seq), AttemptFailed)
                assert failed and not failed[0].clean  # ambiguous, not a clean refusal
                digest3 = ledger.state.versions[3].digest
                assert (hosts[0].root / digest3).is_dir()  # written, never loaded
                v3_name = ledger.state.versions[3].lora_name
                assert v3_name not in await names(members[0])
                agents[0].start()  # back, on the same port
                v4 = await plane.publisher.publish(adapter_copy(4), version_id=4)
                assert v4.status == PublicationStatus.PUBLISHED
                for member in members:
                    held = await names(member)
                    assert v4.lora_name in held and v3_name not in held
                assert trainer.is_dir() and not any(
                    p.is_relative_to(h.root) for h in hosts for p in trainer.iterdir()
                )
        finally:
            for member in members:
                await member.aclose()
