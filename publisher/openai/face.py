"""The OpenAI face: pinning for any stack that speaks OpenAI HTTP (docs/openai.md).

:class:`OpenAIGateway` answers one parsed request (:class:`~publisher.openai.admission.Ask`) over
one :class:`~publisher.sessions.RolloutWorker` (the owner of every session it binds: shared
binds, lease, in-flight tally) and its :class:`~publisher.gateway.Gateway`. The rules are the
Python path's, reused, not restated:

* **Session**: the first generation binds it exactly as ``SessionBinder`` does (one shared
  bind, durable before anything is sent); with no session id the request is a one-turn
  session: bound, served, released.
* **model**: :mod:`publisher.openai.admission` (checked before the bind, and after it as one of
  the executor's per-attempt rules: the pin, after the lease and the staleness bound).
* **Dispatch**: :meth:`Gateway.dispatch <publisher.gateway.dispatch.Gateway.dispatch>`, the
  executor every face uses: the lease and the staleness are checked before each attempt (a
  retry on another holder included), what provably did not run may try the next holder once,
  anything ambiguous is ``502 AMBIGUOUS_DISPATCH`` and never resent, engine trouble is reported
  through the gateway's one hook. An attempt is one :meth:`Relay.forward
  <publisher.openai.relay.Relay.forward>`.
* **Provenance**: one row per request that reached an engine, aborted streams included
  (``finish_reason`` ``client_abort``, ``engine_error``, ``ambiguous``, or ``refused`` with the
  engine's code in ``refusal_code`` when it refused the request cleanly), written before the
  error reply, as is the in-flight count's decrement: a client that saw the 502 can rely on
  both.

**Its HTTP routes**, as Starlette routes any process can mount (``loraledger serve`` next to the
ledger, ``loraledger gateway`` in a process of its own, a Ray gateway actor):
``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming or not), ``GET /v1/models``
and ``GET /v1/models/{model}``, ``POST /v1/sessions/{session}/release``; build them with
:func:`openai_routes` (or a whole app with :func:`openai_app`). Unknown routes and methods
answer in OpenAI's error shape (``404 UNKNOWN_ROUTE``, ``405 METHOD_NOT_ALLOWED``), never the
router's plain text or a redirect. Like every state-changing route of ``serve`` (a generation
binds), they need a bearer token of a role the policy admits (``OpenAIOptions.policy``:
``tools/roles.py`` for ``serve`` and ``gateway``; without one, the operator's token only): 401
without a known token, 403 ``FORBIDDEN`` for another role (a trainer's), 403
``WRITES_DISABLED`` when the process has no token at all.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

import anyio
import httpx
import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, Route
from starlette.types import Receive, Scope, Send

from engines import guard
from engines.access import OPERATOR, Access, Rule, TokenBook
from engines.contract import AmbiguousReply, CleanRefusal
from engines.openai_http import CHAT_PATH, COMPLETIONS_PATH
from evlog.errors import INVALID_INPUT, LoraLedgerError
from projections.staleness import staleness
from publisher.core.errors import Code
from publisher.core.outcomes import Bound
from publisher.gateway import Attempt, DispatchCode, DispatchError, Gateway
from publisher.gateway.provenance import Usage
from publisher.logs import get_logger
from publisher.openai.admission import (
    REQUEST_ID_HEADER,
    Admission,
    Ask,
    BadRequest,
    parse_ask,
    reply_request_id,
)
from publisher.openai.errors import (
    OpenAICode,
    OpenAIError,
    Tracked,
    body_guard,
    error_response,
    guard_error_body,
    refusal_reply,
    send_error,
)
from publisher.openai.relay import EngineRoute, Relay, UsageReader
from publisher.sessions import RolloutWorker, SessionBinder

log = get_logger("loraledger.openai")

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


class OpenAIOptions(msgspec.Struct, frozen=True, kw_only=True):
    alias: str = "policy"  # the model name meaning "my session's version"
    token: str | None = None  # the operator's bearer token (no token at all: routes refused)
    tokens: tuple[tuple[str, str], ...] = ()  # (role, token) of other callers (--tokens)
    # route ("POST /v1/completions") -> who may call it (tools/roles.py); None: the operator only
    policy: Mapping[str, Rule] | None = None
    engine_token: str | None = None  # sent to engines as their --api-key
    upstream_timeout_s: float = UPSTREAM_TIMEOUT_S  # an engine's longest silence: see there
    connect_timeout_s: float = 5.0
    max_body_bytes: int = MAX_BODY_BYTES


class OpenAIGateway:
    """The OpenAI face over one rollout worker and its gateway (whose ``view`` of the ledger it
    reads). ``engines`` maps engine id to its OpenAI endpoint; an engine of the fleet without
    one is never routed to by this face. Its HTTP routes: :func:`openai_routes`."""

    def __init__(
        self,
        worker: RolloutWorker,
        engines: Mapping[str, EngineRoute],
        options: OpenAIOptions | None = None,
        *,
        client: httpx.AsyncClient | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.worker = worker
        self.gateway: Gateway = worker.gateway
        self.view = self.gateway.view
        self.engines = dict(engines)
        self.options = options or OpenAIOptions()
        self.admission = Admission(self.view, self.options.alias)
        self.relay = Relay(
            engine_token=self.options.engine_token,
            upstream_timeout_s=self.options.upstream_timeout_s,
            connect_timeout_s=self.options.connect_timeout_s,
            client=client,
        )
        self.clock = clock
        self.requests = 0  # requests answered (any outcome)

    async def aclose(self) -> None:
        await self.relay.aclose()

    async def serve(self, ask: Ask, receive: Receive, send: Send) -> None:
        """Answer one parsed request on the ASGI ``send``; a client disconnect (``receive``)
        cancels the work, which closes the upstream connection (the engine aborts)."""
        self.requests += 1
        send = Tracked(send, ask.request_id)
        binder: SessionBinder | None = None
        try:
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                refusal = self._unservable() or await self.admission.before_bind(ask)
                if refusal is not None:
                    # Nothing bound, nothing to release: no binder even exists (a one-turn
                    # session's release would write a tombstone for a session never bound).
                    await send_error(send, *refusal)
                else:
                    binder = self.worker.session(ask.session)
                    await self._turn(ask, binder, send)
                tg.cancel_scope.cancel()
        finally:
            if ask.one_turn and binder is not None:
                with anyio.CancelScope(shield=True):
                    await self.release_quietly(binder)

    def _unservable(self) -> tuple[str, str] | None:
        """``ENGINE_NOT_HTTP`` when this face has an OpenAI route to no engine at all: no turn
        could be served, so none may bind a session (it would hold its version from reclaim
        and answer ``NO_ROUTE`` to every turn). Routes can arrive later (a gateway process
        learns engines from the ledger), hence asked per request; a cheap test."""
        if self.engines:
            return None
        return (
            OpenAICode.ENGINE_NOT_HTTP,
            "this gateway has an OpenAI route to no engine (an engine it cannot reach over "
            "HTTP, such as one inside another process, is never routed to), so no turn can be "
            "served here; nothing was bound. Give it engines it reaches by URL (--engine "
            "ID=KIND:URL, or the endpoints the ledger reports)",
        )

    async def release_quietly(self, binder: SessionBinder) -> None:
        try:
            await binder.close()
        except LoraLedgerError as exc:
            log.warning("openai.release_failed", session=binder.session_id, code=exc.code)

    async def _turn(self, ask: Ask, binder: SessionBinder, send: Send) -> None:
        try:
            # A first turn that names a version binds only if the ledger's default is that
            # version (its answer, not this face's copy, decides): a refused request never
            # leaves the session bound.
            expect = self.admission.named_version(ask)
            async with binder.turn(expect_version=expect) as bound:
                await self._generate(ask, bound, binder.next_turn(), send)
        except LoraLedgerError as exc:
            await send_error(send, exc.code, exc.message)
            if exc.code == Code.SESSION_CLOSED and not ask.one_turn:
                # released in the ledger: this process forgets its cached binding too (and
                # only that: the tombstone is its writer's to forget)
                self.worker.discard(binder)

    async def _generate(self, ask: Ask, bound: Bound, turn: int, send: Send) -> None:
        """One generation through the gateway's executor; each attempt relays one engine's
        reply and writes its row."""
        turn_label = None if ask.one_turn else turn
        refused: tuple[Attempt, CleanRefusal] | None = None  # the last refusal, for its row

        async def attempt(a: Attempt) -> None:
            nonlocal refused
            route = self.engines.get(a.engine_id)
            if route is None:  # nothing sent; not about the engine, so not reported
                raise CleanRefusal(
                    OpenAICode.ENGINE_NOT_HTTP,
                    f"engine {a.engine_id} has no OpenAI endpoint in this gateway",
                    engine_id=a.engine_id,
                    dispatched=False,
                )
            usage = UsageReader()
            outcome = "ambiguous"  # what the row says unless the attempt says otherwise
            try:
                outcome = await self.relay.forward(
                    ask, bound, route, a, staleness(bound.revision, a.head_revision), usage, send
                )
            except CleanRefusal as refusal:
                # Nothing reached the client; a row is written only if it becomes the answer.
                outcome = ""
                refused = (a, refusal)
                raise
            except AmbiguousReply as exc:
                if not exc.dispatched:
                    outcome = ""  # never sent: no row
                raise
            except anyio.get_cancelled_exc_class():
                outcome = "client_abort"
                raise
            finally:
                if outcome:
                    with anyio.CancelScope(shield=True):
                        await self.gateway.record(
                            bound,
                            a,
                            usage.usage(outcome),
                            turn=turn_label,
                            request_id=ask.request_id,
                        )

        def pinned(bound: Bound) -> None:
            """The pin of ``model``, re-checked with the executor's per-attempt rules."""
            refusal = self.admission.after_bind(ask, bound)
            if refusal is not None:
                raise OpenAIError(*refusal)

        try:
            await self.gateway.dispatch(
                bound,
                attempt,
                request_id=ask.request_id,
                engine_request_id=ask.engine_request_id,
                owner=self.worker,
                check=pinned,
            )
        except DispatchError as exc:
            if exc.code == DispatchCode.NO_ROUTE:
                gone = self.admission.binding_gone(bound)
                if gone is not None:
                    raise gone from None  # _turn answers it and drops the binder
            elif (
                exc.code == DispatchCode.GENERATION_FAILED
                and refused is not None
                and refused[0].engine_id == exc.details.get("engine")
            ):
                # The engine's refusal is the answer, with the engine's own status and code;
                # its row says refused, with that code (rows before schema 3: engine_error).
                code, message, status = refusal_reply(refused[1])
                with anyio.CancelScope(shield=True):
                    await self.gateway.record(
                        bound,
                        refused[0],
                        Usage.refused(code),
                        turn=turn_label,
                        request_id=ask.request_id,
                    )
                await send_error(send, code, message, status)
                return
            await send_error(send, exc.code, exc.message)


