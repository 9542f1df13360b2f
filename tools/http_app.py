"""The HTTP application of a running ledger: the Starlette app ``loraledger serve`` runs.

Routes, and the roles that may call them (``tools/roles.py``, the one policy the app consults;
docs/operations.md, "Roles"): ``op`` operator, ``tr`` trainer, ``ro`` rollout, ``gw`` gateway.

=======  ===============================  ===============  ===========================
method   path                             roles            what it does
=======  ===============================  ===============  ===========================
GET      ``/health``                      open (no token)  read-only
GET      ``/status``                      open unless      ``LedgerStatus`` as JSON
                                          private_reads,
                                          then any role
GET      ``/metrics``                     as ``/status``   Prometheus text format
GET      ``/routing``                     as ``/status``   the routing table remote
                                                           gateways route by
                                                           (``?epoch=E&serial=S&wait=W``:
                                                           a long poll, answered when it
                                                           is not table (E, S), 204 after
                                                           W seconds)
GET      ``/ui``                          as ``/status``   the operator's live page
                                                           (:mod:`tools.ui`)
GET      ``/ui/events``                   as ``/status``   its server-sent snapshots,
                                                           one per commit
GET      ``/ui/incidents``,               as ``/status``   the last incidents, a
         ``/ui/version/{version}``,                        version's or an engine's
         ``/ui/engine/{engine}``                           timeline (``replay``'s, as
                                                           HTML; 404 without ``replayer``)
POST     ``/owners``                      op ro gw         register a rollout worker
         (an owner or session id in a path is any printable text, percent-escaped: ``/`` too)
POST     ``/owners/{owner}/renew``        op ro gw         renew its lease (+ in-flight)
POST     ``/owners/{owner}/deregister``   op ro gw         a clean exit (sessions released)
POST     ``/sessions/{session}/bind``     op ro gw         bind (idempotent)
POST     ``/sessions/{session}/release``  op ro gw         release (idempotent)
POST     ``/sessions/forget``             op               forget released sessions'
                                                           tombstones
POST     ``/sessions/commands``           op ro gw         binds, releases and forgets of
                                                           many sessions in one round trip
                                                           (a gateway's batch)
POST     ``/leases/renew``                op ro gw         renew many owners' lives at once
POST     ``/versions``                    op tr            publish an adapter directory on
                                                           this host, or an uploaded
                                                           adapter by digest
POST     ``/adapters/{digest}``           op tr            offer an adapter's upload (how
                                                           many bytes are here, or stored)
PUT      ``/adapters/{digest}/weights``   op tr            its weights file, from
                                                           ``?offset=`` (streamed; checked
                                                           against the digest once whole)
POST     ``/v1/chat/completions``,        op ro gw         OpenAI-compatible generation
         ``/v1/completions``                               (binds on a session's first turn)
GET      ``/v1/models``                   op ro gw         the alias and the versions
GET      ``/v1/models/{model}``           op ro gw         one of them (404 otherwise)
POST     ``/v1/sessions/{s}/release``     op ro gw         end an OpenAI session
POST     ``/engines/{engine}/suspend``    op               quarantine an engine
POST     ``/engines/{engine}/resume``     op               lift it (served again once
                                                           repaired)
POST     ``/engines/{engine}/remove``     op               remove it from the fleet (routed
                                                           away, then drained: answers once
                                                           it is idle)
POST     ``/engines/{engine}/trouble``    op gw            a gateway process saw a
                                                           generation on it fail (a hint
                                                           for the reconciler)
POST     ``/provenance``                  op gw            provenance rows a face in
                                                           another process served, for the
                                                           store beside the log
=======  ===============================  ===============  ===========================

The ``/v1/`` routes are :mod:`publisher.openai`'s (docs/openai.md), mounted here so a
laptop runs the ledger and the gateway as one process; mounted last, their fallback answers
any other request under ``/v1/`` in OpenAI's error shape (404/405), and nothing outside it.

Why roles, and a token on every state-changing route but never on the read-only ones: a
scraper or a dashboard must not hold the power to bind, release or publish, and a rollout
(model-written code runs beside its credentials) must not hold the power to publish, suspend
an engine or forget sessions. Each route's check runs from the headers alone, before its body
is read (:class:`engines.access.Access`): 401 for a missing or unknown token, 403
``FORBIDDEN`` naming the roles needed for a known token of another role. A service started
without any token refuses every route that needs one (403 ``WRITES_DISABLED``): there is no
anonymous write mode to forget about. Tokens are compared in constant time, every one.

Every body is a struct of :mod:`publisher.remote.wire` (the clients use the same ones), and
every route calls the :class:`~publisher.remote.service.LedgerService` the Ray ledger actor
calls too. Refusals keep the ledger's codes: ``{"code": ..., "message": ..., "details": {...}}``
(:class:`~publisher.remote.wire.Refusal`) with 400 (bad input), 404 (unknown
owner/version/engine), 409 (a refusal by the rules), 503 (the ledger is closed or fenced).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from engines.access import Access, TokenBook
from engines.contract import AmbiguousReply, CleanRefusal
from engines.guard import BadBody, ErrorBody, Guard, exception_handlers, strict_decode
from evlog.errors import LoraLedgerError, StoreCode
from evlog.provenance_store import ProvenanceStore
from publisher.core.errors import Code, LedgerError
from publisher.core.ledger import Ledger
from publisher.openai import MAX_BODY_BYTES as OPENAI_MAX_BODY_BYTES
from publisher.openai import guard_error_body
from publisher.remote import wire
from publisher.remote.service import LedgerService, TroubleBatch, TroubleReceiver
from publisher.remote.uploads import AdapterUploads
from tools.metrics import LedgerMetrics
from tools.roles import ROUTE_ROLES
from tools.ui import Replayer, ledger_pages

# the body of POST /versions -> outcome struct
Publish = Callable[[wire.PublishVersion], Awaitable[Any]]

_encoder = msgspec.json.Encoder()
_STATUS_OF_CODE = {
    Code.INVALID_INPUT: 400,
    Code.INVALID_VERSION: 400,
    Code.UNKNOWN_OWNER: 404,
    Code.UNKNOWN_VERSION: 404,
    Code.UNKNOWN_ENGINE: 404,
    wire.UploadCode.DIGEST_MISMATCH: 400,
    wire.UploadCode.INVALID_ADAPTER: 400,
    wire.UploadCode.UPLOAD_TOO_LARGE: 413,
    wire.UploadCode.UNKNOWN_UPLOAD: 404,
    wire.UploadCode.ADAPTER_NOT_UPLOADED: 404,
    Code.LEDGER_CLOSED: 503,
    Code.FENCED: 503,
    StoreCode.STORE_FAILED: 503,
}


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_encoder.encode(data), status, headers, media_type="application/json")


def _error(code: str, message: str, status: int, **details: Any) -> Response:
    headers = {"WWW-Authenticate": 'Bearer realm="loraledger"'} if status == 401 else None
    return _json(wire.error_body(code, message, details), status, headers)


# The largest body of a ledger route: a gateway's batch of session commands (its client keeps
# each under 768 KiB: publisher/remote/http.py) or a renewal of 1024 in-flight entries.
MAX_BODY_BYTES = 1024 * 1024


def _error_body(code: str, message: str) -> Any:
    return wire.error_body(code, message)


def build_app(
    ledger: Ledger,
    metrics: LedgerMetrics,
    *,
    token: str | None,
    tokens: Sequence[tuple[str, str]] = (),
    publish: Publish | None = None,
    private_reads: bool = False,
    max_body_bytes: int = MAX_BODY_BYTES,
    extra_routes: Sequence[BaseRoute] = (),
    max_generation_body_bytes: int = OPENAI_MAX_BODY_BYTES,
    remove_engine: Callable[[str], Awaitable[Any]] | None = None,
    report_trouble: TroubleReceiver | None = None,
    provenance: ProvenanceStore | None = None,
    uploads: AdapterUploads | None = None,
    replayer: Replayer | None = None,
) -> Starlette:
    """The app over a running ``ledger``. ``publish`` (from a ``ControlPlane``) enables
    ``POST /versions``; without it that route is refused with
    ``INVALID_STATE`` (409). ``token`` is the operator's; ``tokens`` the
    ``(role, token)`` pairs of ``--tokens`` (``tools/roles.py`` says which role may call what).
    ``private_reads``: ``/status``, ``/metrics`` and ``/routing`` need a token too, of any role
    (they show engine URLs and versions); ``/health`` stays open for probes. Every route's
    body is capped at ``max_body_bytes`` (413) and parsed as strict JSON (NaN, Infinity,
    1e400, 2^80: 400). ``extra_routes`` (the OpenAI routes of :mod:`publisher.openai`, under
    ``/v1/``) check their own token and answer in OpenAI's error shape; their bodies (whole
    conversations, images inline) are capped at
    ``max_generation_body_bytes``, refused in that shape too, and read to the end before the
    413 closes the connection (bounded: ``engines.guard.Guard``, ``drains``), so an OpenAI
    client reads the refusal instead of a reset. ``remove_engine`` (the control plane's)
    removes an engine (routed away, drained, its handle dropped) and returns the requests still
    running on it; without it the ledger records the removal.
    ``report_trouble`` (the reconciler's ``engine_trouble``) hears what gateway processes
    report; without it a report is answered ``{"heard": false}``: nobody here watches the
    engines. ``provenance`` (the store beside the log) keeps the rows gateway processes send
    to ``POST /provenance``; without it that route is refused ``INVALID_STATE``. ``uploads``
    receives adapters remote trainers send (``/adapters/...``, whose weights body is capped by
    ``uploads.max_bytes`` instead); without it those routes are refused ``INVALID_STATE``.
    ``replayer`` (:func:`tools.replay.replay` over this service's log) serves the live page's
    incidents and timelines; without it they answer 404."""
    access = Access(TokenBook(token, tokens), ROUTE_ROLES, private_reads=private_reads)
    service = LedgerService(ledger, engine_trouble=report_trouble, provenance=provenance)

    def authorized(request: Request, route: str) -> Response | None:
        """The role check of ``route`` (``tools/roles.py``), from the headers alone."""
        denied = access.check(route, request.headers.get("authorization", ""))
        if denied is None:
            return None
        return _error(denied.code, denied.message, denied.status, **denied.details)

    def writer(
        route: str, body_type: type[Any] | None, handler: Callable[..., Awaitable[Any]]
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            refused = authorized(request, route)
            if refused is not None:
                return refused
            body = None
            if body_type is not None:
                try:
                    body = strict_decode(await request.body(), body_type)
                except BadBody as exc:
                    return _error(Code.INVALID_INPUT, str(exc), 400)
            try:
                outcome = await handler(request, body)
            except LoraLedgerError as exc:
                return _error(
                    exc.code, exc.message, _STATUS_OF_CODE.get(exc.code, 409), **exc.details
                )
            return _json(msgspec.to_builtins(outcome))

        return endpoint

    async def health(request: Request) -> Response:
        """200 ``ok: true`` while this ledger may write; 503 ``ok: false`` with the reason once
        another controller fenced it (a probe then takes this process out; it is stopping)."""
        s = ledger.state
        body: dict[str, Any] = {
            "ok": True,
            "deployment": s.deployment,
            "epoch": s.epoch,
            "seq": s.last_seq,
            "routable": list(s.routable_engines()),
        }
        fenced = ledger.fenced
        if fenced is None:
            return _json(body)
        body.update(
            ok=False,
            epoch=fenced.details["epoch"],  # this controller's (the state may show the rival's)
            fenced_by_epoch=fenced.details["fenced_by_epoch"],
            code=fenced.code,
            reason=fenced.message,
        )
        return _json(body, 503)

    def reader(
        route: str, handler: Callable[[Request], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            refused = authorized(request, route)
            return refused if refused is not None else await handler(request)

        return endpoint

    async def status(request: Request) -> Response:
        return _json(service.status())

    async def routing(request: Request) -> Response:
        query = request.query_params
        if "wait" not in query:
            return _json(service.table())
        try:
            wait_s = float(query["wait"])
            mark = (int(query["epoch"]), int(query["serial"])) if "epoch" in query else None
        except (KeyError, ValueError):
            return _error(
                Code.INVALID_INPUT, "wait (seconds), epoch and serial (integers) expected", 400
            )
        if not math.isfinite(wait_s) or wait_s < 0:
            return _error(Code.INVALID_INPUT, "wait must be a finite number of seconds >= 0", 400)
        table = await service.wait_routing(mark, wait_s)
        return Response(status_code=204) if table is None else _json(table)

    async def scrape(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def register(request: Request, body: wire.RegisterOwner) -> Any:
        return await service.register(
            body.owner, body.ttl_s, body.incarnation, body.sessions_idle_s, secret=body.secret
        )

    async def deregister(request: Request, body: wire.DeregisterOwner) -> Any:
        owner = request.path_params["owner"]
        return await service.deregister(owner, body.incarnation, secret=body.secret)

    async def renew(request: Request, body: wire.RenewLease) -> Any:
        owner = request.path_params["owner"]
        counts = wire.counts(body.inflight)
        service.renew_one(owner, counts, body.incarnation, body.sessions, secret=body.secret)
        return wire.Renewed()

    async def renew_lives(request: Request, body: wire.RenewLeases) -> Any:
        lives = {(x.owner, x.incarnation): wire.counts(x.inflight) for x in body.lives}
        touched = {(x.owner, x.incarnation): x.sessions for x in body.lives if x.sessions}
        secrets = {(x.owner, x.incarnation): x.secret for x in body.lives}
        lost, table = service.renew(lives, body.mark, touched, secrets=secrets)
        return wire.LeasesRenewed(
            lost=[
                wire.LostLife(owner=owner, incarnation=life, refusal=wire.refusal(error))
                for (owner, life), error in lost.items()
            ],
            routing=table,
        )

    async def bind(request: Request, body: wire.BindSession) -> Any:
        session = request.path_params["session"]
        return await ledger.bind(
            session, body.owner, incarnation=body.incarnation, secret=body.secret
        )

    async def release(request: Request, body: wire.ReleaseSession) -> Any:
        return await ledger.release(
            request.path_params["session"],
            body.owner,
            cause=body.cause,
            incarnation=body.incarnation,
            secret=body.secret,
        )

    async def forget(request: Request, body: wire.ForgetSessions) -> Any:
        return await ledger.forget(body.sessions)

    async def sessions(request: Request, body: wire.ExecuteSessions) -> Any:
        results, table = await service.execute(body.commands, body.mark)
        return wire.SessionsAnswered(
            results=[
                wire.refusal(r) if isinstance(r, LoraLedgerError) else r  # type: ignore[misc]
                for r in results
            ],
            routing=table,
        )

    async def publish_version(request: Request, body: wire.PublishVersion) -> Any:
        if publish is None:
            raise LedgerError(Code.INVALID_STATE, "this service has no publisher (no fleet)")
        return await publish(body)

    def receiving() -> AdapterUploads:
        if uploads is None:
            raise LedgerError(Code.INVALID_STATE, "this service takes no adapter uploads")
        return uploads

    async def offer_adapter(request: Request, body: wire.OfferAdapter) -> Any:
        return await receiving().offer(request.path_params["digest"], body.config, body.size)

    async def adapter_weights(request: Request) -> Response:
        """The weights file, streamed to disk as it arrives (not a ``writer``: its body is
        bytes, read by ``uploads`` chunk by chunk, never whole)."""
        refused = authorized(request, "PUT /adapters/{digest}/weights")
        if refused is not None:
            return refused
        offset = request.query_params.get("offset", "0")
        if not offset.isdigit() or len(offset) > 18:
            return _error(Code.INVALID_INPUT, f"offset {offset[:24]!r} is not a byte count", 400)
        try:
            state = await receiving().receive(
                request.path_params["digest"], int(offset), request.stream()
            )
        except LoraLedgerError as exc:
            return _error(exc.code, exc.message, _STATUS_OF_CODE.get(exc.code, 409), **exc.details)
        except ClientDisconnect:  # the bytes that arrived were kept: the next offer resumes
            return Response(status_code=400)
        return _json(msgspec.to_builtins(state))

    async def suspend_engine(request: Request, body: wire.EngineAction) -> Any:
        engine = request.path_params["engine"]
        return await ledger.suspend_engine(engine, cause="operator", detail=body.detail)

    async def resume_engine(request: Request, body: wire.EngineAction) -> Any:
        return await ledger.resume_engine(request.path_params["engine"], cause="operator")

    def member(request: Request) -> str:
        """The ``{engine}`` of the path, which must be a fleet member."""
        engine: str = request.path_params["engine"]
        if engine not in ledger.state.engines:
            raise LedgerError(Code.UNKNOWN_ENGINE, f"engine {engine!r} is not a fleet member")
        return engine

    async def remove(request: Request, body: wire.EngineAction) -> Any:
        engine = member(request)
        if remove_engine is not None:
            left = await remove_engine(engine)  # routed away, then drained
            return {"no_op": False, "in_flight_left": int(left or 0)}
        return await ledger.remove_engine(engine, cause="operator")

    async def trouble(request: Request, body: wire.TroubleReport) -> Any:
        engine = member(request)
        kind = CleanRefusal if body.clean else AmbiguousReply
        error = kind(body.code, body.message, engine_id=engine, dispatched=body.dispatched)
        batch = TroubleBatch(
            incarnation=body.incarnation,
            age_s=body.age_s,
            failures=body.failures,
            reporter=body.reporter,
        )
        return wire.Heard(heard=service.trouble(engine, error, batch))

    async def store_provenance(request: Request, body: wire.StoreProvenance) -> Any:
        return wire.ProvenanceStored(stored=await service.store_provenance(body.rows))

    ui = ledger_pages(ledger, replayer)  # kept as app.state.ui: serve ends its streams on stop
    routes = [
        Route("/health", reader("GET /health", health), methods=["GET"]),
        Route("/status", reader("GET /status", status), methods=["GET"]),
        Route("/routing", reader("GET /routing", routing), methods=["GET"]),
        Route("/metrics", reader("GET /metrics", scrape), methods=["GET"]),
        Route("/owners", writer("POST /owners", wire.RegisterOwner, register), methods=["POST"]),
        Route(
            "/owners/{owner:path}/renew",
            writer("POST /owners/{owner}/renew", wire.RenewLease, renew),
            methods=["POST"],
        ),
        Route(
            "/owners/{owner:path}/deregister",
            writer("POST /owners/{owner}/deregister", wire.DeregisterOwner, deregister),
            methods=["POST"],
        ),
        Route(
            "/leases/renew",
            writer("POST /leases/renew", wire.RenewLeases, renew_lives),
            methods=["POST"],
        ),
        Route(
            "/sessions/commands",
            writer("POST /sessions/commands", wire.ExecuteSessions, sessions),
            methods=["POST"],
        ),
        Route(
            "/sessions/forget",
            writer("POST /sessions/forget", wire.ForgetSessions, forget),
            methods=["POST"],
        ),
        Route(
            "/sessions/{session:path}/bind",
            writer("POST /sessions/{session}/bind", wire.BindSession, bind),
            methods=["POST"],
        ),
        Route(
            "/sessions/{session:path}/release",
            writer("POST /sessions/{session}/release", wire.ReleaseSession, release),
            methods=["POST"],
        ),
        Route(
            "/versions",
            writer("POST /versions", wire.PublishVersion, publish_version),
            methods=["POST"],
        ),
        Route(
            "/adapters/{digest}",
            writer("POST /adapters/{digest}", wire.OfferAdapter, offer_adapter),
            methods=["POST"],
        ),
        Route("/adapters/{digest}/weights", adapter_weights, methods=["PUT"]),
        Route(
            "/engines/{engine}/suspend",
            writer("POST /engines/{engine}/suspend", wire.EngineAction, suspend_engine),
            methods=["POST"],
        ),
        Route(
            "/engines/{engine}/resume",
            writer("POST /engines/{engine}/resume", wire.EngineAction, resume_engine),
            methods=["POST"],
        ),
        Route(
            "/engines/{engine}/remove",
            writer("POST /engines/{engine}/remove", wire.EngineAction, remove),
            methods=["POST"],
        ),
        Route(
            "/engines/{engine}/trouble",
            writer("POST /engines/{engine}/trouble", wire.TroubleReport, trouble),
            methods=["POST"],
        ),
        Route(
            "/provenance",
            writer("POST /provenance", wire.StoreProvenance, store_provenance),
            methods=["POST"],
        ),
        *ui.routes(reader),
        *extra_routes,
    ]

    def generation(path: str) -> bool:
        return path.startswith("/v1/")

    def cap(path: str) -> int:
        if generation(path):
            return max_generation_body_bytes
        if uploads is not None and path.startswith("/adapters/") and path.endswith("/weights"):
            return uploads.max_bytes
        return max_body_bytes

    def error_body_for(path: str) -> ErrorBody:
        return guard_error_body if generation(path) else _error_body

    app = Starlette(
        routes=routes,
        middleware=[
            Middleware(
                Guard,
                token=None,  # the routes check it themselves: 403 when none is configured
                protected=lambda path: False,
                cap=cap,
                error_body=_error_body,
                error_body_for=error_body_for,
                drains=generation,
            )
        ],
        exception_handlers=exception_handlers(_error_body, error_body_for),
    )
    app.state.ui = ui
    return app
