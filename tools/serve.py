"""``loraledger serve``: the ledger as a long-lived service.

One process owns the log (a SQLite file on local disk, or a PostgreSQL database named by a
``postgresql://`` URL: docs/stores.md; one writer either way) and runs the ``ControlPlane``
(publication, the reclaim driver, the reconciler, owner-lease expiry) over the engines named
on the command line, with the HTTP application of ``tools/http_app.py`` on top.

Safety rules, enforced before anything is opened:

* it listens on loopback by default; listening anywhere else **requires a token**
  (``LORALEDGER_TOKEN`` or ``--token-file``; ``--token`` still works but is visible in ``ps``
  and warned about), otherwise it refuses to start (exit 11): an unauthenticated control plane
  on a network would let anyone bind, release or publish;
* bodies, connections and slow clients are bounded (``engines/guard.py``; RELIABILITY.md,
  Security and limits): a flood is refused, not queued;
* SIGINT/SIGTERM stop it cleanly: the HTTP server drains, the drivers stop, the ledger writes
  its snapshot and closes the log, and the process exits 0 (uvicorn's own signal handling,
  which re-raises the signal after shutdown, is replaced for exactly that reason).
* Another controller on the same log (a second ``serve``) fences this one: it can never write
  again and its cached session bindings may be stale (the newcomer releases them), so it stops.
  From the moment the ledger notices (about a second, ``publisher/core/ledger.py``), ``/health``
  answers 503 and every turn and write is refused ``FENCED``; ``fenced_linger_s`` later it
  shuts down as for SIGTERM and exits 13 with one ``error:`` line naming both epochs.

Every committed event is logged as one line with its seq (``-v``) and counted in the metrics.

Provenance: the rows of every face -- serve's own OpenAI routes, and those gateway processes
send to ``POST /provenance`` -- are kept in the store beside the log
(``evlog/provenance_store.py``: ``<db>.provenance.sqlite``, or a table in a PostgreSQL log's
database), so ``loraledger audit LOG`` finds them all; ``--provenance FILE`` writes a JSON-lines
copy of serve's own rows too.
"""

from __future__ import annotations

import functools
import os
import secrets
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any

import anyio

from engines.guard import uvicorn_limits
from evlog.errors import StoreError
from evlog.stores import backend_of, describe
from publisher.core.decider.checks import _IDENT as NAME_RULE  # the ledger's own rule, not a copy
from tools.arguments import seconds
from tools.exitcodes import Exit, ToolError
from tools.listen import listening, serve_on
from tools.logconfig import get_logger
from tools.logfile import refuse_foreign
from tools.roles import ROUTE_ROLES
from tools.service_options import (
    EngineSpec,
    ServiceOptions,
    check_service_options,
    openai_options,
)

if TYPE_CHECKING:
    from engines.contract import Engine
    from evlog.provenance_store import ProvenanceStore
    from publisher.core.ledger import Ledger
    from publisher.drivers.plane import ControlPlane
    from publisher.openai import OpenAIGateway
    from publisher.remote.uploads import AdapterUploads
    from publisher.remote.wire import PublishVersion
    from tools.metrics import LedgerMetrics

log = get_logger("loraledger.serve")


class ServeOptions(ServiceOptions, frozen=True, kw_only=True):
    """``loraledger serve``'s options: the shared ones (``tools/service_options.py``) and the
    log, the deployment and the drivers' settings."""

    db: str
    port: int = 8765
    deployment: str = "default"
    prefix: str = "policy"
    capacity: int = 3
    max_staleness: int | None = None  # recorded as DeploymentConfigured (docs/sessions.md)
    synchronous: str = "FULL"
    private_reads: bool = False  # /status and /metrics need the token too
    gateway_owner: str = "openai-serve"  # the owner of the sessions the OpenAI routes bind
    gateway_ttl_s: float = 30.0
    suspend_after_s: float | None = 30.0  # failing probes for this long suspend an engine
    probe_timeout_s: float = 10.0  # one health probe of an engine
    # how often path engines answer each held version's canary (None: never; docs/operations.md)
    canary_every_s: float | None = None
    # Once fenced: how long /health keeps answering 503 and clients hear FENCED (rather than a
    # refused connection, which they would retry) before the server stops.
    fenced_linger_s: float = 2.0


