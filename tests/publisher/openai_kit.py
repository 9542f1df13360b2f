"""The OpenAI gateway on real parts: local engines served over HTTP on loopback, a control
plane (memory log) over their HTTP adapters, the OpenAI face served by uvicorn on a free
loopback port, and the official ``openai`` client pointed at it.

Nothing stands in for an engine; the tests that need a reply lost after send put a real TCP
relay in front of one (``tests.support.relay.Relay``)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import uvicorn

from engines.local.client import LocalHTTPEngine
from engines.local.engine import LocalEngine
from engines.local.server import serve as serve_engine
from engines.local.tinymodel import make_adapter
from evlog.memory import MemoryStore
from publisher.drivers.engine_ops import EngineTimeouts
from publisher.drivers.fleet import Fleet
from publisher.drivers.plane import ControlPlane
from publisher.drivers.trainer import TrainerClient
from publisher.gateway import Gateway, LocalView
from publisher.gateway.provenance import MemorySink, ProvenanceRecorder
from publisher.openai import (
    EngineRoute,
    OpenAIGateway,
    OpenAIOptions,
    engine_routes,
    openai_app,
)
from publisher.sessions import RolloutWorker
from tests.fault.engine_host import HostedEngine
from tests.publisher.plane_kit import FAST, LIMITS

TOKEN = "openai-test-token"


class _Quiet(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


@contextlib.asynccontextmanager
async def serve_app(app: Any) -> AsyncIterator[str]:
    """Serve an ASGI app on a free loopback port; yield its URL; stop it on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    server = _Quiet(
        uvicorn.Config(app, lifespan="off", log_level="warning", timeout_graceful_shutdown=2)
    )
    try:
        async with anyio.create_task_group() as tg:

            async def run() -> None:
                with anyio.CancelScope(shield=True):
                    await server.serve([sock])

            tg.start_soon(run)
            try:
                with anyio.fail_after(20):
                    while not server.started:  # noqa: ASYNC110 -- uvicorn has only the flag
                        await anyio.sleep(0.005)
                yield f"http://127.0.0.1:{sock.getsockname()[1]}"
            finally:
                server.should_exit = True
    finally:
        sock.close()


class ServerTask:
    """An engine's HTTP server in a task of its own, so a test can stop it while everything
    entered after it (the plane, the face) keeps running: a server context entered in the rig's
    stack could only be left in stack order."""

    def __init__(self, engine: LocalEngine) -> None:
        self.engine = engine
        self._stop = anyio.Event()
        self._stopped = anyio.Event()

    async def run(self, *, task_status: anyio.abc.TaskStatus[str]) -> None:
        try:
            async with serve_engine(self.engine) as url:
                task_status.started(url)
                await self._stop.wait()
        finally:
            self._stopped.set()

    def request_stop(self) -> None:
        self._stop.set()

    async def stop(self) -> None:
        """Stop the server and return once its socket is closed."""
        self.request_stop()
        await self._stopped.wait()


@dataclass
class Rig:
    plane: ControlPlane
    engines: list[LocalEngine]  # the engines themselves (in this process, served over HTTP)
    urls: dict[str, str]
    gateway: Gateway
    worker: RolloutWorker
    face: OpenAIGateway
    sink: MemorySink
    url: str  # the OpenAI face: base_url = url + "/v1"
    names: dict[int, str] = field(default_factory=dict)
    hosts: dict[str, HostedEngine] = field(default_factory=dict)  # rig(restartable=True)
    # each engine's HTTP server (rig(restartable=False)): see stop_serving
    servers: dict[str, ServerTask] = field(default_factory=dict)

    async def stop_serving(self, engine_id: str) -> None:
        """Stop ``engine_id``'s HTTP server: nothing listens on its port any more (every call,
        the face's and the plane's alike, is refused at connect), as after its server process
        died. The engine object itself is closed with the rig."""
        await self.servers[engine_id].stop()

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    async def publish(self, version_id: int) -> str:
        config, tensors = make_adapter(version_id)
        outcome = await TrainerClient(self.plane).publish(tensors, config=config, step=version_id)
        assert outcome.status == "PUBLISHED", outcome
        assert outcome.lora_name is not None
        self.names[version_id] = outcome.lora_name
        return outcome.lora_name

    def engine(self, engine_id: str) -> LocalEngine:
        return next(e for e in self.engines if e.engine_id == engine_id)


