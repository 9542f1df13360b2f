"""``loraledger serve`` and ``loraledger gateway``, and the option set they share, declared
once (``service_options``): the same flags, defaults and checks on both
(``tools/service_options.py``)."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import msgspec
import typer

from evlog.locations import redacted
from tools import logconfig
from tools.cli.common import DEFAULT_PORT, JsonOpt, guarded, run_server, secret, verbosity
from tools.exitcodes import Exit, ToolError
from tools.output import emit


class ServiceFlags(msgspec.Struct, frozen=True, kw_only=True):
    """The options serve and gateway share (``tools/service_options.py``) as typed on the
    command line: token files not read yet, ``--engine`` not parsed."""

    host: str
    port: int
    token_file: Path | None
    tokens_file: Path | None
    engine_token_file: Path | None
    engine: list[str] | None
    alias: str
    session_idle_s: float
    provenance: Path | None
    max_connections: int
    header_timeout_s: float
    max_body_mb: int
    upstream_timeout_s: float

    def options(self, token: str | None = None) -> dict[str, Any]:
        """The ``ServiceOptions`` fields, tokens read and engines parsed (a bad one is a usage
        error). ``token``: serve's deprecated ``--token``, warned about."""
        from tools.service_options import specs

        return {
            "host": self.host,
            "port": self.port,
            "token": (operator := secret(token, "--token", self.token_file, "LORALEDGER_TOKEN")),
            "tokens": role_tokens(operator, self.tokens_file),
            "engine_token": secret(
                None, "", self.engine_token_file, "LORALEDGER_ENGINE_TOKEN", "--engine-token-file"
            ),
            "engines": specs(self.engine or []),
            "alias": self.alias,
            "session_idle_s": self.session_idle_s,
            "provenance": str(self.provenance) if self.provenance else None,
            "max_connections": self.max_connections,
            "header_timeout_s": self.header_timeout_s,
            "max_body_mb": self.max_body_mb,
            "upstream_timeout_s": self.upstream_timeout_s,
        }


def role_tokens(operator: str | None, file: Path | None) -> tuple[tuple[str, str], ...]:
    """The ``(role, token)`` pairs of ``--tokens`` (none without it); a bad file is a usage
    error naming its line, never showing a token."""
    from engines.access import check_tokens, read_tokens

    if file is None:
        return ()
    try:
        pairs = read_tokens(file)
        check_tokens(operator, pairs)
    except (OSError, ValueError) as exc:
        raise ToolError(Exit.USAGE, f"--tokens: {exc}") from None
    return pairs


def _option(name: str, kind: Any, default: Any, flag: str, help: str) -> inspect.Parameter:
    """An option as typer reads it: ``name: Annotated[kind, typer.Option] = default``."""
    annotation = Annotated[kind, typer.Option(flag, help=help)]
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
    )


