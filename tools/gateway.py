"""``loraledger gateway``: the OpenAI routes in a process of their own, in front of a remote
``loraledger serve`` (docs/openai.md, "Gateway processes").

A node can run several: each registers its own owner with the ledger, binds sessions there
(durably, before anything is sent; concurrent first turns of one session share one bind),
forwards its in-flight counts with its lease renewals (serve's reclaim waits for them) and
routes from a snapshot of the ledger's status, refreshed every ``--refresh-s`` and whenever a
turn finds no holder; without ``--engine`` it reaches each engine at the endpoint the ledger
records, and follows an engine that came back behind another address. Rendezvous hashing
makes every process pick the same engine for a session without talking to the others.

Safety rules are serve's: loopback unless a token is given (the same token is the clients'
bearer and the one presented to the ledger), bounded bodies and connections, SIGINT/SIGTERM
stop it cleanly (in-flight requests drain, the last counts reach the ledger, its owner
deregisters). It is a relay: the sessions it bound are client-held, so neither its stop nor
its crash ends them; the next process (this one restarted, or any other) serves their next
turns, and ``serve`` releases the idle ones.

Provenance rows go to the ledger's process (its store beside the log), through the ledger
client, sent again until stored; ``--provenance FILE`` also keeps a JSON-lines copy here. On
exit, rows the ledger did not take within ``DRAIN_TIMEOUT_S`` (it is down) are logged as an
error with their ids (``provenance.unsent``), rather than holding the exit forever.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio

from evlog.locations import redacted
from tools.arguments import seconds, service_url
from tools.exitcodes import Exit, ToolError
from tools.listen import listening, serve_on
from tools.logconfig import get_logger
from tools.roles import ROUTE_ROLES
from tools.serve import (
    _open_engine,
    _server,
    _stop_on_signals,
    _stop_when,
    listening_url,
)
from tools.service_options import (
    ENGINE_KINDS,
    EngineSpec,
    ServiceOptions,
    check_service_options,
    openai_options,
)

if TYPE_CHECKING:
    from publisher.drivers.fleet import Fleet
    from publisher.openai import OpenAIGateway
    from publisher.remote import HttpLedger

log = get_logger("loraledger.gateway")

# Drawn once per process: with the host and the pid, the default owner id. Host and pid alone
# repeat across containers that share the host's network (every one is pid 1), and two
# gateways under one owner id are two lives of one owner: the second would release the first's
# sessions and fence it out.
PROCESS_TAG = uuid.uuid4().hex[:8]
# How long an exiting gateway keeps sending the provenance rows it still holds to a ledger that
# does not answer (see the module docstring).
DRAIN_TIMEOUT_S = 30.0


class GatewayOptions(ServiceOptions, frozen=True, kw_only=True):
    """``loraledger gateway``'s options: the shared ones (``tools/service_options.py``) and the
    ledger it fronts, its owner and its lease. Two shared ones mean something of their own
    here: no ``engines`` means each engine at the endpoint the ledger reports, and
    ``provenance`` is a local copy of rows that go to the ledger's store anyway."""

    ledger: str  # the base URL of ``loraledger serve``
    port: int = 8766
    owner: str | None = None  # default gateway-<host>-<pid>-<random>: see PROCESS_TAG
    ttl_s: float = 30.0
    refresh_s: float = 1.0
    renew_s: float = 0.5

    @property
    def owner_id(self) -> str:
        return self.owner or f"gateway-{socket.gethostname()}-{os.getpid()}-{PROCESS_TAG}"


def check_options(opts: GatewayOptions) -> None:
    check_service_options(opts)
    service_url("--ledger", opts.ledger)
    if not opts.token:
        raise ToolError(
            Exit.USAGE,
            "a gateway needs the ledger's token (LORALEDGER_TOKEN or --token-file): it binds "
            "and releases sessions there",
        )
    seconds("--ttl-s", opts.ttl_s)
    seconds("--refresh-s", opts.refresh_s)
    for spec in opts.engines:
        if not spec.url:
            raise ToolError(
                Exit.USAGE, f"--engine {spec.engine_id}: a gateway reaches engines by URL"
            )


def engine_specs(opts: GatewayOptions, status: Any) -> tuple[EngineSpec, ...]:
    """The engines this process reaches: ``--engine``, else each engine of the ledger's fleet
    at the endpoint the ledger reports (a fleet member with none cannot be reached)."""
    if opts.engines:
        return opts.engines
    return tuple(
        EngineSpec(engine_id=e.engine, kind=e.kind, url=e.endpoint.rstrip("/"))
        for e in status.engines
        if e.endpoint and e.kind in ENGINE_KINDS
    )