def check_options(opts: ServeOptions) -> None:
    """Refuse bad options before anything exists: a deployment name the ledger would refuse
    once the log file, its artifacts folder and the engines were up (``--deployment 'a b/c'``
    ended in an ``ExceptionGroup`` and left a db file behind)."""
    check_service_options(opts)
    for option, value in (
        ("--deployment", opts.deployment),
        ("--prefix", opts.prefix),
        ("--alias", opts.alias),
    ):
        if not NAME_RULE.match(value):
            raise ToolError(
                Exit.USAGE,
                f"{option} {value!r}: letters, digits, '.', '_' and '-' only, starting with a "
                "letter or digit, at most 64 characters (it becomes part of engine-side names)",
            )
    ids = [e.engine_id for e in opts.engines]
    if len(set(ids)) != len(ids):
        raise ToolError(Exit.USAGE, f"engine ids must be unique, got {ids}")
    if opts.synchronous not in ("FULL", "NORMAL"):
        raise ToolError(Exit.USAGE, "--synchronous must be FULL or NORMAL")
    try:
        backend, where = backend_of(opts.db)
    except StoreError as exc:
        raise ToolError(Exit.USAGE, f"--db: {exc.message}") from None
    if backend == "sqlite":  # another file, or another application's database: left as it is
        refuse_foreign(where)
    artifacts = opts.artifact_root
    if artifacts and os.path.lexists(artifacts) and not os.path.isdir(artifacts):
        raise ToolError(Exit.USAGE, f"--artifacts {artifacts}: exists and is not a directory")
    if backend == "postgres" and opts.synchronous != "FULL":
        raise ToolError(Exit.USAGE, "--synchronous is a SQLite setting (PostgreSQL: always on)")
    if opts.max_staleness is not None and opts.max_staleness < 0:
        raise ToolError(Exit.USAGE, f"--max-staleness {opts.max_staleness} must be >= 0")
    if opts.private_reads and not (opts.token or opts.tokens):
        raise ToolError(Exit.USAGE, "--private-reads needs a token (LORALEDGER_TOKEN, --tokens)")
    if opts.capacity < 1:  # the ledger refuses it too, but only once the log exists
        raise ToolError(
            Exit.USAGE,
            f"--capacity {opts.capacity}: must be at least 1 (versions holding a slot at once)",
        )
    seconds("--probe-timeout", opts.probe_timeout_s)  # 0 s: every probe fails, engines suspended
    if opts.suspend_after_s is not None:  # None: never (the command line's 0)
        seconds("--suspend-after", opts.suspend_after_s, zero="never")
    if opts.canary_every_s is not None:  # None: never (the command line's 0)
        seconds("--canary-every", opts.canary_every_s, zero="never")
    seconds("gateway_ttl_s", opts.gateway_ttl_s)
    seconds("fenced_linger_s", opts.fenced_linger_s, zero="stop at once")


async def _open_engine(stack: AsyncExitStack, spec: EngineSpec, opts: ServiceOptions) -> Engine:
    """A live engine handle for ``spec``; closed by ``stack``."""
    if spec.kind == "sglang":
        from engines.sglang import SGLangEngine

        engine: Engine = SGLangEngine(spec.url or "", spec.engine_id, api_key=opts.engine_token)
    elif spec.kind == "sglang-tensors":  # SGLang >= 0.5.17 fed by its tensor route
        from engines.sglang_tensors import SGLangTensorEngine

        engine = SGLangTensorEngine(spec.url or "", spec.engine_id, api_key=opts.engine_token)
    elif spec.kind == "agent":  # AGENT_URL,KIND:ENGINE_URL: an engine fed by its host's agent
        from engines.agent import AgentEngine, engine_adapter

        agent_url, _, inner = (spec.url or "").partition(",")
        inner_kind, _, inner_url = inner.partition(":")
        try:
            inner_engine = engine_adapter(
                inner_kind,
                inner_url,
                spec.engine_id,
                api_key=opts.engine_token,
                served_model=opts.served_model,
            )
        except ValueError as exc:
            raise ToolError(Exit.USAGE, f"--engine {spec.engine_id}: {exc}") from None
        engine = AgentEngine(agent_url, inner_engine, api_key=opts.engine_token)
    elif spec.kind == "vllm":
        from engines.vllm import VLLMEngine

        engine = VLLMEngine(
            spec.url or "",
            spec.engine_id,
            served_model=opts.served_model,
            api_key=opts.engine_token,
        )
    elif spec.url:
        from engines.local.client import LocalHTTPEngine

        engine = LocalHTTPEngine(spec.url, spec.engine_id, api_key=opts.engine_token)
    else:
        return await _in_process_engine(stack, spec, opts)
    stack.push_async_callback(engine.aclose)
    return engine


