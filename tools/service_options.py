"""The options ``loraledger serve`` and ``loraledger gateway`` share, and their one check.

Both are HTTP services that serve the OpenAI routes in front of engines: each listens
somewhere (loopback unless a token guards it), holds a bearer token, reaches engines named
``ID=KIND:URL`` with an engine token, answers to one OpenAI alias, releases idle sessions,
writes provenance rows, and bounds connections, header time, request bodies and an engine's
silence. :class:`ServiceOptions` holds those fields once; ``ServeOptions`` (``tools/serve.py``)
and ``GatewayOptions`` (``tools/gateway.py``) add their own to it, and each command's check
starts with :func:`check_service_options`, so a rule of the shared options (exit 11 beyond
loopback without a token, the limits' ranges) cannot differ between the two. The command line
declares these options once too (``service_options`` in ``tools/cli/service.py``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import msgspec

from engines.guard import is_loopback
from evlog.locations import redacted
from tools.arguments import seconds
from tools.exitcodes import Exit, ToolError

ENGINE_KINDS = ("sglang", "sglang-tensors", "vllm", "local", "agent")
_ENGINE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

MIB = 1024 * 1024
MAX_BODY_MB_LIMIT = 4096  # a Content-Length over 18 digits is refused anyway; this is sanity


class EngineSpec(msgspec.Struct, frozen=True, kw_only=True):
    """``e0=sglang:http://127.0.0.1:30000``; ``local:`` alone is an in-process local engine."""

    engine_id: str
    kind: str
    url: str | None = None


class ServiceOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What a process serving the OpenAI routes in front of engines is given (serve's and a
    gateway's options both extend it; each gives its own default port)."""

    host: str = "127.0.0.1"
    port: int
    token: str | None = None  # the bearer token clients send: the operator's
    tokens: tuple[tuple[str, str], ...] = ()  # (role, token) of --tokens (tools/roles.py)
    engine_token: str | None = None  # sent to every engine as a bearer token (their --api-key)
    engines: tuple[EngineSpec, ...] = ()
    served_model: str = "tiny"  # vLLM's base model name
    artifact_root: str | None = None  # where an in-process local engine reads adapters
    alias: str = "policy"  # the OpenAI model name meaning "my session's version"
    session_idle_s: float = 1800.0  # an OpenAI session with no turn this long is released (by
    # serve's process, also for sessions a gateway process bound: docs/sessions.md)
    provenance: str | None = None  # a JSON-lines copy of this process's rows (None: none)
    max_connections: int = 1000  # beyond it a connection is answered 503 and closed
    header_timeout_s: float = 10.0  # to send a request's headers, from connect or last reply
    max_body_mb: int = 64  # the largest OpenAI request body, MiB (413 beyond)
    upstream_timeout_s: float = 3600.0  # the longest wait for an engine's next bytes (OpenAI)


# Each URL in an --engine value: one, or an agent's two (AGENT_URL,KIND:ENGINE_URL).
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^,\s]*")


def parse_engine(text: str) -> EngineSpec:
    """Parse ``ID=KIND:URL`` (``URL`` may be empty for ``local``). A URL with a user or
    password is refused: the endpoint is recorded in the log and shown by ``/status`` (the
    engine's token goes in ``--engine-token-file``); messages show the spec redacted."""
    engine_id, eq, rest = text.partition("=")
    kind, colon, url = rest.partition(":")
    shown = _URL.sub(lambda found: redacted(found.group()), text)  # an agent's holds two
    if not eq or not colon or not _ENGINE_ID.match(engine_id):
        raise ToolError(
            Exit.USAGE,
            f"--engine {shown!r}: expected ID=KIND:URL, e.g. e0=sglang:http://127.0.0.1:30000 "
            "or e1=local: (an in-process local engine)",
        )
    if kind not in ENGINE_KINDS:
        raise ToolError(
            Exit.USAGE, f"--engine {shown!r}: kind must be one of {', '.join(ENGINE_KINDS)}"
        )
    if url and not re.match(r"^https?://[^/\s]+", url):
        raise ToolError(Exit.USAGE, f"--engine {shown!r}: {redacted(url)!r} is not an http(s) URL")
    if any("@" in re.split("[/?#]", found.group())[2] for found in _URL.finditer(url)):
        raise ToolError(
            Exit.USAGE,
            f"--engine {shown!r}: a URL carries no user or password; the engine's token goes "
            "in --engine-token-file",
        )
    if not url and kind != "local":
        raise ToolError(Exit.USAGE, f"--engine {text!r}: a {kind} engine needs its URL")
    return EngineSpec(engine_id=engine_id, kind=kind, url=url or None)


def specs(values: Sequence[str]) -> tuple[EngineSpec, ...]:
    return tuple(parse_engine(v) for v in values)


def check_service_options(opts: ServiceOptions) -> None:
    """Refuse bad shared options before anything exists. Listening beyond loopback without a
    token comes first (exit 11: an unauthenticated service on a network would let anyone bind,
    release or publish); the rest are usage errors (exit 2) naming the option."""
    if not is_loopback(opts.host) and not (opts.token or opts.tokens):
        raise ToolError(
            Exit.UNSAFE,
            f"refusing to listen on {opts.host!r} without a token: anyone who can reach it "
            "could bind, release or publish. Set LORALEDGER_TOKEN (or pass --token-file or "
            "--tokens), or listen on 127.0.0.1.",
        )
    if not 0 <= opts.port <= 65535:
        raise ToolError(Exit.USAGE, f"--port {opts.port} is not a TCP port")
    if opts.max_connections < 1:
        raise ToolError(Exit.USAGE, "--max-connections must be positive")
    seconds("--session-idle-s", opts.session_idle_s, zero="never")
    seconds("--header-timeout", opts.header_timeout_s)
    if not 1 <= opts.max_body_mb <= MAX_BODY_MB_LIMIT:
        raise ToolError(Exit.USAGE, f"--max-body-mb must be 1-{MAX_BODY_MB_LIMIT} (MiB)")
    seconds("--upstream-timeout-s", opts.upstream_timeout_s)


def openai_options(opts: ServiceOptions) -> dict[str, Any]:
    """The ``OpenAIOptions`` keywords for the limits (the body cap in bytes)."""
    return {"max_body_bytes": opts.max_body_mb * MIB, "upstream_timeout_s": opts.upstream_timeout_s}
