"""The OpenAI face's HTTP routes, as Starlette routes any process can mount: ``loraledger
serve`` (next to the ledger), ``loraledger gateway`` (a separate process against a remote
``serve``), a Ray gateway actor.

``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming or not), ``GET /v1/models``
and ``GET /v1/models/{model}``, ``POST /v1/sessions/{session}/release``; build them with
:func:`openai_routes` (or a whole app with :func:`openai_app`).

* **Unknown routes and methods** answer in OpenAI's error shape (``404 UNKNOWN_ROUTE``,
  ``405 METHOD_NOT_ALLOWED``), never the router's plain text or a redirect.
* **Auth**: like every state-changing route of ``serve`` (a generation binds): a bearer token is
  required; a gateway started without one refuses them (403 ``WRITES_DISABLED``).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, Route
from starlette.types import Receive, Scope, Send

from engines import guard
from engines.openai_http import CHAT_PATH, COMPLETIONS_PATH
from evlog.errors import INVALID_INPUT, LoraLedgerError
from publisher.openai.errors import OpenAICode, body_guard, error_response, guard_error_body
from publisher.openai.face import OpenAIGateway
from publisher.openai.request import REQUEST_ID_HEADER, BadRequest, parse_ask, reply_request_id

_json = msgspec.json.Encoder()


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


def openai_app(face: OpenAIGateway) -> Starlette:
    """A Starlette app with only the OpenAI routes, behind their body guard (a bare gateway
    process, a Ray gateway actor, a benchmark): every request outside them is answered in
    OpenAI's error shape."""
    return Starlette(
        routes=openai_routes(face, whole_app=True),
        middleware=[body_guard(face.options.max_body_bytes)],
        exception_handlers=guard.exception_handlers(guard_error_body),
    )


class _Routes:
    """The handlers of one face."""

    def __init__(self, face: OpenAIGateway) -> None:
        self.face = face
        token = face.options.token
        self._token = token.encode() if token else None
        self.table = [
            Route(CHAT_PATH, self._generation(chat=True), methods=["POST"]),
            Route(COMPLETIONS_PATH, self._generation(chat=False), methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/v1/sessions/{session:path}/release", self.release, methods=["POST"]),
        ]

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

    def _generation(self, *, chat: bool) -> Callable[[Request], Awaitable[Response]]:
        face = self.face

        async def endpoint(request: Request) -> Response:
            refused = self.authorized(request)
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
        if (refused := self.authorized(request)) is not None:
            return refused
        cards = self.face.admission.cards(self.face.view.status(), int(self.face.clock()))
        return Response(
            _json.encode({"object": "list", "data": cards}), 200, None, "application/json"
        )

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{model}`` (the SDK's ``models.retrieve``, as vLLM and SGLang serve
        it): the alias's or a version's entry of the list, else ``404 model_not_found``."""
        if (refused := self.authorized(request)) is not None:
            return refused
        model = request.path_params["model"]
        if not model:  # "/v1/models/": the list's path with a trailing slash
            return await self.no_route(request)
        admission = self.face.admission
        cards = admission.cards(self.face.view.status(), int(self.face.clock()))
        card = next((c for c in cards if c["id"] == model), None)
        if card is None:
            return error_response(*admission.not_found(model))
        return Response(_json.encode(card), 200, None, "application/json")

    async def release(self, request: Request) -> Response:
        """End a session: released once in the ledger (it can never bind again)."""
        if (refused := self.authorized(request)) is not None:
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