async def _in_process_engine(
    stack: AsyncExitStack, spec: EngineSpec, opts: ServiceOptions
) -> Engine:
    """``ID=local:``: a local engine in this process, served on a loopback port of its own and
    reached over it as ``local:URL`` reaches a ``loraledger engine`` process. So the OpenAI
    routes relay to its OpenAI face by the one path every engine takes (streaming, the
    at-most-once rules, timeouts, a disconnect aborting the request; docs/openai.md), and its
    endpoint is recorded like any other. Its control routes (load, unload, transfer) take a
    token only this process knows (``--engine-token`` when given)."""
    try:
        from engines.local.client import LocalHTTPEngine
        from engines.local.engine import LocalEngine
        from engines.local.server import serve as serve_engine
    except ImportError as exc:
        raise ToolError(
            Exit.ENGINE_UNAVAILABLE,
            f"an in-process local engine needs the engine extra "
            f"(pip install 'loraledger[engine]'): {exc}",
        ) from None
    token = opts.engine_token or secrets.token_urlsafe(32)
    local = await stack.enter_async_context(
        LocalEngine(spec.engine_id, artifact_root=opts.artifact_root)
    )
    url = await stack.enter_async_context(serve_engine(local, token=token))
    engine = LocalHTTPEngine(url, spec.engine_id, api_key=token)
    stack.push_async_callback(engine.aclose)
    return engine


def beside_log(opts: ServeOptions, suffix: str) -> str:
    """A default file next to the log: beside a SQLite file, or ``loraledger<suffix>`` in the
    working directory for a PostgreSQL log (which has no directory of its own)."""
    backend, where = backend_of(opts.db)
    return f"{where}{suffix}" if backend == "sqlite" else f"loraledger{suffix}"


@asynccontextmanager
async def open_plane(opts: ServeOptions) -> AsyncIterator[Any]:
    """The store, the engines and the ``ControlPlane`` over them, closed in reverse order."""
    from evlog.errors import LoraLedgerError
    from evlog.stores import open_store
    from publisher.drivers.engine_ops import EngineTimeouts
    from publisher.drivers.fleet import Fleet
    from publisher.drivers.plane import ControlPlane

    artifact_root = opts.artifact_root or beside_log(opts, ".artifacts")
    os.makedirs(artifact_root, exist_ok=True)
    try:
        async with AsyncExitStack() as stack:
            store = await stack.enter_async_context(
                open_store(opts.db, synchronous=opts.synchronous)  # type: ignore[arg-type]
            )
            fleet = Fleet()
            for spec in opts.engines:
                fleet.add(await _open_engine(stack, spec, opts))
            plane = await stack.enter_async_context(
                ControlPlane.open(
                    store,
                    fleet,
                    deployment=opts.deployment,
                    prefix=opts.prefix,
                    capacity=opts.capacity,
                    artifact_root=artifact_root,
                    max_staleness=opts.max_staleness,
                    timeouts=EngineTimeouts(probe=opts.probe_timeout_s),
                    suspend_after_s=opts.suspend_after_s,
                    canary_every_s=opts.canary_every_s,
                )
            )
            yield plane
    except LoraLedgerError as exc:
        raise ToolError.from_ledger(exc, path=describe(opts.db)) from None


@asynccontextmanager
async def provenance_store(opts: ServeOptions) -> AsyncIterator[ProvenanceStore]:
    """The provenance store beside the log (created when absent), for every face's rows."""
    from evlog.errors import LoraLedgerError
    from evlog.provenance_store import open_provenance, provenance_location

    try:
        async with open_provenance(opts.db) as store:
            yield store
    except LoraLedgerError as exc:
        raise ToolError.from_ledger(exc, path=provenance_location(opts.db)) from None


