"""The OpenAI-compatible face of the gateway: pinning for any stack that speaks OpenAI HTTP.

``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming or not),
``GET /v1/models`` and ``GET /v1/models/{model}``, as Starlette routes any process can mount:
``loraledger serve`` (next to the ledger), ``loraledger gateway`` (a separate process against a
remote ``serve``), a Ray actor.
Build them with :func:`openai_routes` (or a whole app with :func:`openai_app`) from an
:class:`OpenAIGateway`, which holds what the routes need: a :class:`RolloutWorker` (the owner
of every HTTP session: shared binds, lease, in-flight tally), its :class:`Gateway` (routing,
in-flight counts, provenance recorder) and a :class:`GatewayView` of the ledger (routing,
incarnations, the version list).

The rules are the Python path's, reused, not restated (docs/openai.md):

* **Session**: header ``x-session-id``, else the body's ``session_id``. The first generation
  binds it exactly as ``SessionBinder`` does (one shared bind, durable before anything is
  sent); with no session id the request is a one-turn session: bound, served, released.
* **model**: the alias (``policy`` by default) means "my session's version" and is rewritten
  to the bound engine-side name; a full version name is accepted only if it is the bound one
  (else ``409 VERSION_NOT_BOUND``). A name that is neither the alias nor a version of
  ``/v1/models`` is ``404 model_not_found``, and a version name on a session that provably is
  not bound yet (and is not the default it would bind to) is ``409 VERSION_NOT_BOUND``, both
  refused before anything is bound (``OpenAIGateway._refusal_before_bind``).
* **Unknown routes and methods** answer in OpenAI's error shape (``404 UNKNOWN_ROUTE``,
  ``405 METHOD_NOT_ALLOWED``), never the router's plain text or a redirect.
* **Routing**: ``Gateway.admit`` -- a routable holder of the version, by rendezvous hashing of
  the session id (:mod:`publisher.affinity`), counted in flight before the first ``await``.
* **At most once**: what provably did not run may try the next holder, once per holder, by
  the Python path's rule (:func:`publisher.gateway.try_elsewhere`): a connection refused
  (nothing sent), or a clean ``NOT_LOADED`` (the engine does not hold the name; nothing has
  been sent to the client yet either). Any failure after a byte may have left is
  ``502 AMBIGUOUS_DISPATCH`` and is never resent; any other clean refusal comes back with the
  engine's status and code, and so does the last ``NOT_LOADED`` when no holder is left.
* **Engine trouble**: every failure that says something about the engine (connection refused,
  a reply lost or timed out, a 5xx, a ``NOT_LOADED``/``NAME_RECLAIMED`` refusal) is reported
  through the gateway's one hook (``Gateway.report_trouble`` -> ``on_engine_trouble``), exactly
  as the Python path reports it, so the reconciler looks at that engine now.
* **Streaming** passes the engine's SSE events through as they arrive (framed, never held);
  usage is always asked of the engine, and its chunk is dropped when the client did not ask.
  A client that disconnects cancels the upstream request (its connection is closed).
* **Headers** before the first byte: ``x-loraledger-version``, ``-digest``, ``-engine``,
  ``-staleness`` and ``x-request-id`` (the client's or a new one), the provenance key.
* **Provenance**: one row per request that reached an engine, aborted streams included
  (``finish_reason`` ``client_abort``, ``engine_error``, ``ambiguous``).
* **Auth**: like every state-changing route of ``serve`` (a generation binds): a bearer token
  is required; a gateway started without one refuses them (403 ``WRITES_DISABLED``).
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any, Protocol, cast

import anyio
import httpx
import msgspec
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, Route
from starlette.types import Receive, Scope, Send

from engines import guard
from engines.contract import AmbiguousReply, CleanRefusal
from engines.openai_http import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    engine_body,
    open_upstream,
    read_failure,
    refusal_of,
)
from evlog.errors import INVALID_INPUT, InvalidInput, LoraLedgerError, Refused
from projections.status import LedgerStatus, VersionStatus
from projections.transitions import VersionState
from publisher.errors import Code, LedgerError
from publisher.gateway import (
    DispatchCode,
    Gateway,
    RoutingView,
    try_elsewhere,
    version_salt,
)
from publisher.logs import get_logger
from publisher.outcomes import Bound
from publisher.provenance import ProvenanceRow
from publisher.sessions import RolloutWorker, SessionBinder

log = get_logger("loraledger.openai")

_json = msgspec.json.Encoder()
# The largest request body the routes accept (413 BODY_TOO_LARGE beyond; --max-body-mb). A
# multimodal rollout sends its images inline as base64 data URLs (a 1080p screenshot is 2-5 MB
# so), several per turn in a computer-use episode, and engines set no cap of their own; the
# gateway buffers the body to parse it, so the cap also bounds what one request holds here.
MAX_BODY_BYTES = 64 * 1024 * 1024
# The longest the gateway waits for an engine's next bytes (502 AMBIGUOUS_DISPATCH past it;
# --upstream-timeout-s). Engines send nothing of a non-streaming reply before the generation
# ends, so there it bounds the whole request, queueing included; a stream: its first event,
# then each gap. An hour: long-reasoning rollouts on a busy engine outlast 10 minutes, and a
# client that gives up earlier disconnects, which aborts the request at once (docs/openai.md).
UPSTREAM_TIMEOUT_S = 3600.0
MAX_SESSION_CHARS = 256
SESSION_HEADER = "x-session-id"
REQUEST_ID_HEADER = "x-request-id"


class OpenAICode:
    """The OpenAI face's own codes (the ledger's and the gateway's keep theirs)."""

    VERSION_NOT_BOUND = "VERSION_NOT_BOUND"  # model names a version the session is not bound to
    ENGINE_NOT_HTTP = "ENGINE_NOT_HTTP"  # a holder has no OpenAI endpoint (in-process engine)
    # model is neither the alias nor a version served here. OpenAI's and vLLM's own spelling
    # (lower case, unlike ours): clients' fallback logic keys on it and on the 404.
    MODEL_NOT_FOUND = "model_not_found"
    UNKNOWN_ROUTE = "UNKNOWN_ROUTE"  # no route at this path (404)
    METHOD_NOT_ALLOWED = "METHOD_NOT_ALLOWED"  # a route of this path, another method (405)