def service_options(
    *, port: int, token_file_help: str, engine_help: str, provenance_help: str
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Declare the options serve and gateway share on a command, where its signature has a
    parameter ``shared: ServiceFlags``, and hand them to it as that one ``ServiceFlags``.

    Written once, so a flag, its default or its help cannot drift between the two commands;
    each gives only what differs: its default port, and the help of the three options whose
    meaning differs (whose token ``--token-file`` holds, what ``--engine`` names, where
    provenance goes by default). Typer reads a command's options from its signature, so the
    command it registers is a wrapper whose signature is the command's own with the shared
    options in place of ``shared``."""
    shared = [
        _option(
            "host",
            str,
            "127.0.0.1",
            "--host",
            "Listen address. Beyond loopback a token is required.",
        ),
        _option("port", int, port, "--port", "TCP port (0: any free port)."),
        _option("token_file", Path | None, None, "--token-file", token_file_help),
        _option(
            "tokens_file",
            Path | None,
            None,
            "--tokens",
            "File of the other callers' tokens, one 'ROLE TOKEN' per line (# comments and "
            "blank lines skipped): roles operator, trainer (publish, read), rollout (the "
            "OpenAI routes, sessions and leases), gateway (a gateway process: rollout's rights "
            "plus trouble reports and provenance). The token of --token-file or "
            "$LORALEDGER_TOKEN is the operator's. docs/operations.md, 'Roles'.",
        ),
        _option(
            "engine_token_file",
            Path | None,
            None,
            "--engine-token-file",
            "File whose first line is the token sent to every engine (their --api-key); "
            "default: $LORALEDGER_ENGINE_TOKEN.",
        ),
        _option("engine", list[str] | None, None, "--engine", engine_help),
        _option(
            "alias",
            str,
            "policy",
            "--alias",
            "The OpenAI model name meaning 'my session's version'.",
        ),
        _option(
            "session_idle_s",
            float,
            1800.0,
            "--session-idle-s",
            "An OpenAI session is released after this many seconds without a turn through "
            "any face (cause 'idle'; serve's process decides, also while no face runs), so "
            "its version can be reclaimed; 0: never. Sessions outlive a face's restart.",
        ),
        _option("provenance", Path | None, None, "--provenance", provenance_help),
        _option(
            "max_connections",
            int,
            1000,
            "--max-connections",
            "Open connections beyond which one gets 503.",
        ),
        _option(
            "header_timeout_s",
            float,
            10.0,
            "--header-timeout",
            "Seconds a connection has to send a request's headers.",
        ),
        # The OpenAI routes' limits (docs/openai.md, "Limits").
        _option(
            "max_body_mb",
            int,
            64,
            "--max-body-mb",
            "The largest OpenAI request body, MiB (images travel inline as base64); a larger "
            "one is refused 413 BODY_TOO_LARGE.",
        ),
        _option(
            "upstream_timeout_s",
            float,
            3600.0,
            "--upstream-timeout-s",
            "Seconds the gateway waits for an engine's next bytes: a non-streaming request's "
            "whole generation (queueing included), a stream's first event and each gap; then "
            "502 AMBIGUOUS_DISPATCH.",
        ),
    ]
    names = [p.name for p in shared]

    def declare(command: Callable[..., None]) -> Callable[..., None]:
        signature = inspect.signature(command, eval_str=True)
        own = [
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in signature.parameters.values()
        ]
        at = [p.name for p in own].index("shared")
        parameters = [*own[:at], *shared, *own[at + 1 :]]

        @functools.wraps(command)
        def with_shared(**given: Any) -> None:
            command(shared=ServiceFlags(**{n: given.pop(n) for n in names}), **given)

        with_shared.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
        with_shared.__annotations__ = {p.name: p.annotation for p in parameters}
        return with_shared

    return declare


@guarded
@service_options(
    port=DEFAULT_PORT,
    token_file_help="File whose first line is the operator's bearer token (every route; "
    "other roles: --tokens); default: $LORALEDGER_TOKEN. Without any token the routes that "
    "need one are refused.",
    engine_help="A fleet member, ID=KIND:URL with KIND sglang (adapters by path), "
    "sglang-tensors (SGLang >= 0.5.17's tensor route: no shared filesystem), vllm, local, or "
    "agent (URL = AGENT_URL,sglang:URL or AGENT_URL,vllm:URL: an engine fed by its host's "
    "`loraledger agent`), e.g. e0=sglang:http://127.0.0.1:30000; e1=local: runs a local "
    "engine in process (repeatable).",
    provenance_help="Also write a JSON-lines copy of the provenance rows of this process's "
    "OpenAI routes to this file (every face's rows are kept in the store beside the log).",
)
def serve(
    db: Annotated[
        str,
        typer.Option(
            "--db",
            help="The ledger log, created if absent: a SQLite file on a disk that outlives "
            "this machine, or postgresql://user@host/db (docs/stores.md).",
        ),
    ] = "loraledger.db",
    token: Annotated[
        str | None,
        typer.Option(
            "--token",
            help="Deprecated (visible to every user in ps): use LORALEDGER_TOKEN or "
            "--token-file. Bearer token required by every state-changing route (POST).",
        ),
    ] = None,
    *,
    shared: ServiceFlags,
    deployment: Annotated[
        str, typer.Option("--deployment", help="Deployment name (fixed by the first run).")
    ] = "default",
    prefix: Annotated[str, typer.Option("--prefix", help="Adapter name prefix.")] = "policy",
    capacity: Annotated[
        int, typer.Option("--capacity", help="Versions that may hold a slot at once.")
    ] = 3,
    max_staleness: Annotated[
        int | None,
        typer.Option(
            "--max-staleness",
            help="Refuse a session's next turn (SESSION_TOO_STALE) once its version is more "
            "than this many published versions behind the default (recorded in the log; "
            "default: unbounded).",
        ),
    ] = None,
    artifact_root: Annotated[
        Path | None,
        typer.Option("--artifacts", help="Artifact store directory (default: next to --db)."),
    ] = None,
    served_model: Annotated[
        str, typer.Option("--served-model", help="Base model name of vLLM engines.")
    ] = "tiny",
    private_reads: Annotated[
        bool,
        typer.Option(
            "--private-reads",
            help="Require the token for GET /status and /metrics too (they show engine URLs).",
        ),
    ] = False,
    suspend_after: Annotated[
        float,
        typer.Option(
            "--suspend-after",
            help="Seconds of failing health probes after which an engine is suspended (0: never).",
        ),
    ] = 30.0,
    probe_timeout: Annotated[
        float, typer.Option("--probe-timeout", help="Seconds one engine health probe may take.")
    ] = 10.0,
    canary_every: Annotated[
        float,
        typer.Option(
            "--canary-every",
            help="Seconds between canary checks of what SGLang/vLLM engines serve under each "
            "managed name (0: never).",
        ),
    ] = 300.0,
    json: JsonOpt = False,
) -> None:
    """Run the ledger as a service: /health, /status, /metrics; POST routes need the token.

    Read-only and open: GET /health, /status, /metrics. A token of a role the route admits
    (docs/operations.md, "Roles"): operator everything; trainer /versions and the adapter
    upload; rollout the OpenAI routes (docs/openai.md) and the owner, session and lease routes;
    gateway rollout's plus /engines/{engine}/trouble and /provenance.
    Stops cleanly on SIGINT/SIGTERM.
    """
    from tools import serve as service

    opts = service.ServeOptions(
        **shared.options(token=token),
        db=db,
        deployment=deployment,
        prefix=prefix,
        capacity=capacity,
        max_staleness=max_staleness,
        artifact_root=str(artifact_root) if artifact_root else None,
        served_model=served_model,
        private_reads=private_reads,
        suspend_after_s=None if suspend_after == 0 else suspend_after,  # checked below
        probe_timeout_s=probe_timeout,
        canary_every_s=None if canary_every == 0 else canary_every,
    )
    service.check_options(opts)  # before any side effect, logging set-up included
    # Quiet by default, as every command (README): warnings only; -v one line per decision.
    logconfig.configure(verbosity(), stdlib=True)
    service.warn_if_open_elsewhere(opts.db)

    from evlog.locations import shown

    log_shown = shown(db)  # a PostgreSQL URL's password never reaches the terminal

    def ready(url: str) -> None:
        if json:
            emit({"row": "listening", "url": url, "db": log_shown, "pid": os.getpid()})
        else:
            print(
                f"loraledger serve: listening on {url} (log {log_shown}, pid {os.getpid()})",
                flush=True,
            )

    run_server(
        functools.partial(service.serve, opts, verbosity=max(verbosity(), 1), on_ready=ready)
    )


@guarded
@service_options(
    port=8766,
    token_file_help="File whose first line is the token presented to the ledger (give it the "
    "gateway role there), also accepted from clients (others: --tokens); default: "
    "$LORALEDGER_TOKEN.",
    engine_help="How this process reaches an engine of the ledger's fleet, ID=KIND:URL as for "
    "serve (repeatable); default: each engine's endpoint as the ledger reports it.",
    provenance_help="Also write a JSON-lines copy of this process's provenance rows to this "
    "file (its rows always go to the ledger's store, beside the log).",
)
def gateway(
    ledger: Annotated[
        str, typer.Option("--ledger", help="Base URL of the running `loraledger serve`.")
    ],
    *,
    shared: ServiceFlags,
    owner: Annotated[
        str | None,
        typer.Option(
            "--owner",
            help="This gateway's owner id in the ledger (default gateway-HOST-PID-RANDOM, one "
            "per process); a restart under the same id releases its predecessor's sessions.",
        ),
    ] = None,
    ttl: Annotated[float, typer.Option("--ttl-s", help="Lease of the owner, seconds.")] = 30.0,
    refresh: Annotated[
        float,
        typer.Option("--refresh-s", help="Seconds between reads of the ledger's routing."),
    ] = 1.0,
    json: JsonOpt = False,
) -> None:
    """Serve the OpenAI routes in front of a remote `loraledger serve` (docs/openai.md).

    Sessions bind in the ledger (durably, before anything is sent), in-flight counts travel
    with this process's lease renewals, and routing comes from the ledger's status. Several
    gateway processes agree on a session's version and engine without talking to each other.
    Stops cleanly on SIGINT/SIGTERM.
    """
    from tools import gateway as front

    opts = front.GatewayOptions(
        **shared.options(),
        ledger=ledger.rstrip("/"),
        owner=owner,
        ttl_s=ttl,
        refresh_s=refresh,
    )
    front.check_options(opts)
    logconfig.configure(verbosity(), stdlib=True)  # quiet by default, as serve

    ledger_shown = redacted(opts.ledger)  # never a password the URL holds

    def ready(url: str, owner_id: str) -> None:
        if json:
            emit({"row": "listening", "url": url, "owner": owner_id, "pid": os.getpid()})
        else:
            print(
                f"loraledger gateway: listening on {url} (ledger {ledger_shown}, owner "
                f"{owner_id}, pid {os.getpid()})",
                flush=True,
            )

    run_server(
        functools.partial(front.run_gateway, opts, verbosity=max(verbosity(), 1), on_ready=ready)
    )