@asynccontextmanager
async def openai_face(
    plane: ControlPlane, opts: ServeOptions, store: ProvenanceStore
) -> AsyncIterator[OpenAIGateway]:
    """The OpenAI routes next to the ledger (docs/openai.md): one gateway (its in-flight
    counts are reclaim evidence of the plane), one rollout worker relaying every session they
    bind (client-held: they outlive this process, and the plane releases idle ones after
    ``--session-idle-s``), provenance rows into ``store`` (and a JSON-lines copy
    with ``--provenance``)."""
    from publisher.gateway import Gateway, LocalView
    from publisher.gateway.provenance import JsonlSink, ProvenanceRecorder, StoreSink, Tee
    from publisher.openai import OpenAIGateway, OpenAIOptions, engine_routes
    from publisher.sessions import RolloutWorker

    ledger = plane.ledger
    sink = StoreSink(store)
    copy = Tee(sink, JsonlSink(opts.provenance)) if opts.provenance else sink
    async with ProvenanceRecorder(copy) as recorder:
        gateway = Gateway(
            plane.fleet,
            LocalView(ledger),
            gateway_id=opts.gateway_owner,
            recorder=recorder,
            clock=ledger.clock,
            on_engine_trouble=plane.reconciler.engine_trouble,
        )
        plane.add_inflight_source(gateway)
        async with RolloutWorker.open(
            ledger,
            gateway,
            owner=opts.gateway_owner,
            ttl_s=opts.gateway_ttl_s,
            sessions_idle_s=opts.session_idle_s,
        ) as worker:
            face = OpenAIGateway(
                worker,
                engine_routes(plane.fleet),
                OpenAIOptions(
                    alias=opts.alias,
                    token=opts.token,
                    tokens=opts.tokens,
                    policy=ROUTE_ROLES,
                    engine_token=opts.engine_token,
                    **openai_options(opts),
                ),
                clock=ledger.clock,
            )
            try:
                yield face
            finally:
                await face.aclose()


def make_publish(
    plane: ControlPlane, uploads: AdapterUploads
) -> Callable[[PublishVersion], Awaitable[Any]]:
    """``POST /versions``: publish as ``version_id`` a PEFT adapter directory on this host
    (``adapter_dir``) or an adapter a remote trainer uploaded (``digest``: read from the
    artifact store, ``uploads``), under the caller's ``request_id`` if any
    (``allow_rollback``: a version lower than the default, on purpose)."""
    from engines.artifacts import ArtifactError
    from evlog.errors import INVALID_INPUT, InvalidInput
    from publisher.drivers.adapter_source import AdapterSource

    async def publish(body: PublishVersion) -> Any:
        source: AdapterSource
        adapter_dir, digest = body.adapter_dir, body.digest
        if digest is not None and adapter_dir is None:
            source = await uploads.stored(digest, bucket_bytes=plane.bucket_bytes)
        elif adapter_dir is not None and digest is None:
            # Into the artifact store as it is read (streamed, hashed from the copy), then
            # published from there as an upload is: the adapter is never held in memory whole.
            try:
                copied = await anyio.to_thread.run_sync(plane.artifacts.copy_dir, adapter_dir)
            except (ArtifactError, OSError, ValueError) as exc:
                raise InvalidInput(INVALID_INPUT, f"cannot read {adapter_dir}: {exc}") from None
            source = await uploads.stored(copied.digest, bucket_bytes=plane.bucket_bytes)
        else:
            raise InvalidInput(INVALID_INPUT, "name exactly one of adapter_dir and digest")
        return await plane.publisher.publish(
            source,
            version_id=body.version_id,
            allow_rollback=body.allow_rollback,
            request_id=body.request_id,
        )

    return publish