class OpenAIError(LoraLedgerError):
    """A refusal of the OpenAI face."""


class OpenAIRefused(
    OpenAIError,
    Refused,
    codes=[OpenAICode.VERSION_NOT_BOUND, OpenAICode.ENGINE_NOT_HTTP, OpenAICode.MODEL_NOT_FOUND],
):
    """Refused before anything was sent to an engine."""


class OpenAIInvalidInput(
    OpenAIError,
    InvalidInput,
    codes=[OpenAICode.UNKNOWN_ROUTE, OpenAICode.METHOD_NOT_ALLOWED],
):
    """A request to no route of the face: fix the client's path or method."""


# HTTP status of each code the routes can answer (anything else: 409, a refusal by the rules).
STATUS_OF_CODE = {
    INVALID_INPUT: 400,
    Code.INVALID_INPUT: 400,
    Code.UNKNOWN_OWNER: 503,
    Code.LEASE_EXPIRED: 503,
    Code.NO_PUBLISHED_VERSION: 503,
    Code.LEDGER_CLOSED: 503,
    Code.FENCED: 503,
    DispatchCode.NO_ROUTE: 503,
    DispatchCode.AMBIGUOUS_DISPATCH: 502,
    OpenAICode.ENGINE_NOT_HTTP: 503,
    OpenAICode.MODEL_NOT_FOUND: 404,
    OpenAICode.UNKNOWN_ROUTE: 404,
    OpenAICode.METHOD_NOT_ALLOWED: 405,
    "UNAUTHORIZED": 401,
    "WRITES_DISABLED": 403,
}


# Refusals after which the same request may simply be sent again (nothing was sent, and the
# condition may pass): the only ones the client is told to retry (``x-should-retry``).
RETRYABLE_CODES = frozenset({DispatchCode.NO_ROUTE, Code.LEDGER_CLOSED, Code.NO_PUBLISHED_VERSION})


def error_body(code: str, message: str, status: int) -> bytes:
    """OpenAI's error shape, with the machine code in ``code``."""
    kind = (
        "authentication_error"
        if status == 401
        else "invalid_request_error"
        if status < 500
        else "server_error"
    )
    return _json.encode({"error": {"message": message, "type": kind, "param": None, "code": code}})


def error_response(
    code: str, message: str, status: int | None = None, *, allow: str | None = None
) -> Response:
    """A refusal in OpenAI's shape; ``allow`` is the ``Allow`` header of a 405."""
    status = status or STATUS_OF_CODE.get(code, 409)
    headers = {"x-should-retry": "true" if code in RETRYABLE_CODES else "false"}
    if allow is not None:
        headers["Allow"] = allow
    if status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="loraledger"'
    return Response(error_body(code, message, status), status, headers, "application/json")


def guard_error_body(code: str, message: str) -> Any:
    """A refusal of :class:`engines.guard.Guard` (a body over the cap, a bad Content-Length)
    in this face's error shape: every app that mounts the routes answers them so."""
    return msgspec.json.decode(error_body(code, message, 413))


def body_guard(options: OpenAIOptions) -> Middleware:
    """The :class:`engines.guard.Guard` in front of the routes: bodies capped at
    ``options.max_body_bytes``, refused 413 ``BODY_TOO_LARGE`` in this face's error shape, with
    ``x-should-retry: false``, after the rest of the body is read (bounded: see ``Guard``) so
    that a client still uploading reads the 413 instead of a reset connection. The token is
    the routes' own check (``WRITES_DISABLED`` when none is configured)."""
    return Middleware(
        guard.Guard,
        token=None,
        protected=lambda path: False,
        cap=lambda path: options.max_body_bytes,
        error_body=guard_error_body,
        drains=lambda path: True,
    )


class GatewayView(RoutingView, Protocol):
    """What the OpenAI face reads of the ledger, besides routing: incarnations (provenance)
    and the status (the version list of ``/v1/models``). ``refresh`` brings a remote view up
    to date (a no-op in process); it is awaited before a request is refused ``NO_ROUTE``,
    ``model_not_found`` or ``VERSION_NOT_BOUND`` before a bind.

    ``knows_unbound(session)`` is True only when the view knows for certain that the ledger
    holds no binding and no tombstone of ``session`` now (so its first turn would bind it to
    the current default): an in-process ledger can tell; a remote snapshot, which lists no
    sessions, answers False, and the bind itself then decides."""

    def incarnation(self, engine: str) -> str: ...

    def status(self) -> LedgerStatus: ...

    def knows_unbound(self, session: str) -> bool: ...

    async def refresh(self) -> None: ...


class LiveView:
    """A :class:`GatewayView` over an in-process ledger (``serve``): always current."""

    def __init__(self, ledger: Any) -> None:
        self._ledger = ledger

    def holders(self, lora_name: str) -> tuple[str, ...]:
        holders: tuple[str, ...] = self._ledger.state.holders(lora_name)
        return holders

    @property
    def default_revision(self) -> int:
        revision: int = self._ledger.state.default_revision
        return revision

    @property
    def max_staleness(self) -> int | None:
        limit: int | None = self._ledger.state.max_staleness
        return limit

    def incarnation(self, engine: str) -> str:
        record = self._ledger.state.engines.get(engine)
        return "" if record is None else str(record.incarnation)

    def status(self) -> LedgerStatus:
        status: LedgerStatus = self._ledger.status()
        return status

    def knows_unbound(self, session: str) -> bool:
        state = self._ledger.state
        return session not in state.sessions and session not in state.tombstones

    async def refresh(self) -> None:
        return None


