"""The chaos run's cluster: real ``loraledger`` processes on loopback, each started, signalled
and stopped by its PID.

* ``serve`` on a SQLite log, or on a database of a throwaway PostgreSQL server the run starts
  for itself (:func:`log_store`, stopped by its PID at the end; never faulted itself: the
  faults are the ledger's processes and links); restarted on the same log and port;
* three engines: ``e0`` and ``e1`` joined as ``local:URL``, ``e2`` behind a ``loraledger
  agent`` (``agent:AGENT_URL,sglang:ENGINE_URL``, adapters written to the agent's own
  directory); each is ``tests.chaos.recording_engine`` (the ``loraledger engine`` command,
  writing what it runs to ``<dir>/<id>.jsonl``);
* two ``loraledger gateway`` processes, ``gw-a`` and ``gw-b``, in front of ``serve``;
* the ``trainer`` (``tests.chaos.trainer``), publishing a version every few seconds through the
  HTTP trainer client, its publications recorded in ``<dir>/trainer-ops.jsonl``.

Every address one process is given for another goes through :meth:`Cluster.link`
(``client->gw-a``, ``gw-a->serve``, ``serve->e0``, ``serve->agent``, ``trainer->serve``): with
a :class:`~tests.chaos.proxy.Network`, through a fault-injecting proxy of its own, the one
place network faults are played. A gateway reaches an engine at the address ``serve`` recorded
for it, so the ``serve->eN`` link carries the gateway -> engine traffic too (``e2``'s
generations included; its control calls go through ``serve->agent``).

A member restarts on the port its first life got (port 0 the first time): the others were
given that address.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal
from urllib.parse import urlsplit

import anyio
from anyio.abc import Process

from tests.chaos.proxy import Network
from tests.support.paths import REPO
from tests.support.processes import listening_process

HOST = "127.0.0.1"
TOKEN = "chaos-run-token"
ENGINES = ("e0", "e1", "e2")
AGENT_ENGINE = "e2"
GATEWAYS = ("gw-a", "gw-b")
StoreKind = Literal["sqlite", "postgres"]
STORES: tuple[StoreKind, ...] = ("sqlite", "postgres")


@asynccontextmanager
async def log_store(root: Path, kind: StoreKind) -> AsyncIterator[str]:
    """Where ``serve`` keeps its log for the block, as ``--db`` takes it: a SQLite file under
    ``root``, or a fresh database on a throwaway PostgreSQL server (``tools/pg_server.py``:
    ``initdb`` in a temporary directory, the ``postgres`` process stopped by its PID when the
    block ends, so the log must be read inside the block). Raises ``PostgresUnavailable``
    without the server binaries."""
    if kind == "sqlite":
        yield str(root / "ledger.db")
        return
    from tools.pg_server import create_database, temporary_server

    server_cm = temporary_server()
    server = await anyio.to_thread.run_sync(server_cm.__enter__)  # initdb, then the server
    try:
        yield await create_database(server, f"chaos_{uuid.uuid4().hex[:12]}")
    finally:
        with anyio.CancelScope(shield=True):  # cleanup: the server stopped by its PID
            await anyio.to_thread.run_sync(server_cm.__exit__, None, None, None)


@dataclass(eq=False)
class Member:
    """One process of the cluster across its lives: ``args`` without ``--port``/``--json``."""

    name: str
    args: list[str]
    logs: Path
    module: str = "tools.cli"
    tree: Path = REPO  # the source tree it runs (a planted copy for a sensitivity run)
    port: int = 0
    url: str = ""
    lives: int = 0
    process: Process | None = None
    _stack: AsyncExitStack | None = None
    _stderr: IO[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.name} is not running"
        return self.process.pid

    async def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(self.tree)}
        env.pop("LORALEDGER_TOKEN", None)
        stack = AsyncExitStack()
        self._stderr = stack.enter_context((self.logs / f"{self.name}.stderr").open("ab"))
        started = listening_process(
            [*self.args, "--port", str(self.port), "--json"],
            env=env,
            cwd=self.tree,
            module=self.module,
            stderr=self._stderr,
            ready_within=180,
        )
        try:
            self.process, row = await stack.enter_async_context(started)
        except BaseException:
            await stack.aclose()
            raise
        self._stack, self.url = stack, str(row["url"])
        self.port = urlsplit(self.url).port or 0
        self.lives += 1

    async def stop(self, sig: signal.Signals = signal.SIGKILL) -> int | None:
        """Send ``sig`` by PID (SIGCONT after it, should the process be frozen), wait for its
        exit and reap it; its exit status."""
        if self._stack is None or self.process is None:
            return None
        process, stack = self.process, self._stack
        self.process, self._stack = None, None
        if process.returncode is None:
            # The loop's child watcher reaps an exit in the background, before `returncode`
            # says so: a process that died meanwhile (or of the first signal) is already gone.
            with suppress(ProcessLookupError):
                os.kill(process.pid, sig)
                os.kill(process.pid, signal.SIGCONT)
        with anyio.fail_after(90):
            await process.wait()
        await stack.aclose()
        return process.returncode

    def signal(self, sig: signal.Signals) -> None:
        os.kill(self.pid, sig)


class Cluster:
    """The members, in start order; :meth:`start` brings them all up, :meth:`stop` ends each
    still running (SIGKILL: the log and the records are what is read afterwards)."""

    def __init__(
        self,
        root: Path,
        *,
        plant: str | None = None,
        tree: Path = REPO,
        net: Network | None = None,
        db: str = "",
    ) -> None:
        self.root = root
        self.net = net  # None: every link direct
        self.client_urls: dict[str, str] = {}  # gateway -> the address clients use
        self.trainer_url = ""
        self.db = db or str(root / "ledger.db")  # serve's --db: a file or a postgresql:// URL
        self.records = root / "records"
        self.logs = root / "logs"
        for d in (self.records, self.logs, root / "agent-host", root / "artifacts"):
            d.mkdir(parents=True, exist_ok=True)
        (root / "token").write_text(TOKEN + "\n")
        self.plant = plant  # an engine plant (``tests/chaos/plants.py``), or None
        self.tree = tree  # what serve and the gateways run (a planted copy, or this tree)
        self.members: dict[str, Member] = {}

    async def link(self, name: str, url: str) -> str:
        """The address through which the link ``name`` reaches ``url``: its proxy's, or
        ``url`` itself without a network. Members restart on their first port, so a proxy
        set up once serves every later life."""
        if self.net is None:
            return url
        parts = urlsplit(url)
        assert parts.hostname is not None and parts.port is not None, url
        port = await self.net.link(name, parts.hostname, parts.port)
        return f"{parts.scheme}://{parts.hostname}:{port}"

    def _engine(self, name: str, *extra: str) -> Member:
        args = ["--id", name, "--record", str(self.records / f"{name}.jsonl"), *extra]
        if self.plant is not None:
            args += ["--plant", self.plant]
        return Member(name, args, self.logs, module="tests.chaos.recording_engine")

    async def start(self) -> None:
        host = self.root / "agent-host"
        async with anyio.create_task_group() as tg:  # the engines load their models at once
            for name in ENGINES:
                extra = ("--artifacts", str(host)) if name == AGENT_ENGINE else ()
                tg.start_soon(self._up, self._engine(name, *extra))
        e2 = self.members[AGENT_ENGINE]
        agent = Member(
            "agent",
            ["agent", "--engine", f"sglang:{e2.url}", "--artifacts", str(host), "--id", "e2"],
            self.logs,
        )
        await self._up(agent)
        specs: list[str] = []
        for name in ENGINES:
            if name == AGENT_ENGINE:
                engine_url = await self.link(f"serve->{name}", e2.url)
                agent_url = await self.link("serve->agent", agent.url)
                specs += ["--engine", f"{name}=agent:{agent_url},sglang:{engine_url}"]
            else:
                specs += [
                    "--engine",
                    f"{name}=local:{await self.link(f'serve->{name}', self.members[name].url)}",
                ]
        serve = Member(
            "serve",
            [
                "serve",
                "--db",
                self.db,
                "--token-file",
                str(self.root / "token"),
                "--artifacts",
                str(self.root / "artifacts"),
                "--capacity",
                "6",  # four clients pin at most four retired versions at once
                *specs,
            ],
            self.logs,
            tree=self.tree,
        )
        await self._up(serve)
        self.trainer_url = await self.link("trainer->serve", serve.url)
        ledger_urls = {name: await self.link(f"{name}->serve", serve.url) for name in GATEWAYS}
        async with anyio.create_task_group() as tg:
            for name in GATEWAYS:
                gateway = Member(
                    name,
                    [
                        "gateway",
                        "--ledger",
                        ledger_urls[name],
                        "--token-file",
                        str(self.root / "token"),
                        "--owner",
                        name,
                        "--refresh-s",
                        "0.5",
                    ],
                    self.logs,
                    tree=self.tree,
                )
                tg.start_soon(self._up, gateway)
        for name in GATEWAYS:
            self.client_urls[name] = await self.link(f"client->{name}", self.members[name].url)
        trainer = ["--serve", self.trainer_url, "--token-file", str(self.root / "token")]
        await self._up(
            Member(
                "trainer",
                [*trainer, "--dir", str(self.root)],
                self.logs,
                module="tests.chaos.trainer",
            )
        )

    async def _up(self, member: Member) -> None:
        self.members[member.name] = member
        await member.start()

    def url(self, gateway: str) -> str:
        """The address a client uses for ``gateway`` (through its link)."""
        return self.client_urls[gateway]

    def engine_records(self) -> list[Path]:
        return sorted(self.records.glob("*.jsonl"))

    async def stop(self) -> None:
        for member in reversed(list(self.members.values())):
            with anyio.CancelScope(shield=True):  # cleanup: every process reaped
                await member.stop(signal.SIGKILL)

    def started(self) -> int:
        """Processes started over the run, restarts included."""
        return sum(m.lives for m in self.members.values())

    def describe(self) -> dict[str, Any]:
        return {m.name: {"url": m.url, "lives": m.lives} for m in self.members.values()}