def _server(
    app: Any, opts: ServiceOptions, verbosity: int, on_shutdown: Callable[[], None] | None = None
) -> Any:
    """The uvicorn server of ``app``; ``on_shutdown`` is called as it starts stopping (before
    it waits for open responses: the live page's streams end then)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextmanager
        def capture_signals(self) -> Iterator[None]:
            # Signals are handled by serve() itself, which then shuts everything down in
            # order; uvicorn's handler would re-raise the signal after its own shutdown and
            # kill the process before the ledger closed.
            yield

        async def shutdown(self, sockets: Any = None) -> None:
            if on_shutdown is not None:
                on_shutdown()
            await super().shutdown(sockets=sockets)

    config = uvicorn.Config(
        app,
        host=opts.host,
        port=opts.port,
        log_config=None,
        lifespan="off",
        access_log=verbosity >= 2,
        timeout_graceful_shutdown=5,
        **uvicorn_limits(
            max_connections=opts.max_connections, header_timeout_s=opts.header_timeout_s
        ),
    )
    return Server(config)


async def _follow(ledger: Ledger, metrics: LedgerMetrics) -> None:
    """Count and log every committed event (one line per decision, with its seq)."""
    async for record in ledger.subscribe():
        metrics.observe(record)
        log.info("event", seq=record.seq, type=record.type, stream=record.stream)


async def _stop_on_signals(server: Any) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("serve.stopping", signal=signal.Signals(signum).name)
            server.should_exit = True
            return


async def serve(
    opts: ServeOptions,
    *,
    verbosity: int = 0,
    on_ready: Callable[[str], None] | None = None,
    handle_signals: bool = True,
    stop: anyio.Event | None = None,
) -> None:
    """Run until SIGINT/SIGTERM (or ``stop`` is set); ``on_ready(url)`` once listening."""
    from publisher.openai import openai_routes
    from publisher.remote.uploads import AdapterUploads
    from tools.http_app import build_app
    from tools.metrics import LedgerMetrics
    from tools.replay import replay

    check_options(opts)
    async with (
        listening(opts.host, opts.port) as sockets,  # a busy port: nothing opened yet
        open_plane(opts) as plane,
        provenance_store(opts) as provenance,
        openai_face(plane, opts, provenance) as face,
    ):
        ledger = plane.ledger
        metrics = LedgerMetrics(
            lambda: ledger.state,
            [ledger.inflight_evidence],
            reclaim_sweeps=lambda: plane.reclaimer.sweeps,
            health_wakes=lambda: plane.reconciler.wakes,
        )
        uploads = AdapterUploads(plane.artifacts)
        app = build_app(
            ledger,
            metrics,
            token=opts.token,
            tokens=opts.tokens,
            publish=make_publish(plane, uploads),
            uploads=uploads,
            private_reads=opts.private_reads,
            extra_routes=openai_routes(face),
            max_generation_body_bytes=face.options.max_body_bytes,
            remove_engine=lambda engine_id: plane.remove_engine(engine_id, cause="operator"),
            report_trouble=plane.reconciler.engine_trouble,
            provenance=provenance,
            replayer=functools.partial(replay, opts.db),
        )
        server = _server(app, opts, verbosity, on_shutdown=app.state.ui.close)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_follow, ledger, metrics)
            if handle_signals:
                tg.start_soon(_stop_on_signals, server)
            if stop is not None:
                tg.start_soon(_stop_when, stop, server)
            tg.start_soon(_stop_when_fenced, ledger, server, opts.fenced_linger_s)
            tg.start_soon(_announce, server, opts, on_ready)
            await serve_on(server, sockets)
            tg.cancel_scope.cancel()
    fenced = ledger.fenced
    if fenced is not None:
        raise ToolError(
            Exit.FENCED,
            f"{describe(opts.db)}: {fenced.code}: {fenced.message}; this serve stopped "
            "(run one serve per log)",
        )
    log.info("serve.stopped", seq=ledger.state.last_seq)


async def _stop_when(stop: anyio.Event, server: Any) -> None:
    await stop.wait()
    server.should_exit = True


async def _stop_when_fenced(ledger: Ledger, server: Any, linger_s: float) -> None:
    """Stop once another controller fenced the ledger: nothing here may write again, and the
    turns of sessions bound before are refused (their bindings may be released by now). The
    ledger already refuses everything; ``linger_s`` lets probes and clients hear why."""
    fenced = await ledger.wait_fenced()
    log.error("serve.fenced", error=fenced.message, stopping_in_s=linger_s)
    await anyio.sleep(linger_s)
    server.should_exit = True


async def listening_url(server: Any, host: str, port: int) -> str | None:
    """Wait until uvicorn ``server`` accepts connections and return its URL (the port the OS
    chose when ``port`` is 0), or None when it stopped before it ever started."""
    while not server.started:
        if server.should_exit:
            return None
        await anyio.sleep(0.02)
    for s in server.servers:
        for sock in s.sockets:
            port = sock.getsockname()[1]
    bracketed = f"[{host}]" if ":" in host else host
    return f"http://{bracketed}:{port}"


async def _announce(
    server: Any, opts: ServeOptions, on_ready: Callable[[str], None] | None
) -> None:
    url = await listening_url(server, opts.host, opts.port)
    if url is None:
        return
    log.info("serve.listening", url=url, db=describe(opts.db))
    if on_ready is not None:
        on_ready(url)


def warn_if_open_elsewhere(db: str) -> bool:
    """Log a warning when another process has the SQLite log ``db`` open (a second ``serve``
    would fence the first: it stops, exit 13). A warning, not a refusal: the open may be a
    read-only tool's, and a dead writer's leftovers never count. Called by the command before
    anything opens the log (the check would drop this process's own SQLite locks)."""
    from tools.logfile import open_elsewhere

    backend, where = backend_of(db)
    if backend != "sqlite" or not open_elsewhere(where):
        return False
    log.warning(
        "serve.log_in_use",
        db=where,
        hint="another process has this log open; if it is a running serve, this one fences "
        "it (it stops with exit 13): run one serve per log",
    )
    return True