@contextlib.asynccontextmanager
async def rig(
    tmp_path: Path,
    *,
    engines: int = 2,
    capacity: int = 3,
    routes: dict[str, str] | None = None,
    owner: str = "openai-gw",
    ttl_s: float = 30.0,
    idle_release_s: float = 0.0,
    sessions_idle_s: float | None = None,
    restartable: bool = False,
    probe_interval_s: float = 0.05,
    suspend_after_s: float | None = 30.0,
    timeouts: EngineTimeouts = FAST,
) -> AsyncIterator[Rig]:
    """``engines`` local engines over HTTP, a control plane over them and the OpenAI face.
    ``routes`` overrides the URL the face uses for an engine (a fault relay in front of it).
    ``restartable``: each engine is a :class:`HostedEngine` (``Rig.hosts``), restartable in
    place (same port, a new process life holding nothing); ``Rig.engines`` are their first
    lives. ``probe_interval_s``: the plane's health probe (a long one leaves a restart unseen
    until something reports the engine); ``suspend_after_s``: how long its probes may fail
    before the engine is suspended (0: at the first failed probe); ``timeouts``: the plane's
    bounds on each engine call (a probe that misses its bound records an outage).
    ``sessions_idle_s``: the face's worker is a relay, as every OpenAI face runs it (its
    sessions client-held, released idle by the plane)."""
    hosts: dict[str, HostedEngine] = {}
    servers: dict[str, ServerTask] = {}
    async with contextlib.AsyncExitStack() as stack:
        if restartable:
            for i in range(engines):
                hosts[f"e{i}"] = await stack.enter_async_context(
                    HostedEngine(f"e{i}", tmp_path / "artifacts")
                )
            local = [h.engine for h in hosts.values()]
            urls = {engine_id: h.url for engine_id, h in hosts.items()}
        else:
            local = [
                await stack.enter_async_context(LocalEngine(f"e{i}", limits=LIMITS))
                for i in range(engines)
            ]
            tasks = await stack.enter_async_context(anyio.create_task_group())
            for engine in local:  # left before the task group is: a running server stops
                servers[engine.engine_id] = ServerTask(engine)
                stack.callback(servers[engine.engine_id].request_stop)
            # one task per server: a test may stop one (Rig.stop_serving)
            urls = {engine_id: await tasks.start(s.run) for engine_id, s in servers.items()}
        handles = [
            await stack.enter_async_context(contextlib.aclosing(LocalHTTPEngine(url, engine_id)))
            for engine_id, url in urls.items()
        ]
        plane = await stack.enter_async_context(
            ControlPlane.open(
                MemoryStore(),
                Fleet(handles),
                deployment="dep",
                prefix="agent",
                capacity=capacity,
                artifact_root=tmp_path / "artifacts",
                probe_interval_s=probe_interval_s,
                suspend_after_s=suspend_after_s,
                reclaim_tick_s=0.05,
                timeouts=timeouts,
                cleanup_timeout=5.0,
            )
        )
        sink = MemorySink()
        recorder = await stack.enter_async_context(ProvenanceRecorder(sink))
        gateway = Gateway(
            plane.fleet,
            LocalView(plane.ledger),
            gateway_id=owner,
            recorder=recorder,
            on_engine_trouble=plane.reconciler.engine_trouble,
        )
        plane.add_inflight_source(gateway)
        worker = await stack.enter_async_context(
            RolloutWorker.open(
                plane.ledger,
                gateway,
                owner=owner,
                ttl_s=ttl_s,
                idle_release_s=idle_release_s,
                sessions_idle_s=sessions_idle_s,
            )
        )
        table = engine_routes(plane.fleet)
        for engine_id, url in (routes or {}).items():
            table[engine_id] = EngineRoute(engine_id=engine_id, kind="local", base_url=url)
        face = OpenAIGateway(worker, table, OpenAIOptions(token=TOKEN))
        stack.push_async_callback(face.aclose)
        url = await stack.enter_async_context(serve_app(openai_app(face)))
        yield Rig(
            plane, local, urls, gateway, worker, face, sink, url, hosts=hosts, servers=servers
        )
