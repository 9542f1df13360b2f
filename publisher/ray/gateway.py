"""The OpenAI gateway as a Ray actor: one per node, in front of the ledger actor.

A Ray-based trainer starts the whole plane from Python -- engine actors, the ledger actor
(hosting the control plane) and, with :func:`start_gateway` (or :func:`start_gateways`, one per
alive node), gateway actors whose HTTP address any OpenAI client uses as its ``base_url``::

    handle, url = start_gateway(GatewayConfig(ledger_name="ledger", token=token))
    client = openai.OpenAI(base_url=url + "/v1", api_key=token)

Each actor hosts, on a private event loop (:class:`~publisher.ray.hosting.PortalHost`), what
``loraledger gateway`` runs against ``serve``: a :class:`~publisher.ray.client.RayLedger`
(binds coalesced into few round trips, in-flight counts forwarded with the lease renewals the
ledger actor's reclaim reads, routing piggybacked on every reply), one
:class:`~publisher.sessions.RolloutWorker` (the actor's owner, a relay: the sessions it binds
are client-held, so a restarted or redeployed gateway actor serves their next turns, and the
ledger actor releases idle ones after ``session_idle_s``), the
:class:`~publisher.openai.OpenAIGateway` and a uvicorn server on ``host:port`` (port 0:
any free port; the actual address is what :func:`start_gateway` returns).

Engines are reached over HTTP at each engine actor's ``endpoint`` (an HTTP adapter hosted in
the actor) or at ``routes`` given explicitly; an engine with neither is never routed to by this
face. Which engines exist is the ledger actor's answer, not this actor's configuration: the
gateway uses the client's mirrored fleet (``RayLedger.fleet``) and rebuilds its routes whenever
the ledger adds, replaces or removes an engine. ``engines`` is used only in front of a bare
ledger actor (one that hosts no control plane, hence no fleet). The rules (pinning, at most
once, stickiness, headers, provenance) are the OpenAI face's (docs/openai.md); nothing is
restated here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import socket
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import anyio
import ray
import uvicorn
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from engines.guard import is_loopback, uvicorn_limits
from evlog.errors import INVALID_INPUT, InvalidInput
from publisher.drivers.fleet import Fleet
from publisher.gateway import Gateway
from publisher.gateway.provenance import AnySink, JsonlSink, ProvenanceRecorder, Tee
from publisher.logs import get_logger
from publisher.openai import (
    MAX_BODY_BYTES,
    UPSTREAM_TIMEOUT_S,
    EngineRoute,
    OpenAIGateway,
    OpenAIOptions,
    engine_routes,
    openai_app,
)
from publisher.ray.client import RayLedger
from publisher.ray.engine import RayEngine
from publisher.ray.hosting import PortalHost
from publisher.ray.ledger_actor import DEFAULT_LEDGER_NAME
from publisher.ray.link import DEFAULT_NAMESPACE
from publisher.sessions import RolloutWorker

log = get_logger("loraledger.ray")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    """What one gateway actor serves. ``routes`` (engine id -> OpenAI base URL) overrides an
    engine actor's own ``endpoint``; ``owner`` defaults to ``gateway-<node>-<random>``."""

    token: str | None
    engines: tuple[RayEngine, ...] = ()  # only for a bare ledger actor (see the module doc)
    ledger_name: str = DEFAULT_LEDGER_NAME
    namespace: str = DEFAULT_NAMESPACE
    routes: Mapping[str, str] = dataclasses.field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 0
    alias: str = "policy"
    owner: str | None = None
    ttl_s: float = 30.0
    session_idle_s: float = 1800.0
    status_refresh_s: float = 1.0
    # Rows always go to the ledger actor's store; this adds a JSON-lines copy on the actor's node.
    provenance: str | None = None
    provenance_drain_s: float = 30.0  # on stop, how long rows still held wait for the ledger
    engine_token: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES  # the largest request body (413 BODY_TOO_LARGE beyond)
    upstream_timeout_s: float = UPSTREAM_TIMEOUT_S  # an engine's longest silence

    def check(self) -> None:
        if not is_loopback(self.host) and not self.token:
            raise InvalidInput(
                INVALID_INPUT,
                f"refusing to listen on {self.host!r} without a token: anyone who reaches it "
                "could bind sessions",
            )
        if not 0 <= self.port <= 65535 or self.status_refresh_s <= 0:
            raise InvalidInput(INVALID_INPUT, "port must be 0-65535 and status_refresh_s > 0")
        if self.max_body_bytes < 1 or not (
            math.isfinite(self.upstream_timeout_s) and self.upstream_timeout_s > 0
        ):
            raise InvalidInput(
                INVALID_INPUT, "max_body_bytes must be >= 1 and upstream_timeout_s finite > 0"
            )

    def openai_options(self) -> OpenAIOptions:
        return OpenAIOptions(
            alias=self.alias,
            token=self.token,
            engine_token=self.engine_token,
            max_body_bytes=self.max_body_bytes,
            upstream_timeout_s=self.upstream_timeout_s,
        )