# --- the HTTP routes ------------------------------------------------------------------------------

_json = msgspec.json.Encoder()
_RELEASE = "POST /v1/sessions/{session}/release"
# The routes as a policy names them (tools/roles.py): what each handler checks.
ROUTE_NAMES = (
    f"POST {CHAT_PATH}",
    f"POST {COMPLETIONS_PATH}",
    "GET /v1/models",
    "GET /v1/models/{model}",
    _RELEASE,
)


def openai_routes(face: OpenAIGateway, *, whole_app: bool = False) -> list[BaseRoute]:
    """The routes, then a fallback that answers every other request under ``/v1/`` (with
    ``whole_app``: every other request at all, for an app of only these routes) in OpenAI's
    error shape. Mount them last: the fallback takes any path before it has matched, so the
    app's routes outside ``/v1/`` keep their own answers."""
    routes = _Routes(face)
    return [
        *routes.table,
        Route("/{path:path}" if whole_app else "/v1/{path:path}", _AnyMethod(routes.no_route)),
    ]


def openai_app(face: OpenAIGateway, extra_routes: Sequence[BaseRoute] = ()) -> Starlette:
    """A Starlette app with only the OpenAI routes, behind their body guard (a bare gateway
    process, a Ray gateway actor, a benchmark): every request outside them (and outside
    ``extra_routes``, a gateway process's own page) is answered in OpenAI's error shape."""
    return Starlette(
        routes=[*extra_routes, *openai_routes(face, whole_app=True)],
        middleware=[body_guard(face.options.max_body_bytes)],
        exception_handlers=guard.exception_handlers(guard_error_body),
    )