class EngineRoute(msgspec.Struct, frozen=True, kw_only=True):
    """How to reach one engine's OpenAI endpoint."""

    engine_id: str
    kind: str
    base_url: str


class OpenAIOptions(msgspec.Struct, frozen=True, kw_only=True):
    alias: str = "policy"  # the model name meaning "my session's version"
    token: str | None = None  # bearer token of the generation routes (None: they are refused)
    engine_token: str | None = None  # sent to engines as their --api-key
    upstream_timeout_s: float = UPSTREAM_TIMEOUT_S  # an engine's longest silence: see there
    connect_timeout_s: float = 5.0
    max_body_bytes: int = MAX_BODY_BYTES


class _Ask(msgspec.Struct, frozen=True, kw_only=True):
    """One client request, parsed."""

    chat: bool
    body: dict[str, Any]
    session: str
    one_turn: bool
    request_id: str  # the client's x-request-id (or a new one): echoed, the provenance key
    engine_request_id: str  # what the engine sees: unique among its running requests
    stream: bool
    wants_usage: bool


class _Refused(msgspec.Struct, frozen=True, kw_only=True):
    """A clean refusal tried elsewhere, kept in case it becomes the answer (no holder left)."""

    refusal: CleanRefusal
    engine_id: str
    head: int
    started: float


class _Usage:
    """What the engine reported, for provenance."""

    __slots__ = ("cached", "completion", "finish", "prompt", "served")

    def __init__(self) -> None:
        self.prompt = self.completion = self.cached = 0
        self.finish = ""
        self.served: str | None = None

    def read(self, reply: Any) -> None:
        if not isinstance(reply, dict):
            return
        if isinstance(reply.get("model"), str) and self.served is None:
            self.served = reply["model"]
        usage = reply.get("usage")
        if isinstance(usage, dict):
            self.prompt = int(usage.get("prompt_tokens") or 0)
            self.completion = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict):
                self.cached = int(details.get("cached_tokens") or 0)
        for choice in reply.get("choices") or ():
            if isinstance(choice, dict) and choice.get("finish_reason"):
                self.finish = str(choice["finish_reason"])


