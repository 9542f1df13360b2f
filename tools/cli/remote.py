"""The commands that talk to a running ``loraledger serve``: ``status`` (its live state) and
``fleet suspend|resume|remove`` (an operator's actions on one engine, recorded in its log)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tools.cli.common import DEFAULT_URL, JsonOpt, guarded, secret
from tools.exitcodes import EXIT_HELP
from tools.output import emit, stdout_console, to_json

# The token comes from a file or $LORALEDGER_TOKEN; --token on argv still works for existing
# scripts, with a warning (``ps`` shows a command line to every user of the machine).
TokenOpt = Annotated[
    str | None,
    typer.Option(
        "--token",
        help="Deprecated (visible to every user in ps): use LORALEDGER_TOKEN or --token-file. "
        "Bearer token of the service.",
    ),
]
TokenFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--token-file",
        help="File whose first line is serve's bearer token; default: $LORALEDGER_TOKEN.",
    ),
]


def _token(given: str | None, file: Path | None) -> str | None:
    return secret(given, "--token", file, "LORALEDGER_TOKEN")


# --- status --------------------------------------------------------------------------------


@guarded
def status(
    url: Annotated[
        str,
        typer.Option("--url", envvar="LORALEDGER_URL", help="Where `loraledger serve` listens."),
    ] = DEFAULT_URL,
    token: TokenOpt = None,
    token_file: TokenFileOpt = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait.")] = 5.0,
    json: JsonOpt = False,
) -> None:
    """Ask a running ledger (`loraledger serve`) for its live status."""
    from tools.arguments import seconds, service_url
    from tools.render import status_view
    from tools.status import fetch_status

    live = fetch_status(
        service_url("--url", url),
        token=_token(token, token_file),
        timeout=seconds("--timeout", timeout),
    )
    if json:
        emit(to_json(live, row="status"))
        return
    stdout_console().print(status_view(live, title=f"ledger at {url}"))


# --- fleet (operator actions) ------------------------------------------------------------

fleet_app = typer.Typer(
    help="An operator's actions on one engine of a running `loraledger serve`, each recorded "
    "in the log with its cause (operator).",
    no_args_is_help=True,
    epilog=EXIT_HELP,
)

UrlOpt = Annotated[
    str, typer.Option("--url", envvar="LORALEDGER_URL", help="Where `loraledger serve` listens.")
]
EngineArg = Annotated[str, typer.Argument(help="The engine id, as in `loraledger status`.")]
REMOVE_TIMEOUT_S = 60.0  # serve's drain (30 s) and margin


def _engine_action(url: str, token: str | None, engine: str, action: str, detail: str,
                   json: bool, token_file: Path | None) -> None:  # fmt: skip
    from tools.arguments import service_url
    from tools.fleet_ops import engine_action

    # A removal answers once the engine drained (serve waits up to 30 s for its requests).
    timeout = REMOVE_TIMEOUT_S if action == "remove" else 10.0
    answer = engine_action(
        service_url("--url", url),
        engine,
        action,
        token=_token(token, token_file),
        detail=detail,
        timeout=timeout,
    )
    if json:
        emit({"row": action, "engine": engine, **answer})
    else:
        done = "already so: nothing recorded" if answer.get("no_op") else "recorded"
        left = answer.get("in_flight_left")
        if action == "remove" and not answer.get("no_op"):
            done += (
                ", drained: safe to stop its process"
                if not left
                else f"; {left} request(s) still running on it after the drain timeout"
            )
        print(f"{action} {engine}: {done}")


@fleet_app.command("suspend")
@guarded
def fleet_suspend(
    engine: EngineArg,
    reason: Annotated[str, typer.Option("--reason", help="Why (recorded in the log).")] = "",
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
    token_file: TokenFileOpt = None,
    json: JsonOpt = False,
) -> None:
    """Quarantine an engine: no new traffic at once, publication and reclaim stop waiting for
    it, sessions continue on the other holders of their version. Only `resume` lifts it."""
    _engine_action(url, token, engine, "suspend", reason, json, token_file)


@fleet_app.command("resume")
@guarded
def fleet_resume(
    engine: EngineArg,
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
    token_file: TokenFileOpt = None,
    json: JsonOpt = False,
) -> None:
    """Lift a suspension: the engine gets traffic again once the reconciler repaired it."""
    _engine_action(url, token, engine, "resume", "", json, token_file)


@fleet_app.command("remove")
@guarded
def fleet_remove(
    engine: EngineArg,
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
    token_file: TokenFileOpt = None,
    json: JsonOpt = False,
) -> None:
    """Remove an engine from the fleet: routed away at once (recorded), then drained (the
    requests running on it finish, at most 30 s); stop its process once this answered."""
    _engine_action(url, token, engine, "remove", "", json, token_file)