class _Routes:
    """The handlers of one face."""

    def __init__(self, face: OpenAIGateway) -> None:
        self.face = face
        options = face.options
        policy = options.policy or {route: Rule(frozenset({OPERATOR})) for route in ROUTE_NAMES}
        self.access = Access(TokenBook(options.token, options.tokens), policy)
        self.table = [
            Route(CHAT_PATH, self._generation(chat=True), methods=["POST"]),
            Route(COMPLETIONS_PATH, self._generation(chat=False), methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/v1/sessions/{session:path}/release", self.release, methods=["POST"]),
        ]

    def authorized(self, request: Request, route: str) -> Response | None:
        """The role check (:class:`engines.access.Access`), from the headers alone: 401 for a
        missing or unknown token, 403 for a role the route does not admit (the roles needed
        named in the message, OpenAI's shape having no details)."""
        denied = self.access.check(route, request.headers.get("authorization", ""))
        if denied is None:
            return None
        return error_response(denied.code, denied.message, denied.status)

    def _generation(self, *, chat: bool) -> Callable[[Request], Awaitable[Response]]:
        face = self.face

        async def endpoint(request: Request) -> Response:
            refused = self.authorized(request, f"POST {CHAT_PATH if chat else COMPLETIONS_PATH}")
            if refused is None:
                try:
                    ask = parse_ask(
                        await request.body(),
                        request.headers,
                        chat=chat,
                        alias=face.options.alias,
                        max_body_bytes=face.options.max_body_bytes,
                        one_turn_prefix=face.gateway.gateway_id,
                    )
                except BadRequest as exc:
                    refused = error_response(INVALID_INPUT, str(exc), 400)
                else:
                    return _Asgi(lambda scope, receive, send: face.serve(ask, receive, send))
            refused.headers[REQUEST_ID_HEADER] = reply_request_id(request.headers)
            return refused

        return endpoint

    async def models(self, request: Request) -> Response:
        """The alias (what clients should send) plus each version engines serve, with its
        state; ``routable`` says whether some engine may serve it now."""
        if (refused := self.authorized(request, "GET /v1/models")) is not None:
            return refused
        cards = await self.face.admission.listing(int(self.face.clock()), _label(request))
        return Response(
            _json.encode({"object": "list", "data": cards}), 200, None, "application/json"
        )

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{model}`` (the SDK's ``models.retrieve``, as vLLM and SGLang serve
        it): the alias's or a version's entry of the list, else ``404 model_not_found``."""
        if (refused := self.authorized(request, "GET /v1/models/{model}")) is not None:
            return refused
        model = request.path_params["model"]
        if not model:  # "/v1/models/": the list's path with a trailing slash
            return await self.no_route(request)
        admission = self.face.admission
        cards = await admission.listing(int(self.face.clock()), _label(request))
        card = next((c for c in cards if c["id"] == model), None)
        if card is None:
            return error_response(*admission.not_found(model))
        return Response(_json.encode(card), 200, None, "application/json")

    async def release(self, request: Request) -> Response:
        """End a session: released once in the ledger (it can never bind again)."""
        if (refused := self.authorized(request, _RELEASE)) is not None:
            return refused
        session = request.path_params["session"]
        try:
            released = await self.face.worker.session(session).close()
        except LoraLedgerError as exc:
            return error_response(exc.code, exc.message)
        return Response(_json.encode(released), 200, None, "application/json")

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
            for route in self.table
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
        for route in self.table:
            match, _ = route.matches(scope)
            wanted = match is Match.PARTIAL if wrong_method else match is not Match.NONE
            if wanted and route.methods:
                methods |= route.methods
        return sorted(methods - {"HEAD"})


def _label(request: Request) -> str:
    """The request's id in logs: the client's ``x-request-id``, when it gave a usable one."""
    return reply_request_id(request.headers)


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