class OpenAIGateway:
    """The OpenAI face over one rollout worker (the owner of every session it binds), its
    gateway and a view of the ledger. ``engines`` maps engine id to its OpenAI endpoint; an
    engine of the fleet without one is never routed to by this face."""

    def __init__(
        self,
        worker: RolloutWorker,
        view: GatewayView,
        engines: Mapping[str, EngineRoute],
        options: OpenAIOptions | None = None,
        *,
        client: httpx.AsyncClient | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.worker = worker
        self.gateway: Gateway = worker.gateway
        self.view = view
        self.engines = dict(engines)
        self.options = options or OpenAIOptions()
        self._client = client or httpx.AsyncClient(trust_env=False)
        self._clock = clock
        self._headers = (
            {"authorization": f"Bearer {self.options.engine_token}"}
            if self.options.engine_token
            else {}
        )
        self._timeout = httpx.Timeout(
            self.options.upstream_timeout_s, connect=self.options.connect_timeout_s
        )
        self._token = self.options.token.encode() if self.options.token else None
        self.requests = 0  # requests answered (any outcome)

    async def aclose(self) -> None:
        await self._client.aclose()

    # --- routes ----------------------------------------------------------------------------

    def routes(self, *, whole_app: bool = False) -> list[BaseRoute]:
        """The routes, then a fallback that answers every other request under ``/v1/`` (with
        ``whole_app``: every other request at all, for an app of only these routes) in
        OpenAI's error shape. Mount them last: the fallback takes any path before it has
        matched, so the app's routes outside ``/v1/`` keep their own answers."""
        return [
            *self._route_table,
            Route("/{path:path}" if whole_app else "/v1/{path:path}", _AnyMethod(self.no_route)),
        ]

    @functools.cached_property
    def _route_table(self) -> list[Route]:
        return [
            Route(CHAT_PATH, self._endpoint(chat=True), methods=["POST"]),
            Route(COMPLETIONS_PATH, self._endpoint(chat=False), methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/v1/sessions/{session:path}/release", self.release, methods=["POST"]),
        ]

    async def no_route(self, request: Request) -> Response:
        """A request no route takes: 405 with ``Allow`` when a route has this path (Starlette
        would answer in plain text, which an OpenAI SDK reads as an error without code or
        message), else 404. A trailing slash is a 404 naming the route without it, never a
        redirect: Starlette's redirect is built from the Host header (wrong behind a proxy
        that terminates TLS) and would send a generation's body a second time; the official
        clients never add the slash, so one spelling per route keeps logs and proxies simple."""
        method, path = request.method, request.url.path
        allowed = self._methods_at(request.scope, wrong_method=True)
        if allowed:
            return error_response(
                OpenAICode.METHOD_NOT_ALLOWED,
                f"{method} is not allowed on {path}: use {' or '.join(allowed)}",
                allow=", ".join(allowed),
            )
        hint = "the routes are " + ", ".join(
            f"{' '.join(sorted(route.methods - {'HEAD'}))} {route.path}"
            for route in self._route_table
            if route.methods
        )
        bare = path.rstrip("/")
        if bare != path and (methods := self._methods_at({**request.scope, "path": bare})):
            hint = f"did you mean {' or '.join(methods)} {bare} (no trailing slash)?"
        return error_response(
            OpenAICode.UNKNOWN_ROUTE, f"no route {method} {path} on this gateway: {hint}"
        )

    def _methods_at(self, scope: Scope, *, wrong_method: bool = False) -> list[str]:
        """The methods of the face's routes at ``scope``'s path (HEAD left out: implied);
        ``wrong_method``: only of routes that match the path but not the method."""
        methods: set[str] = set()
        for route in self._route_table:
            match, _ = route.matches(scope)
            wanted = match is Match.PARTIAL if wrong_method else match is not Match.NONE
            if wanted and route.methods:
                methods |= route.methods
        return sorted(methods - {"HEAD"})

    def authorized(self, request: Request) -> Response | None:
        if self._token is None:
            return error_response(
                "WRITES_DISABLED",
                "this service was started without a token: generation routes bind sessions and "
                "are off (restart it with LORALEDGER_TOKEN or --token-file)",
            )
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), self._token):
            return error_response("UNAUTHORIZED", "a valid bearer token is required")
        return None

    async def models(self, request: Request) -> Response:
        """The alias (what clients should send) plus each version engines serve, with its
        state; ``routable`` says whether some engine may serve it now."""
        if (refused := self.authorized(request)) is not None:
            return refused
        return Response(
            _json.encode({"object": "list", "data": self._cards(self.view.status())}),
            200,
            None,
            "application/json",
        )

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{model}`` (the SDK's ``models.retrieve``, as vLLM and SGLang serve
        it): the alias's or a version's entry of the list, else ``404 model_not_found``."""
        if (refused := self.authorized(request)) is not None:
            return refused
        model = request.path_params["model"]
        if not model:  # "/v1/models/": the list's path with a trailing slash
            return await self.no_route(request)
        card = next((c for c in self._cards(self.view.status()) if c["id"] == model), None)
        if card is None:
            return error_response(*self._not_found(model))
        return Response(_json.encode(card), 200, None, "application/json")

    def _served(self, status: LedgerStatus) -> list[VersionStatus]:
        """The versions ``/v1/models`` lists, hence the only names ``model`` may take besides
        the alias: those engines hold (routably) or may serve (published, retired)."""
        return [
            v
            for v in status.versions
            if v.state in ("PUBLISHED", "RETIRED") or self.view.holders(v.lora_name)
        ]

    def _not_found(self, model: str) -> tuple[str, str]:
        return (
            OpenAICode.MODEL_NOT_FOUND,
            f"the model {model!r} does not exist here: send {self.options.alias!r} (your "
            "session's version) or a version name listed by GET /v1/models",
        )

    def _cards(self, status: LedgerStatus) -> list[dict[str, Any]]:
        created = int(self._clock())
        default = next((v for v in status.versions if v.version_id == status.default), None)
        cards: list[dict[str, Any]] = [
            {
                "id": self.options.alias,
                "object": "model",
                "created": created,
                "owned_by": "loraledger",
                "root": default.lora_name if default else None,
                "parent": None,
                "default_version": status.default,
            }
        ]
        for v in self._served(status):
            holders = self.view.holders(v.lora_name)
            cards.append(
                {
                    "id": v.lora_name,
                    "object": "model",
                    "created": created,
                    "owned_by": "loraledger",
                    "root": v.lora_name,
                    "parent": self.options.alias,
                    "version_id": v.version_id,
                    "digest": v.digest,
                    "state": v.state,
                    "routable": bool(holders),
                }
            )
        return cards

    async def release(self, request: Request) -> Response:
        """End a session: released once in the ledger (it can never bind again)."""
        if (refused := self.authorized(request)) is not None:
            return refused
        session = request.path_params["session"]
        try:
            released = await self.worker.session(session).close()
        except LoraLedgerError as exc:
            return error_response(exc.code, exc.message)
        return Response(_json.encode(released), 200, None, "application/json")

    def _endpoint(self, *, chat: bool) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            refused = self.authorized(request)
            if refused is None:
                try:
                    ask = self._parse(request, await request.body(), chat=chat)
                except _BadRequest as exc:
                    refused = error_response(INVALID_INPUT, str(exc), 400)
                else:
                    return _Asgi(lambda scope, receive, send: self.serve(ask, receive, send))
            # refused before a request id was settled: the client's when it is a usable one
            given = request.headers.get(REQUEST_ID_HEADER, "")
            refused.headers[REQUEST_ID_HEADER] = (
                given if _usable_request_id(given) else uuid.uuid4().hex
            )
            return refused

        return endpoint

    def _parse(self, request: Request, raw: bytes, *, chat: bool) -> _Ask:
        if len(raw) > self.options.max_body_bytes:
            raise _BadRequest(f"the body is over {self.options.max_body_bytes} bytes")
        try:
            body = guard.strict_json(raw)
        except guard.BadBody as exc:
            raise _BadRequest(str(exc)) from None
        if not isinstance(body, dict):
            raise _BadRequest("the body must be a JSON object")
        if not isinstance(body.get("model"), str):
            raise _BadRequest(
                f"model is required: {self.options.alias!r} means your session's version"
            )
        in_body = body.pop("session_id", None)
        session = request.headers.get(SESSION_HEADER) or in_body
        if session is not None and (
            not isinstance(session, str)
            or not 0 < len(session) <= MAX_SESSION_CHARS
            or not session.isprintable()
        ):
            raise _BadRequest(f"a session id is 1-{MAX_SESSION_CHARS} printable characters")
        given = request.headers.get(REQUEST_ID_HEADER)
        rid = given or uuid.uuid4().hex
        if not _usable_request_id(rid):
            raise _BadRequest("x-request-id must be 1-128 printable ASCII characters")
        # A client's id is a label (a trace id in default headers, a proxy's stamp, an SDK
        # retry while the first try is being aborted): engines key running requests by their
        # id (vLLM refuses a duplicate; SGLang aborts by prefix), so theirs is made unique.
        engine_rid = f"{given}-{uuid.uuid4().hex[:12]}" if given else rid
        options = body.get("stream_options")
        wants_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        return _Ask(
            chat=chat,
            body=body,
            # Named here, never after the client's x-request-id: an SDK resends the same
            # headers after a retryable refusal, and a released session never binds again.
            session=session or f"{self.gateway.gateway_id}-once-{uuid.uuid4().hex}",
            one_turn=session is None,
            request_id=rid,
            engine_request_id=engine_rid,
            stream=bool(body.get("stream")),
            wants_usage=wants_usage,
        )

    # --- one request --------------------------------------------------------------------------

    async def serve(self, ask: _Ask, receive: Receive, send: Send) -> None:
        """Answer one parsed request on the ASGI ``send``; a client disconnect (``receive``)
        cancels the work, which closes the upstream connection (the engine aborts)."""
        self.requests += 1
        send = _Tracked(send, ask.request_id)
        binder: SessionBinder | None = None
        try:
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                refusal = await self._refusal_before_bind(ask)
                if refusal is not None:
                    # Nothing bound, nothing to release: no binder even exists (a one-turn
                    # session's release would write a tombstone for a session never bound).
                    await _send_error(send, *refusal)
                else:
                    binder = self.worker.session(ask.session)
                    await self._turn(ask, binder, send)
                tg.cancel_scope.cancel()
        finally:
            if ask.one_turn and binder is not None:
                with anyio.CancelScope(shield=True):
                    await self._release_quietly(binder)

    async def _release_quietly(self, binder: SessionBinder) -> None:
        try:
            await binder.close()
        except LoraLedgerError as exc:
            log.warning("openai.release_failed", session=binder.session_id, code=exc.code)

    async def _refusal_before_bind(self, ask: _Ask) -> tuple[str, str] | None:
        """What ``model`` alone refuses, decided before anything is bound (a refused request
        leaves no trace in the ledger), from the view's version list (``/v1/models``):

        * a name that is neither the alias nor a listed version: ``404 model_not_found``
          (OpenAI's and vLLM's answer; the SDK raises ``NotFoundError``);
        * a listed version that is not the default, on a session provably not bound yet:
          ``409 VERSION_NOT_BOUND`` (its first turn would bind it to the default). Provably:
          a one-turn request (its session id is new, made by this gateway), or a view that
          knows the ledger holds no binding and no tombstone of it (in process:
          ``LiveView.knows_unbound``). Otherwise the session may already be bound to that very
          version (by another gateway process, or an earlier life of this one): the bind
          decides, answering the existing binding, and the check after it
          (:meth:`_check_model`) refuses any other version. That check also covers the race
          where the default moves between this check and the bind: the refusal after the bind
          is then the truth (the session is bound to the new default, as any first turn at
          that instant would be).

        A remote view is a snapshot: before refusing, it is refreshed and asked again (a
        version published since is not refused); if the ledger cannot be read, the bind
        decides, as it would without this check."""
        model = ask.body["model"]
        if model == self.options.alias or self._judge_model(ask, model) is None:
            return None
        try:
            await self.view.refresh()
        except Exception as exc:  # the ledger unreachable: the bind says what it can
            log.warning("openai.refresh_failed", rid=ask.request_id, error=repr(exc))
            return None
        return self._judge_model(ask, model)

    def _judge_model(self, ask: _Ask, model: str) -> tuple[str, str] | None:
        try:
            status = self.view.status()
        except LoraLedgerError:  # no status read yet: the bind decides
            return None
        served = {v.lora_name: v for v in self._served(status)}
        named = served.get(model)
        if named is None:
            return self._not_found(model)
        if named.version_id == status.default:
            return None
        if not ask.one_turn and not self.view.knows_unbound(ask.session):
            return None
        default = next((v for v in status.versions if v.version_id == status.default), None)
        binds_to = (
            f"the current default, {default.lora_name} (version {default.version_id})"
            if default is not None
            else "the default once one is published"
        )
        who = (
            "a request without a session id is a new one-turn session"
            if ask.one_turn
            else f"session {ask.session} is not bound yet"
        )
        return (
            OpenAICode.VERSION_NOT_BOUND,
            f"{who}, and a first turn binds to {binds_to}; model {model!r} (version "
            f"{named.version_id}) is served only to sessions already bound to it: send "
            f"{self.options.alias!r}, or that version's name on a session bound to it",
        )

    async def _turn(self, ask: _Ask, binder: SessionBinder, send: Send) -> None:
        try:
            async with binder.turn() as bound:
                # no await from the lease check in turn() to the admission below
                refusal = self._check_model(ask, bound)
                if refusal is not None:
                    await _send_error(send, *refusal)
                    return
                await self._dispatch(ask, bound, binder, send)
        except LoraLedgerError as exc:
            await _send_error(send, exc.code, exc.message)
            if exc.code == Code.SESSION_CLOSED and not ask.one_turn:
                # released in the ledger: this process forgets its cached binding too
                with anyio.CancelScope(shield=True):
                    await self._release_quietly(binder)

    def _binding_gone(self, bound: Bound) -> LedgerError | None:
        """``SESSION_CLOSED`` when the ledger no longer holds this cached binding, as the
        (just refreshed) view shows it: the version is being reclaimed or is reclaimed, or no
        session is bound to it at all. A binding is cached by every process that served the
        session, so it can be released behind this one's back (a release or an idle release
        through another gateway process); once its version is gone the turn cannot be served
        anywhere, and a retryable ``NO_ROUTE`` would only be retried in vain."""
        try:
            status = self.view.status()
        except LoraLedgerError:
            return None
        version = next((v for v in status.versions if v.version_id == bound.version_id), None)
        if version is None or version.state in (VersionState.RECLAIMING, VersionState.RECLAIMED):
            why = f"{bound.lora_name} is {version.state if version else 'gone'}"
        elif version.bound == 0:
            why = f"no session is bound to {bound.lora_name} any more"
        else:
            return None
        return LedgerError(
            Code.SESSION_CLOSED,
            f"session {bound.session} was released elsewhere ({why}): another gateway process "
            "or its idle release ended it; start a new session",
            session=bound.session,
        )

    def _check_model(self, ask: _Ask, bound: Bound) -> tuple[str, str] | None:
        """After the bind, the rule itself: the alias or the session's own version name.
        What :meth:`_refusal_before_bind` could not settle (a session perhaps bound elsewhere,
        the default moved meanwhile) is settled here, by the binding the ledger answered."""
        model = ask.body["model"]
        if model in (self.options.alias, bound.lora_name):
            return None
        return (
            OpenAICode.VERSION_NOT_BOUND,
            f"session {ask.session} is bound to {bound.lora_name} (version {bound.version_id}); "
            f"model {model!r} is not its version: send {self.options.alias!r} or that name",
        )

    async def _dispatch(self, ask: _Ask, bound: Bound, binder: SessionBinder, send: Send) -> None:
        gateway, tally = self.gateway, self.worker.inflight
        turn = binder.next_turn()
        tried: list[str] = []
        unreachable: list[str] = []
        refreshed = False
        # An error reply is sent only once the request's provenance row is written and its
        # in-flight count is down: a client that saw the 502 can rely on both.
        failure: tuple[str, str] | tuple[str, str, int] | None = None
        refused: _Refused | None = None  # the last refusal tried elsewhere
        while True:
            engine_id = gateway.admit(bound, tried, tally)
            if engine_id is None:
                if not refreshed:  # a remote view may not show the version's holders yet
                    refreshed = True
                    try:
                        await self.view.refresh()
                    except Exception as exc:  # the ledger unreachable: answer from what we have
                        log.warning("openai.refresh_failed", rid=ask.request_id, error=repr(exc))
                    self.worker.ensure_live()  # the lease check again, right before admit
                    continue
                if refused is not None:  # every holder refused: the last one is the answer
                    await self._answer_refused(ask, bound, turn, refused, send)
                    return
                if (gone := self._binding_gone(bound)) is not None:
                    raise gone  # nothing admitted; _turn answers it and drops the binder
                await _send_error(
                    send,
                    DispatchCode.NO_ROUTE,
                    f"no routable engine holds {bound.lora_name}"
                    + (f" (unreachable: {', '.join(unreachable)})" if unreachable else ""),
                )
                return
            tried.append(engine_id)
            # The new count goes with a renewal now: a remote ledger (gateway process) learns
            # of this request before it is sent, not at the next renewal tick.
            self.worker.report()
            try:
                route = self.engines.get(engine_id)
                if route is None:
                    unreachable.append(engine_id)
                    continue
                head = self.view.default_revision
                started = self._clock()
                usage = _Usage()
                outcome = "ambiguous"
                try:
                    result = await self._forward(ask, bound, route, usage, send)
                    if isinstance(result, str):
                        outcome = result
                    else:
                        # Reported whether or not another holder then serves the request: a
                        # missing adapter may be a committed version the engine lost (a
                        # refusal about the request itself is not reported: see the gateway).
                        gateway.report_trouble(engine_id, result)
                        if try_elsewhere(result):
                            # The engine does not hold the name and ran nothing; nothing went
                            # to the client: the next holder may serve it. Like the Python
                            # path, no row for this attempt unless its refusal is the answer.
                            outcome = ""
                            refused = _Refused(
                                refusal=result, engine_id=engine_id, head=head, started=started
                            )
                            log.warning(
                                "openai.tried_elsewhere",
                                engine=engine_id,
                                rid=ask.request_id,
                                code=result.code,
                            )
                            continue
                        outcome = "engine_error"
                        failure = _refusal_reply(result)
                except AmbiguousReply as exc:
                    # Unreachable (nothing sent) or sent with its outcome unknown: either way
                    # the engine may be down or restarted, and a probe now tells.
                    gateway.report_trouble(engine_id, exc)
                    if not exc.dispatched:
                        unreachable.append(engine_id)
                        log.warning("openai.not_dispatched", engine=engine_id, rid=ask.request_id)
                        outcome = ""
                        continue
                    outcome = "ambiguous"
                    failure = (
                        DispatchCode.AMBIGUOUS_DISPATCH,
                        f"request {ask.request_id} was sent to {engine_id} and its outcome is "
                        f"unknown ({exc.code}: {exc.message}); it was not resent",
                    )
                    log.error(
                        "openai.ambiguous", engine=engine_id, rid=ask.request_id, code=exc.code
                    )
                except anyio.get_cancelled_exc_class():
                    outcome = "client_abort"
                    raise
                except Exception as exc:
                    # Unknown failure after the call started: it may have been sent.
                    outcome = "ambiguous"
                    log.error(
                        "openai.failed", engine=engine_id, rid=ask.request_id, error=repr(exc)
                    )
                    failure = (
                        DispatchCode.AMBIGUOUS_DISPATCH,
                        f"request {ask.request_id} to {engine_id} failed ({exc!r}); not resent",
                    )
                finally:
                    if outcome:
                        with anyio.CancelScope(shield=True):
                            await self._record(
                                ask, bound, engine_id, turn, head, started, usage, outcome
                            )
                break
            finally:
                gateway.finish(engine_id, bound.version_id, tally)
        if failure is not None:
            await _send_error(send, *failure)

    async def _answer_refused(
        self, ask: _Ask, bound: Bound, turn: int, refused: _Refused, send: Send
    ) -> None:
        """No holder is left after a refusal tried elsewhere: that refusal is the answer (the
        Python path raises the last one), with its ``engine_error`` row written first."""
        with anyio.CancelScope(shield=True):
            await self._record(
                ask,
                bound,
                refused.engine_id,
                turn,
                refused.head,
                refused.started,
                _Usage(),
                "engine_error",
            )
        await _send_error(send, *_refusal_reply(refused.refusal))

    async def _forward(
        self, ask: _Ask, bound: Bound, route: EngineRoute, usage: _Usage, send: Send
    ) -> str | CleanRefusal:
        """Send once and relay the reply. Returns the provenance outcome (the engine's finish
        reason) of a reply relayed, or the engine's clean refusal (a 4xx), of which nothing has
        been sent to the client: the caller decides between another holder and relaying it."""
        body = engine_body(
            ask.body,
            kind=route.kind,
            lora_name=bound.lora_name,
            request_id=ask.engine_request_id,
            cache_salt=version_salt(bound),
            include_usage=True,
        )
        url = route.base_url + (CHAT_PATH if ask.chat else COMPLETIONS_PATH)
        async with open_upstream(
            self._client,
            url,
            _json.encode(body),
            engine_id=route.engine_id,
            request_id=ask.engine_request_id,
            headers=self._headers,
            timeout=self._timeout,
        ) as response:
            if response.status_code != 200:
                return await self._read_refusal(response, route, bound.lora_name)
            headers = self._headers_for(ask, bound, route, response)
            if not ask.stream:
                try:
                    payload = await response.aread()
                except httpx.HTTPError as exc:
                    raise read_failure(exc, url, route.engine_id) from exc
                with contextlib.suppress(msgspec.DecodeError):
                    usage.read(msgspec.json.decode(payload))
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                await send({"type": "http.response.body", "body": payload})
                return usage.finish or "stop"
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            try:
                failed = await self._relay_stream(ask, response, usage, send, route.engine_id)
            except httpx.HTTPError as exc:
                # Mid-stream: the status is sent; the error goes in the stream (_send_error).
                raise read_failure(exc, url, route.engine_id) from exc
            return failed or usage.finish or "stop"

    async def _relay_stream(
        self, ask: _Ask, response: httpx.Response, usage: _Usage, send: Send, engine_id: str
    ) -> str | None:
        """Pass SSE events on as they arrive. Events are framed (an event cut across two
        reads waits for its end, nothing longer) so the usage chunk can be read and dropped
        when the client did not ask for it. The engine's byte iterator is closed here, when
        the relay ends (a client gone mid-stream included), not whenever the garbage collector
        finds it (a CI run logged such a late close failing: "async generator already
        executing").

        Returns the provenance outcome of a stream that did not finish, None for one that
        did. Every OpenAI stream ends with ``data: [DONE]``; an engine that fails mid-stream
        (vLLM, SGLang) sends an error event first: relayed as it is, and the row says
        ``engine_error``. A stream that ends without ``[DONE]`` was cut (the local engine ends
        a failed generation so): the client gets an ``AMBIGUOUS_DISPATCH`` error event, so its
        SDK raises instead of taking a partial sample for a whole one, and the row says
        ``ambiguous``, as for a connection broken mid-stream."""
        pending = b""
        done = False
        error: Any = None
        raw = cast(AsyncGenerator[bytes, None], response.aiter_raw())  # annotated an iterator
        async with contextlib.aclosing(raw) as chunks:
            async for data in chunks:
                pending += data
                if b"\n\n" not in pending:
                    continue
                *events, pending = pending.split(b"\n\n")
                out = []
                for event in events:
                    if event.strip() == _DONE:
                        done = True
                    elif b'"error"' in event and error is None:
                        error = _stream_error(event)
                    if b'"usage"' in event or b'"finish_reason":"' in event:
                        usage.read(_event_json(event))
                        if not ask.wants_usage and b'"choices":[]' in event:
                            continue  # the usage chunk the client did not ask for
                    elif usage.served is None and event.startswith(b"data: {"):
                        usage.read(_event_json(event))
                    out.append(event + b"\n\n")
                if out:
                    await send(
                        {"type": "http.response.body", "body": b"".join(out), "more_body": True}
                    )
        done = done or pending.strip() == _DONE
        if error is not None:
            log.error("openai.stream_error", engine=engine_id, rid=ask.request_id, error=error)
            await send({"type": "http.response.body", "body": pending, "more_body": False})
            return "engine_error"
        if done:
            await send({"type": "http.response.body", "body": pending, "more_body": False})
            return None
        log.error("openai.stream_cut", engine=engine_id, rid=ask.request_id)
        message = (
            f"the stream of request {ask.request_id} from {engine_id} ended without [DONE]: "
            "the generation was cut off and its outcome is unknown; it was not resent"
        )
        status = STATUS_OF_CODE.get(DispatchCode.AMBIGUOUS_DISPATCH, 502)
        event = b"data: " + error_body(DispatchCode.AMBIGUOUS_DISPATCH, message, status)
        await send({"type": "http.response.body", "body": pending + event + b"\n\n"})
        return "ambiguous"

    async def _read_refusal(
        self, response: httpx.Response, route: EngineRoute, lora_name: str
    ) -> CleanRefusal:
        """A 4xx: the engine refused before generating, read by its adapter's rule
        (:func:`engines.openai_http.refusal_of`: vLLM's 404 "model does not exist" is
        ``NOT_LOADED``), so both faces report the same refusals as engine trouble."""
        try:
            reply = msgspec.json.decode(await response.aread())
        except (httpx.HTTPError, msgspec.DecodeError):
            reply = None
        return refusal_of(
            response.status_code,
            reply,
            kind=route.kind,
            lora_name=lora_name,
            engine_id=route.engine_id,
        )

    def _headers_for(
        self, ask: _Ask, bound: Bound, route: EngineRoute, response: httpx.Response
    ) -> list[tuple[bytes, bytes]]:
        staleness = self.view.default_revision - bound.revision
        media = response.headers.get("content-type", "application/json")
        headers = [
            (b"content-type", media.encode()),
            (b"x-loraledger-version", str(bound.version_id).encode()),
            (b"x-loraledger-digest", bound.digest.encode()),
            (b"x-loraledger-engine", route.engine_id.encode()),
            (b"x-loraledger-staleness", str(staleness).encode()),
            (b"x-request-id", ask.request_id.encode()),
        ]
        if not ask.one_turn:
            headers.append((b"x-session-id", ask.session.encode()))
        if ask.stream:
            headers.append((b"cache-control", b"no-cache"))
        return headers

    async def _record(
        self,
        ask: _Ask,
        bound: Bound,
        engine_id: str,
        turn: int,
        head: int,
        started: float,
        usage: _Usage,
        outcome: str,
    ) -> None:
        recorder = self.gateway.recorder
        if recorder is None:
            return
        row = ProvenanceRow(
            session=ask.session,
            turn=None if ask.one_turn else turn,
            engine=engine_id,
            incarnation=self.view.incarnation(engine_id),
            version_id=bound.version_id,
            lora_name=bound.lora_name,
            digest=bound.digest,
            bound_revision=bound.revision,
            head_revision=head,
            head_revision_done=self.view.default_revision,
            request_id=ask.request_id,
            engine_request_id=(
                None if ask.engine_request_id == ask.request_id else ask.engine_request_id
            ),
            prompt_tokens=usage.prompt,
            completion_tokens=usage.completion,
            cached_tokens=usage.cached,
            finish_reason=outcome,
            started_at=started,
            finished_at=self._clock(),
            gateway=self.gateway.gateway_id,
            served_name=usage.served,
        )
        if not row.attested:
            log.error(
                "openai.served_other_adapter",
                engine=engine_id,
                rid=ask.request_id,
                bound=bound.lora_name,
                served=usage.served,
            )
        await recorder.record(row)


class _BadRequest(Exception):
    pass


class _Asgi(Response):
    """A Starlette response that hands the ASGI call to a callable (the request's own work)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._app(scope, receive, send)


class _AnyMethod:
    """An ASGI endpoint of every method: Starlette makes a plain function endpoint GET-only,
    and a fallback must take every method (a POST to an unknown path included)."""

    def __init__(self, handler: Callable[[Request], Awaitable[Response]]) -> None:
        self._handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = await self._handler(Request(scope, receive))
        await response(scope, receive, send)


class _Tracked:
    """The ASGI ``send`` of one request, remembering whether the response has started (an
    error after that can only be told inside the stream)."""

    def __init__(self, send: Send, request_id: str) -> None:
        self._send = send
        self.request_id = request_id  # on every reply, errors included
        self.started = False
        self.ended = False

    async def __call__(self, message: Any) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        elif not message.get("more_body", False):
            self.ended = True
        await self._send(message)


def _refusal_reply(refusal: CleanRefusal) -> tuple[str, str, int]:
    """An engine's clean refusal as the client gets it: the engine's status, its code
    (``GENERATION_FAILED`` when it gave none) and its message."""
    return (
        refusal.code or DispatchCode.GENERATION_FAILED,
        f"engine {refusal.engine_id} refused the request: {refusal.message}",
        refusal.status,
    )


async def _send_error(send: Send, code: str, message: str, status: int | None = None) -> None:
    status = status or STATUS_OF_CODE.get(code, 409)
    if isinstance(send, _Tracked) and send.started:
        if not send.ended:  # mid-stream: one SSE error event, then the stream ends
            event = b"data: " + error_body(code, message, status) + b"\n\n"
            await send({"type": "http.response.body", "body": event})
        return
    # The official client retries 408/409/429/5xx unless told otherwise: a resend of an
    # ambiguous request is a second sample, and a refusal by the rules would only repeat.
    retry = b"true" if code in RETRYABLE_CODES else b"false"
    headers = [(b"content-type", b"application/json"), (b"x-should-retry", retry)]
    if isinstance(send, _Tracked):  # the id that a provenance row of it, if any, is under
        headers.append((b"x-request-id", send.request_id.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": error_body(code, message, status)})


_DONE = b"data: [DONE]"


def _usable_request_id(text: str) -> bool:
    """1-128 printable ASCII characters. ASCII: the id goes on to the engine in a header,
    which carries nothing else (it failed there, after the bind, as an "ambiguous" dispatch
    that never left)."""
    return 0 < len(text) <= 128 and text.isprintable() and text.isascii()


def _stream_error(event: bytes) -> Any:
    """The ``error`` of an SSE error event (``data: {"error": {...}}``, as vLLM and SGLang send
    one mid-stream), or None for any other event (a completion whose text says "error")."""
    reply = _event_json(event)
    if isinstance(reply, dict) and "error" in reply and not reply.get("choices"):
        return reply["error"] or "error"
    return None


def _event_json(event: bytes) -> Any:
    for line in event.split(b"\n"):
        if line.startswith(b"data: {"):
            try:
                return msgspec.json.decode(line[6:])
            except msgspec.DecodeError:
                return None
    return None


def engine_routes(fleet: Any) -> dict[str, EngineRoute]:
    """The OpenAI endpoint of every engine of ``fleet`` that has one (an HTTP adapter: its
    ``capabilities.endpoint``); in-process engines have none and are left out."""
    return {
        e.engine_id: EngineRoute(
            engine_id=e.engine_id, kind=e.kind, base_url=e.capabilities.endpoint.rstrip("/")
        )
        for e in fleet
        if e.capabilities.endpoint
    }


def openai_routes(face: OpenAIGateway) -> list[BaseRoute]:
    """The routes to mount in any Starlette app, after its own (``serve`` adds them to its
    own): every other request under ``/v1/`` is answered in OpenAI's error shape."""
    return face.routes()


def openai_app(face: OpenAIGateway) -> Starlette:
    """A Starlette app with only the OpenAI routes, behind their :func:`body_guard` (a bare
    gateway process, a Ray gateway actor, a benchmark): every request outside them is answered
    in OpenAI's error shape."""
    return Starlette(
        routes=face.routes(whole_app=True),
        middleware=[body_guard(face.options)],
        exception_handlers=guard.exception_handlers(guard_error_body),
    )
