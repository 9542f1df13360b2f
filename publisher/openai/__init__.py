"""The OpenAI-compatible face (docs/openai.md): any stack that speaks OpenAI HTTP gets pinned
sessions by changing its ``base_url``.

``admission`` (one request, parsed, and which model it may name; ``/v1/models``), ``relay``
(one attempt: forwarded to an engine, its reply relayed), ``face`` (the HTTP face: one request
answered through the gateway's executor, :class:`OpenAIGateway`, and its routes), ``errors``
(OpenAI's error shape, statuses, ``x-should-retry``).
"""

from publisher.openai.errors import OpenAICode, OpenAIError, guard_error_body
from publisher.openai.face import (
    MAX_BODY_BYTES,
    UPSTREAM_TIMEOUT_S,
    OpenAIGateway,
    OpenAIOptions,
    openai_app,
    openai_routes,
)
from publisher.openai.relay import EngineRoute, engine_routes

__all__ = [
    "MAX_BODY_BYTES",
    "UPSTREAM_TIMEOUT_S",
    "EngineRoute",
    "OpenAICode",
    "OpenAIError",
    "OpenAIGateway",
    "OpenAIOptions",
    "engine_routes",
    "guard_error_body",
    "openai_app",
    "openai_routes",
]
