"""The OpenAI-compatible face (docs/openai.md): any stack that speaks OpenAI HTTP gets pinned
sessions by changing its ``base_url``.

``request`` (one request, parsed), ``admission`` (which model it may name; ``/v1/models``),
``relay`` (one attempt: forwarded to an engine, its reply relayed), ``face`` (one request
answered through the gateway's executor: :class:`OpenAIGateway`), ``routes`` (the HTTP routes),
``errors`` (OpenAI's error shape, statuses, ``x-should-retry``).
"""

from publisher.openai.errors import OpenAICode, OpenAIError, guard_error_body
from publisher.openai.face import (
    MAX_BODY_BYTES,
    UPSTREAM_TIMEOUT_S,
    OpenAIGateway,
    OpenAIOptions,
)
from publisher.openai.relay import EngineRoute, engine_routes
from publisher.openai.routes import openai_app, openai_routes

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