def routes_of(fleet: Fleet, explicit: Mapping[str, str]) -> dict[str, EngineRoute]:
    """Each engine's OpenAI endpoint: its own (``capabilities.endpoint``), or the one given in
    ``explicit`` (engine id -> base URL) for an engine of the fleet."""
    routes = engine_routes(fleet)
    for engine_id, url in explicit.items():
        kind = fleet[engine_id].kind if engine_id in fleet else "local"
        routes[engine_id] = EngineRoute(engine_id=engine_id, kind=kind, base_url=url.rstrip("/"))
    return routes


class _Quiet(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield  # the actor's process is Ray's: its signals are not this server's


@contextlib.asynccontextmanager
async def running_gateway(config: GatewayConfig) -> AsyncIterator[tuple[str, OpenAIGateway]]:
    """Everything one gateway actor runs, for the life of the block: yields its URL and face."""
    config.check()
    owner = config.owner or f"gateway-{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
    sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, config.port))
    sock.listen(1024)
    port = sock.getsockname()[1]
    host = f"[{config.host}]" if ":" in config.host else config.host
    url = f"http://{host}:{port}"
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(sock.close)
        ledger = await stack.enter_async_context(
            RayLedger.connect(
                config.ledger_name,
                namespace=config.namespace,
                refresh_interval=config.status_refresh_s,
            )
        )
        fleet = ledger.fleet
        if not ledger.fleet_hosted:
            for engine in config.engines:
                if engine.engine_id not in fleet:
                    fleet.add(engine)
        sink: AnySink = ledger.provenance_sink()  # to the ledger actor's store
        if config.provenance:
            sink = Tee(sink, JsonlSink(config.provenance))
        recorder = await stack.enter_async_context(
            ProvenanceRecorder(sink, drain_timeout_s=config.provenance_drain_s)
        )
        gateway = Gateway(
            fleet,
            ledger.view,
            gateway_id=owner,
            recorder=recorder,
            on_engine_trouble=ledger.engine_failed,
        )
        worker = await stack.enter_async_context(
            RolloutWorker.open(  # a relay: its sessions outlive this actor
                ledger,
                gateway,
                owner=owner,
                ttl_s=config.ttl_s,
                sessions_idle_s=config.session_idle_s,
            )
        )
        face = OpenAIGateway(
            worker,
            routes_of(fleet, config.routes),
            config.openai_options(),
            clock=time.time,
        )
        stack.push_async_callback(face.aclose)

        def rebuild_routes() -> None:
            face.engines = routes_of(fleet, config.routes)
            log.info("ray.gateway_routes", engines=sorted(face.engines))

        ledger.on_fleet_change(rebuild_routes)
        server = _Quiet(
            uvicorn.Config(
                openai_app(face),
                lifespan="off",
                log_config=None,
                access_log=False,
                timeout_graceful_shutdown=5,
                **uvicorn_limits(),
            )
        )
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve, [sock])
            with anyio.fail_after(30):
                while not server.started:  # noqa: ASYNC110 -- uvicorn has only the flag
                    await anyio.sleep(0.01)
            log.info("ray.gateway_listening", url=url, owner=owner)
            try:
                yield url, face
            finally:
                server.should_exit = True  # serve() drains and returns; the group waits for it


class GatewayActor:
    """Hosts :func:`running_gateway` for the actor's whole life. Create it with
    :func:`start_gateway`."""

    def __init__(self, config: GatewayConfig) -> None:
        self._host: PortalHost[tuple[str, OpenAIGateway]] = PortalHost(
            lambda: running_gateway(config), name="gateway"
        )
        self._url, self._face = self._host.value

    async def address(self) -> str:
        return self._url

    async def stats(self) -> dict[str, Any]:
        face = self._face
        return {
            "requests": face.requests,
            "inflight": sum(face.gateway.inflight_counts().values()),
            "owner": face.worker.owner,
            "idle_releases": face.worker.idle_releases,
            "engines": sorted(face.engines),  # the engines it has a route to now
        }

    def close(self) -> None:
        self._host.close()


def start_gateway(
    config: GatewayConfig,
    *,
    name: str | None = None,
    node_id: str | None = None,
    timeout: float = 120.0,
) -> tuple[ActorHandle, str]:
    """Start a gateway actor (on ``node_id`` if given) and return it with its base URL once it
    listens (blocking). Clients use ``url + "/v1"``."""
    config.check()
    options: dict[str, Any] = {
        "namespace": config.namespace,
        "max_restarts": 0,
        "max_task_retries": 0,
        "max_concurrency": 16,
        "num_cpus": 0,
    }
    if name is not None:
        options["name"] = name
    if node_id is not None:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    handle = ray.remote(GatewayActor).options(**options).remote(config)
    url: str = ray.get(handle.address.remote(), timeout=timeout)
    return handle, url


def start_gateways(
    config: GatewayConfig, *, timeout: float = 120.0
) -> list[tuple[ActorHandle, str]]:
    """One gateway actor per alive node of the cluster (each listens on ``config.host`` of its
    node: use the node's address, and a token, to reach it from elsewhere)."""
    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    return [start_gateway(config, node_id=node, timeout=timeout) for node in nodes]


def stop_gateway(handle: ActorHandle, *, timeout: float = 30.0) -> None:
    """Stop it cleanly (requests drain, the last counts reach the ledger), then end it."""
    with contextlib.suppress(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        ray.get(handle.close.remote(), timeout=timeout)
    ray.kill(handle, no_restart=True)