@asynccontextmanager
async def gateway_face(opts: GatewayOptions) -> AsyncIterator[Any]:
    """The ledger client, the owner's rollout worker and the OpenAI face over them."""
    from evlog.errors import LoraLedgerError
    from publisher.drivers.fleet import Fleet
    from publisher.gateway import Gateway
    from publisher.gateway.provenance import AnySink, JsonlSink, ProvenanceRecorder, Tee
    from publisher.openai import OpenAIGateway, OpenAIOptions, engine_routes
    from publisher.remote import HttpLedger, LedgerUnreachable
    from publisher.sessions import RolloutWorker

    owner = opts.owner_id

    def sink_of(ledger: HttpLedger) -> AnySink:
        to_ledger = ledger.provenance_sink()
        return Tee(to_ledger, JsonlSink(opts.provenance)) if opts.provenance else to_ledger

    try:
        async with (
            AsyncExitStack() as stack,
            HttpLedger.connect(
                opts.ledger,
                token=opts.token,
                renew_interval=opts.renew_s,
                refresh_interval=opts.refresh_s,
            ) as ledger,
            ProvenanceRecorder(sink_of(ledger), drain_timeout_s=DRAIN_TIMEOUT_S) as recorder,
        ):
            fleet = Fleet()
            opened: dict[str, EngineSpec] = {}
            for spec in engine_specs(opts, ledger.view.status()):
                fleet.add(await _open_engine(stack, spec, opts))
                opened[spec.engine_id] = spec
            gateway = Gateway(
                fleet,
                ledger.view,
                gateway_id=owner,
                recorder=recorder,
                on_engine_trouble=ledger.engine_failed,  # serve's reconciler hears it
            )
            async with RolloutWorker.open(  # a relay: its sessions outlive this process
                ledger, gateway, owner=owner, ttl_s=opts.ttl_s, sessions_idle_s=opts.session_idle_s
            ) as worker:
                face = OpenAIGateway(
                    worker,
                    engine_routes(fleet),
                    OpenAIOptions(
                        alias=opts.alias,
                        token=opts.token,
                        tokens=opts.tokens,
                        policy=ROUTE_ROLES,
                        engine_token=opts.engine_token,
                        **openai_options(opts),
                    ),
                )
                try:
                    async with anyio.create_task_group() as tg:
                        if not opts.engines:  # the ledger says where engines are: follow it
                            tg.start_soon(
                                _follow_endpoints, ledger, fleet, face, stack, opts, opened
                            )
                        yield face
                        tg.cancel_scope.cancel()
                finally:
                    await face.aclose()
    except LedgerUnreachable as exc:
        raise ToolError(
            Exit.UNREACHABLE,
            f"the ledger at {redacted(opts.ledger)} cannot be reached: {exc}",
        ) from None
    except LoraLedgerError as exc:
        raise ToolError(
            Exit.FAILED,
            f"the ledger at {redacted(opts.ledger)} refused: {exc.code}: {exc.message}",
        ) from None


async def _follow_endpoints(
    ledger: HttpLedger,
    fleet: Fleet,
    face: OpenAIGateway,
    stack: AsyncExitStack,
    opts: GatewayOptions,
    opened: dict[str, EngineSpec],
) -> None:
    """Keep reaching each engine where the ledger says it serves (no ``--engine`` given).

    An engine that came back behind another address (its restart records the new endpoint)
    or joined after this process started is followed at the next status read: a new handle
    and a new OpenAI route. The ledger's routing still decides whether it gets traffic (a
    restarted engine is not routable until repaired). The handle it replaces stays open until
    the gateway stops, so a request already sent on it finishes there."""
    from publisher.openai import engine_routes

    while True:
        await anyio.sleep(opts.refresh_s)
        for spec in engine_specs(opts, ledger.view.status()):
            if opened.get(spec.engine_id) == spec:
                continue
            before = opened.get(spec.engine_id)
            opened[spec.engine_id] = spec  # once per change, whatever comes of it
            try:
                engine = await _open_engine(stack, spec, opts)
            except ToolError as exc:
                log.error("gateway.engine_unusable", engine=spec.engine_id, error=exc.message)
                continue
            fleet.replace(engine)
            face.engines.update(engine_routes([engine]))
            log.info(
                "gateway.engine_followed",
                engine=spec.engine_id,
                url=spec.url,
                before=before.url if before is not None else None,
            )


async def run_gateway(
    opts: GatewayOptions,
    *,
    verbosity: int = 0,
    on_ready: Callable[[str, str], None] | None = None,
    handle_signals: bool = True,
    stop: anyio.Event | None = None,
) -> None:
    """Run until SIGINT/SIGTERM (or ``stop``); ``on_ready(url, owner)`` once listening."""
    from publisher.openai import openai_app
    from tools.ui import gateway_pages

    check_options(opts)
    async with (
        listening(opts.host, opts.port) as sockets,  # a busy port: no owner registered yet
        gateway_face(opts) as face,
    ):
        # the routes behind their guard (body cap, 413 in OpenAI's shape), as on a Ray actor,
        # and this process's own live page (open: it shows what /status of serve shows)
        page = gateway_pages(face.worker.gateway.view.status, face.worker.bindings)
        app = openai_app(face, page.routes(lambda route, endpoint: endpoint))
        server = _server(app, opts, verbosity, on_shutdown=page.close)
        async with anyio.create_task_group() as tg:
            if handle_signals:
                tg.start_soon(_stop_on_signals, server)
            if stop is not None:
                tg.start_soon(_stop_when, stop, server)
            tg.start_soon(_announce, server, opts, on_ready)
            await serve_on(server, sockets)
            tg.cancel_scope.cancel()
    log.info("gateway.stopped", owner=opts.owner_id)


async def _announce(
    server: Any, opts: GatewayOptions, on_ready: Callable[[str, str], None] | None
) -> None:
    url = await listening_url(server, opts.host, opts.port)
    if url is None:
        return
    ledger = redacted(opts.ledger)
    log.info("gateway.listening", url=url, ledger=ledger, owner=opts.owner_id)
    if on_ready is not None:
        on_ready(url, opts.owner_id)
