"""The ``loraledger`` command: one console script, one subcommand per job.

Every subcommand follows the same rules, so a newcomer learns them once:

* the answer goes to stdout, as rich tables for people, or ``--json`` for scripts (one JSON
  object per line when there are several);
* logs and progress bars go to stderr (quiet by default, ``-v`` shows each decision);
* a failure is one clear line on stderr and a distinct exit code (``loraledger --help`` lists
  them), never a traceback (``-vv`` adds the traceback of an unexpected internal error).

The commands only parse options, call the tool modules and render; the analysis lives in pure
folds (``projections/``) and the work in ``tools/<command>.py``. That is also why this module
may run past 600 lines: it is the command table, one short section per subcommand, and
splitting it would scatter the options a user reads in ``--help`` over several files.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import anyio
import typer
from rich.text import Text

from evlog.errors import LoraLedgerError
from tools import logconfig
from tools.exitcodes import EXIT_HELP, Exit, ToolError
from tools.output import emit, stderr_console, stdout_console, to_json

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_PORT = 8765
DEFAULT_URL = f"http://127.0.0.1:{DEFAULT_PORT}"

app = typer.Typer(
    name="loraledger",
    help=(
        "Control plane for versioned LoRA publication to inference fleets: pinned sessions, "
        "safe reclaim, an append-only hash-chained event log.\n\n"
        "Start with [bold]loraledger demo[/], then try replay / audit / verify on the log it "
        "writes."
    ),
    epilog=EXIT_HELP,
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
bench_app = typer.Typer(
    help="Benchmarks (BENCHMARKS.md): each figure with its reference ratio, measured in one run.",
    no_args_is_help=True,
    epilog=EXIT_HELP,
)
app.add_typer(bench_app, name="bench")
fleet_app = typer.Typer(
    help="An operator's actions on one engine of a running `loraledger serve`, each recorded "
    "in the log with its cause (operator).",
    no_args_is_help=True,
    epilog=EXIT_HELP,
)
app.add_typer(fleet_app, name="fleet")

_verbosity = 0

JsonOpt = Annotated[
    bool, typer.Option("--json", help="Machine output: JSON (one object per line) on stdout.")
]
LogArg = Annotated[
    str,
    typer.Argument(
        help="The ledger log: a SQLite file written by the ledger, or a postgresql:// URL."
    ),
]


@app.callback()
def _global(
    verbose: Annotated[
        int,
        typer.Option(
            "-v",
            "--verbose",
            count=True,
            help="Show structured logs on stderr: -v each decision, -vv everything.",
        ),
    ] = 0,
) -> None:
    global _verbosity
    _verbosity = verbose
    logconfig.configure(verbose)


def _fail(exc: ToolError) -> typer.Exit:
    """One line on stderr. The message often quotes the user (a path, a name): it is plain
    text, never rich markup (``missing[/x].db`` was a ``MarkupError`` traceback)."""
    where = f" (seq {exc.seq})" if exc.seq is not None else ""
    line = Text.assemble(("error", "bold red"), f"{where}: {exc.message}")
    stderr_console().print(line, highlight=False, soft_wrap=True)
    return typer.Exit(int(exc.exit_code))


def _only(exc: BaseException) -> BaseException:
    """The single error inside (nested) exception groups of one member (an anyio task group
    raising one error), so it is classified like the bare error it is. A group whose errors
    are all the ledger's, with one code, is that error too: a fenced ledger refuses every task
    of a service at once (the reclaimer and the lease expiry both meet ``FENCED``), and that is
    exit 13, not an internal error."""
    while isinstance(exc, BaseExceptionGroup):
        if len(exc.exceptions) == 1:
            exc = exc.exceptions[0]
            continue
        _, rest = exc.split(LoraLedgerError)
        if rest is None:  # nothing but ledger errors
            codes = {e.code for e in _leaves(exc) if isinstance(e, LoraLedgerError)}
            if len(codes) == 1:
                return _leaves(exc)[0]
        break
    return exc


def _leaves(group: BaseExceptionGroup[Any]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


def _quiet_stdout() -> None:
    """The reader of stdout went away (``loraledger replay LOG | head``): stop writing there,
    including the interpreter's last flush, which would print its own ``BrokenPipeError``."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # not a real file descriptor (a test runner's buffer)
        pass


def guarded(fn: F) -> F:
    """Turn every failure into one message and its exit code (never a traceback)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            try:
                result = fn(*args, **kwargs)
                sys.stdout.flush()  # a closed pipe shows here, not in click's exit path
                return result
            except BaseExceptionGroup as group:
                raise _only(group) from None
        except typer.Exit:
            raise
        except BrokenPipeError:  # like a Unix tool killed by SIGPIPE: no message, 128 + 13
            _quiet_stdout()
            raise typer.Exit(int(Exit.BROKEN_PIPE)) from None
        except ToolError as exc:
            raise _fail(exc) from None
        except LoraLedgerError as exc:
            raise _fail(ToolError.from_ledger(exc)) from None
        except KeyboardInterrupt:
            raise typer.Exit(int(Exit.INTERRUPTED)) from None
        except Exception as exc:
            if _verbosity >= 2:
                traceback.print_exc(file=sys.stderr)
            message = f"internal error: {exc!r} (run with -vv for the traceback)"
            raise _fail(ToolError(Exit.FAILED, message)) from None

    return wrapper  # type: ignore[return-value]


def _run(fn: Callable[..., Any], *args: Any) -> Any:
    return anyio.run(fn, *args)


# --- demo ----------------------------------------------------------------------------------


@app.command()
@guarded
def demo(
    directory: Annotated[
        Path | None,
        typer.Option("--dir", help="Where the run goes (default: a new folder in ./demo-runs/)."),
    ] = None,
    quick: Annotated[
        bool, typer.Option("--quick", help="The same story, smaller (a few seconds; CI).")
    ] = False,
    engine: Annotated[
        str,
        typer.Option(
            "--engine",
            help="local: two in-process local engines (default); vllm: the real vLLM CPU "
            "engine (its venv must be installed).",
        ),
    ] = "local",
    json: JsonOpt = False,
) -> None:
    """Run the whole system end to end and tell what happened, from the log it wrote.

    A SQLite ledger, two local engines, a trainer publishing versions while multi-turn
    sessions generate on several rollout workers, an engine restart repaired by the
    reconciler, old versions reclaimed as their last session closes. About a minute on 2
    cores; --quick for a small run.
    """
    from tools import demo as demo_run
    from tools.progress import progress_bar
    from tools.render import story_view, try_view

    if engine not in ("local", "vllm"):
        raise ToolError(Exit.USAGE, f"--engine must be local or vllm, got {engine!r}")
    vllm_python = None
    if engine == "vllm":
        vllm_python = demo_run.check_vllm()
    if _verbosity == 0:
        # The story explains the expected warnings and errors (requests refused or lost by
        # the restarting engine); -v shows every decision as it happens.
        logconfig.configure(-2)
        demo_run.quiet_libraries()
    folder = demo_run.prepare_dir(directory)
    cfg = demo_run.QUICK if quick else demo_run.FULL
    if not json:
        stderr_console().print(
            f"loraledger demo: {cfg.workers} rollout workers x {cfg.sessions} sessions x "
            f"{cfg.waves} waves, {cfg.turns} turns each on "
            f"{demo_run.fleet_description(engine)}; log in {folder}",
            highlight=False,
        )
    with progress_bar("sessions") as update:
        run = _run(
            functools.partial(
                demo_run.run_demo,
                folder,
                cfg,
                engine=engine,
                vllm_python=vllm_python,
                on_progress=update,
            )
        )
    story = _run(demo_run.read_story, run)
    commands = demo_run.suggestions(run, story)
    if json:
        emit(
            {
                "row": "demo",
                "engine": engine,
                "quick": quick,
                "directory": run.directory,
                "log": run.log,
                "provenance": run.provenance,
                "plot": run.plot,
                "story": to_json(story),
                "rollout": to_json(run.stats),
                "try": commands,
            }
        )
        return
    out = stdout_console()
    out.print(story_view(story, run, fleet=demo_run.fleet_description(engine)))
    out.print(try_view(commands))


# --- replay --------------------------------------------------------------------------------


@app.command()
@guarded
def replay(
    log: LogArg,
    seq: Annotated[
        int | None, typer.Option("--seq", help="Rebuild the state as of this seq.")
    ] = None,
    at: Annotated[
        str | None,
        typer.Option(
            "--at",
            help="Rebuild the state as of this time: ISO 8601 (UTC if no zone), unix "
            "seconds, a time of day (13:06:13: UTC, on the date of the log's last record) or "
            "a relative time (-5m, -2h, -30s: before the log's last record); resolves to the "
            "last seq recorded at or before it.",
        ),
    ] = None,
    version: Annotated[
        list[int] | None,
        typer.Option("--version", help="Print this version's timeline (repeatable)."),
    ] = None,
    engine: Annotated[
        list[str] | None,
        typer.Option("--engine", help="Print this engine's timeline (repeatable)."),
    ] = None,
    incidents: Annotated[
        bool, typer.Option("--incidents", help="List anomalies with the seqs that show them.")
    ] = False,
    stuck_after: Annotated[
        str,
        typer.Option(
            "--stuck-after", help="A version in a transient state longer than this is stuck."
        ),
    ] = "60s",
    pinned_top: Annotated[
        int, typer.Option("--pinned-top", help="How many longest retired-version pins to list.")
    ] = 5,
    plot: Annotated[
        Path | None,
        typer.Option("--plot", help="Draw version lifetimes and bound sessions to this PNG."),
    ] = None,
    json: JsonOpt = False,
) -> None:
    """Rebuild the ledger's state at any seq or time; timelines, incidents, a plot.

    Without options: the state at the end of the log (versions, engines, bindings).
    """
    from projections.history import Entry
    from projections.status import status_of
    from tools.plot import plot_lifetimes
    from tools.progress import progress_bar
    from tools.render import incidents_view, stalls_view, status_view, timeline_view
    from tools.replay import replay as run_replay
    from tools.timefmt import iso, parse_at, parse_duration

    when = parse_at(at) if at is not None else None
    threshold = parse_duration(stuck_after)
    if plot is not None and not plot.parent.is_dir():
        raise ToolError(Exit.USAGE, f"--plot {plot}: no such directory {plot.parent}")
    versions, engines = version or [], engine or []
    with progress_bar("replaying") as update:
        result = _run(
            functools.partial(
                run_replay,
                log,
                until_seq=seq,
                at=when,
                versions=versions,
                engines=engines,
                incidents=incidents,
                stuck_after=threshold,
                pinned_top=pinned_top,
                lifetimes=plot is not None,
                progress=update,
            )
        )
    status = status_of(result.state)
    timelines: list[tuple[str, list[Entry]]] = [
        (f"v{v}", result.versions.get(v, [])) for v in versions
    ] + [(e, result.engines.get(e, [])) for e in engines]
    written = None
    if plot is not None and result.lifetimes is not None:
        written = plot_lifetimes(
            result.lifetimes,
            plot,
            title=f"{Path(log).name} up to seq {result.seq} ({iso(result.at)})",
        )
    if json:
        emit(
            to_json(
                status,
                row="state",
                seq=result.seq,
                at=result.at,
                log_last_seq=result.log_last_seq,
            )
        )
        for subject, entries in timelines:
            for entry in entries:
                emit(to_json(entry, row="timeline", subject_of=subject))
        for stalls in result.stalls.values():
            for stall in stalls:
                emit(to_json(stall, row="stall"))
        for incident in result.incidents or []:
            emit(to_json(incident, row="incident"))
        if written is not None:
            emit({"row": "plot", "path": written})
        return
    out = stdout_console()
    limit = "" if result.seq == result.log_last_seq else f" of {result.log_last_seq}"
    asked = ""
    if at is not None and result.asked_at is not None:
        asked = f" (--at {at} = {iso(result.asked_at)})"
    title = f"{log} at seq {result.seq}{limit}{asked}"
    out.print(status_view(status, title=title, at=result.at))
    for subject, entries in timelines:
        out.print(timeline_view(subject, entries))
        if subject.startswith("v") and result.stalls.get(int(subject[1:])):
            out.print(stalls_view(subject, result.stalls[int(subject[1:])]))
    if result.incidents is not None:
        out.print(incidents_view(result.incidents))
    if written is not None:
        out.print(f"plot written to {written}")


# --- audit ---------------------------------------------------------------------------------


@app.command()
@guarded
def audit(
    log: LogArg,
    session: Annotated[
        list[str] | None, typer.Option("--session", help="Audit this session (repeatable).")
    ] = None,
    owner: Annotated[
        str | None, typer.Option("--owner", help="Audit every session of this rollout worker.")
    ] = None,
    all_sessions: Annotated[
        bool, typer.Option("--all", help="Audit every session in the log.")
    ] = False,
    provenance: Annotated[
        Path | None,
        typer.Option(
            "--provenance",
            help="Provenance JSON-lines file (publisher/provenance.py): adds every "
            "generation and checks it against the binding.",
        ),
    ] = None,
    json: JsonOpt = False,
) -> None:
    """Per-session version history: bind, the version's milestones, generations, release."""
    from tools.audit import audit_log
    from tools.progress import progress_bar
    from tools.render import audit_view

    if not (session or owner or all_sessions):
        raise ToolError(Exit.USAGE, "say which sessions: --session S, --owner W or --all")
    if all_sessions and (session or owner):
        raise ToolError(Exit.USAGE, "--all audits every session: drop --session/--owner")
    with progress_bar("auditing") as update:
        reports = _run(
            functools.partial(
                audit_log,
                log,
                sessions=session or None,
                owner=owner,
                provenance=provenance,
                progress=update,
            )
        )
    if not reports:
        wanted = ", ".join(session or []) or (f"owner {owner}" if owner else "any session")
        raise ToolError(Exit.FAILED, f"{log}: no session matches ({wanted})")
    if json:
        for report in reports:
            emit(
                to_json(
                    report.audit,
                    row="session",
                    generations=[to_json(g) for g in report.generations],
                    mismatches=list(report.mismatches),
                )
            )
    else:
        out = stdout_console()
        for report in reports:
            out.print(audit_view(report))
    if any(report.mismatches for report in reports):
        raise typer.Exit(int(Exit.FAILED))


# --- verify --------------------------------------------------------------------------------


@app.command()
@guarded
def verify(
    log: LogArg,
    deep: Annotated[
        bool,
        typer.Option(
            "--deep", help="Check the per-session invariants after every event too (slower)."
        ),
    ] = False,
    json: JsonOpt = False,
) -> None:
    """Check the hash chain and every invariant at every seq; name the first bad seq.

    Exit codes tell the failure apart: 3 missing, 4 empty, 5 not a ledger, 6 corrupt or
    truncated file, 7 tampered record or broken chain, 8 invariant violated, 9 newer schema.
    """
    from tools.progress import progress_bar
    from tools.render import verify_view
    from tools.verify import verify_log

    with progress_bar("verifying") as update:
        result = _run(functools.partial(verify_log, log, deep=deep, progress=update))
    if json:
        emit(to_json(result, row="verify"))
    else:
        stdout_console().print(verify_view(result))
    if not result.ok:
        raise typer.Exit(result.exit_code)


# --- status --------------------------------------------------------------------------------


@app.command()
@guarded
def status(
    url: Annotated[
        str,
        typer.Option("--url", envvar="LORALEDGER_URL", help="Where `loraledger serve` listens."),
    ] = DEFAULT_URL,
    token: Annotated[
        str | None,
        typer.Option(
            "--token", envvar="LORALEDGER_TOKEN", help="Bearer token, if the service wants one."
        ),
    ] = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait.")] = 5.0,
    json: JsonOpt = False,
) -> None:
    """Ask a running ledger (`loraledger serve`) for its live status."""
    from tools.arguments import seconds, service_url
    from tools.render import status_view
    from tools.status import fetch_status

    live = fetch_status(
        service_url("--url", url), token=token, timeout=seconds("--timeout", timeout)
    )
    if json:
        emit(to_json(live, row="status"))
        return
    stdout_console().print(status_view(live, title=f"ledger at {url}"))


# --- fleet (operator actions) ------------------------------------------------------------

UrlOpt = Annotated[
    str, typer.Option("--url", envvar="LORALEDGER_URL", help="Where `loraledger serve` listens.")
]
TokenOpt = Annotated[
    str | None,
    typer.Option("--token", envvar="LORALEDGER_TOKEN", help="Bearer token of the service."),
]
EngineArg = Annotated[str, typer.Argument(help="The engine id, as in `loraledger status`.")]


def _engine_action(url: str, token: str | None, engine: str, action: str, detail: str,
                   json: bool) -> None:  # fmt: skip
    from tools.arguments import service_url
    from tools.fleet_ops import engine_action

    answer = engine_action(service_url("--url", url), engine, action, token=token, detail=detail)
    if json:
        emit({"row": action, "engine": engine, **answer})
    else:
        done = "already so: nothing recorded" if answer.get("no_op") else "recorded"
        print(f"{action} {engine}: {done}")


@fleet_app.command("suspend")
@guarded
def fleet_suspend(
    engine: EngineArg,
    reason: Annotated[str, typer.Option("--reason", help="Why (recorded in the log).")] = "",
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
    json: JsonOpt = False,
) -> None:
    """Quarantine an engine: no new traffic at once, publication and reclaim stop waiting for
    it, sessions continue on the other holders of their version. Only `resume` lifts it."""
    _engine_action(url, token, engine, "suspend", reason, json)


@fleet_app.command("resume")
@guarded
def fleet_resume(
    engine: EngineArg, url: UrlOpt = DEFAULT_URL, token: TokenOpt = None, json: JsonOpt = False
) -> None:
    """Lift a suspension: the engine gets traffic again once the reconciler repaired it."""
    _engine_action(url, token, engine, "resume", "", json)


@fleet_app.command("remove")
@guarded
def fleet_remove(
    engine: EngineArg, url: UrlOpt = DEFAULT_URL, token: TokenOpt = None, json: JsonOpt = False
) -> None:
    """Remove an engine from the fleet (an engine that died and will not come back)."""
    _engine_action(url, token, engine, "remove", "", json)


# --- serve ---------------------------------------------------------------------------------

# The OpenAI routes' limits, on serve and gateway alike (docs/openai.md, "Limits").
MaxBodyOpt = Annotated[
    int,
    typer.Option(
        "--max-body-mb",
        help="The largest OpenAI request body, MiB (images travel inline as base64); a larger "
        "one is refused 413 BODY_TOO_LARGE.",
    ),
]
UpstreamTimeoutOpt = Annotated[
    float,
    typer.Option(
        "--upstream-timeout-s",
        help="Seconds the gateway waits for an engine's next bytes: a non-streaming request's "
        "whole generation (queueing included), a stream's first event and each gap; then 502 "
        "AMBIGUOUS_DISPATCH.",
    ),
]


@app.command()
@guarded
def serve(
    db: Annotated[
        str,
        typer.Option(
            "--db",
            help="The ledger log, created if absent: a SQLite file on a disk that outlives "
            "this machine, or postgresql://user@host/db (docs/stores.md).",
        ),
    ] = "loraledger.db",
    host: Annotated[
        str,
        typer.Option("--host", help="Listen address. Beyond loopback a --token is required."),
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port (0: any free port).")] = (
        DEFAULT_PORT
    ),
    token: Annotated[
        str | None,
        typer.Option(
            "--token",
            help="Deprecated (visible to every user in ps): use LORALEDGER_TOKEN or "
            "--token-file. Bearer token required by every state-changing route (POST).",
        ),
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            "--token-file",
            help="File whose first line is the bearer token required by every state-changing "
            "route (POST); default: $LORALEDGER_TOKEN. Without a token those routes are refused.",
        ),
    ] = None,
    engine_token_file: Annotated[
        Path | None,
        typer.Option(
            "--engine-token-file",
            help="File whose first line is the token sent to every engine (their --api-key); "
            "default: $LORALEDGER_ENGINE_TOKEN.",
        ),
    ] = None,
    engine: Annotated[
        list[str] | None,
        typer.Option(
            "--engine",
            help="A fleet member, ID=KIND:URL with KIND sglang (adapters by path), "
            "sglang-tensors (SGLang >= 0.5.17's tensor route: no shared filesystem), vllm, "
            "local, or agent (URL = AGENT_URL,sglang:URL or AGENT_URL,vllm:URL: an engine fed "
            "by its host's `loraledger agent`), e.g. e0=sglang:http://127.0.0.1:30000; "
            "e1=local: runs a local engine in process (repeatable).",
        ),
    ] = None,
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
    max_connections: Annotated[
        int,
        typer.Option("--max-connections", help="Open connections beyond which one gets 503."),
    ] = 1000,
    header_timeout: Annotated[
        float,
        typer.Option(
            "--header-timeout", help="Seconds a connection has to send a request's headers."
        ),
    ] = 10.0,
    alias: Annotated[
        str,
        typer.Option("--alias", help="The OpenAI model name meaning 'my session's version'."),
    ] = "policy",
    provenance: Annotated[
        Path | None,
        typer.Option(
            "--provenance",
            help="JSON-lines provenance of every OpenAI request (default: next to --db).",
        ),
    ] = None,
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
    session_idle: Annotated[
        float,
        typer.Option(
            "--session-idle-s",
            help="Release an OpenAI session after this many seconds without a turn (cause "
            "'idle'), so its version can be reclaimed; 0: never.",
        ),
    ] = 1800.0,
    max_body_mb: MaxBodyOpt = 64,
    upstream_timeout: UpstreamTimeoutOpt = 3600.0,
    json: JsonOpt = False,
) -> None:
    """Run the ledger as a service: /health, /status, /metrics; POST routes need the token.

    Read-only and open: GET /health, /status, /metrics. Bearer token: POST /owners,
    /owners/{owner}/renew, /owners/{owner}/deregister, /sessions/{session}/bind,
    /sessions/{session}/release, /sessions/forget, /versions,
    /engines/{engine}/{suspend,resume,remove,trouble}, and the OpenAI routes (/v1/chat/completions,
    /v1/completions, /v1/models; docs/openai.md).
    Stops cleanly on SIGINT/SIGTERM.
    """
    from tools import serve as service

    opts = service.ServeOptions(
        db=db,
        host=host,
        port=port,
        token=_secret(token, "--token", token_file, "LORALEDGER_TOKEN"),
        engine_token=_secret(
            None, "", engine_token_file, "LORALEDGER_ENGINE_TOKEN", "--engine-token-file"
        ),
        engines=service.specs(engine or []),
        deployment=deployment,
        prefix=prefix,
        capacity=capacity,
        max_staleness=max_staleness,
        artifact_root=str(artifact_root) if artifact_root else None,
        served_model=served_model,
        private_reads=private_reads,
        max_connections=max_connections,
        header_timeout_s=header_timeout,
        alias=alias,
        provenance=str(provenance) if provenance else None,
        suspend_after_s=None if suspend_after == 0 else suspend_after,  # checked below
        probe_timeout_s=probe_timeout,
        session_idle_s=session_idle,
        max_body_mb=max_body_mb,
        upstream_timeout_s=upstream_timeout,
    )
    service.check_options(opts)  # before any side effect, logging set-up included
    if _verbosity == 0:
        logconfig.configure(1, stdlib=True)  # a service's stderr is its log: decisions shown
    else:
        logconfig.configure(_verbosity, stdlib=True)
    service.warn_if_open_elsewhere(opts.db)

    def ready(url: str) -> None:
        if json:
            emit({"row": "listening", "url": url, "db": str(db), "pid": os.getpid()})
        else:
            print(f"loraledger serve: listening on {url} (log {db}, pid {os.getpid()})", flush=True)

    _run(functools.partial(service.serve, opts, verbosity=max(_verbosity, 1), on_ready=ready))


@app.command()
@guarded
def gateway(
    ledger: Annotated[
        str, typer.Option("--ledger", help="Base URL of the running `loraledger serve`.")
    ],
    host: Annotated[
        str,
        typer.Option("--host", help="Listen address. Beyond loopback a token is required."),
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port (0: any free port).")] = 8766,
    token_file: Annotated[
        Path | None,
        typer.Option(
            "--token-file",
            help="File whose first line is the ledger's bearer token, also the one clients "
            "must send; default: $LORALEDGER_TOKEN.",
        ),
    ] = None,
    engine_token_file: Annotated[
        Path | None,
        typer.Option(
            "--engine-token-file",
            help="File whose first line is the token sent to every engine; default: "
            "$LORALEDGER_ENGINE_TOKEN.",
        ),
    ] = None,
    engine: Annotated[
        list[str] | None,
        typer.Option(
            "--engine",
            help="How this process reaches an engine of the ledger's fleet, ID=KIND:URL as for "
            "serve (repeatable); default: each engine's endpoint as the ledger reports it.",
        ),
    ] = None,
    alias: Annotated[
        str,
        typer.Option("--alias", help="The OpenAI model name meaning 'my session's version'."),
    ] = "policy",
    owner: Annotated[
        str | None,
        typer.Option(
            "--owner",
            help="This gateway's owner id in the ledger (default gateway-HOST-PID-RANDOM, one "
            "per process); a restart under the same id releases its predecessor's sessions.",
        ),
    ] = None,
    ttl: Annotated[float, typer.Option("--ttl-s", help="Lease of the owner, seconds.")] = 30.0,
    session_idle: Annotated[
        float,
        typer.Option(
            "--session-idle-s",
            help="Release a session after this many seconds without a turn here; 0: never.",
        ),
    ] = 1800.0,
    refresh: Annotated[
        float,
        typer.Option("--refresh-s", help="Seconds between reads of the ledger's routing."),
    ] = 1.0,
    provenance: Annotated[
        Path | None,
        typer.Option(
            "--provenance", help="JSON-lines provenance (default: ./OWNER.provenance.jsonl)."
        ),
    ] = None,
    max_connections: Annotated[
        int,
        typer.Option("--max-connections", help="Open connections beyond which one gets 503."),
    ] = 1000,
    max_body_mb: MaxBodyOpt = 64,
    upstream_timeout: UpstreamTimeoutOpt = 3600.0,
    json: JsonOpt = False,
) -> None:
    """Serve the OpenAI routes in front of a remote `loraledger serve` (docs/openai.md).

    Sessions bind in the ledger (durably, before anything is sent), in-flight counts travel
    with this process's lease renewals, and routing comes from the ledger's status. Several
    gateway processes agree on a session's version and engine without talking to each other.
    Stops cleanly on SIGINT/SIGTERM.
    """
    from tools import gateway as front
    from tools import serve as service

    opts = front.GatewayOptions(
        ledger=ledger.rstrip("/"),
        host=host,
        port=port,
        token=_secret(None, "", token_file, "LORALEDGER_TOKEN"),
        engine_token=_secret(
            None, "", engine_token_file, "LORALEDGER_ENGINE_TOKEN", "--engine-token-file"
        ),
        engines=service.specs(engine or []),
        alias=alias,
        owner=owner,
        ttl_s=ttl,
        session_idle_s=session_idle,
        refresh_s=refresh,
        provenance=str(provenance) if provenance else None,
        max_connections=max_connections,
        max_body_mb=max_body_mb,
        upstream_timeout_s=upstream_timeout,
    )
    front.check_options(opts)
    logconfig.configure(max(_verbosity, 1), stdlib=True)

    def ready(url: str, owner_id: str) -> None:
        if json:
            emit({"row": "listening", "url": url, "owner": owner_id, "pid": os.getpid()})
        else:
            print(
                f"loraledger gateway: listening on {url} (ledger {opts.ledger}, owner "
                f"{owner_id}, pid {os.getpid()})",
                flush=True,
            )

    _run(functools.partial(front.run_gateway, opts, verbosity=max(_verbosity, 1), on_ready=ready))


def _secret(
    given: str | None,
    flag: str,
    file: Path | None,
    env_var: str,
    file_flag: str = "--token-file",
) -> str | None:
    """A token from ``file`` (the option ``file_flag``), else ``given`` on the command line
    (warned: ``ps`` shows it to every user of the machine; kept so existing scripts work),
    else ``env_var``."""
    from engines.guard import read_token

    if given and file is not None:
        raise ToolError(Exit.USAGE, f"give {flag} or {file_flag}, not both")
    if given:
        stderr_console().print(
            f"warning: {flag} is visible to every user of this machine (ps); "
            f"use {env_var} or {file_flag}",
            markup=False,
        )
        return given
    try:
        return read_token(env_var, file)
    except (OSError, ValueError) as exc:
        raise ToolError(Exit.USAGE, f"{file_flag}: {exc}") from None


# --- engine --------------------------------------------------------------------------------


@app.command()
@guarded
def engine(
    engine_id: Annotated[
        str, typer.Option("--id", help="The engine's id (the fleet member's name).")
    ] = "e0",
    port: Annotated[
        int, typer.Option("--port", help="TCP port on 127.0.0.1 (0: any free port).")
    ] = 30000,
    artifact_root: Annotated[
        Path | None,
        typer.Option("--artifacts", help="Refuse adapter paths outside this directory."),
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            "--token-file",
            help="File whose first line is the bearer token the control routes require "
            "(load, unload, staged transfer, pause, abort); default: $LORALEDGER_ENGINE_TOKEN.",
        ),
    ] = None,
    json: JsonOpt = False,
) -> None:
    """Run the bundled local engine over HTTP on 127.0.0.1: try loraledger without a GPU.

    A tiny model built locally (no download) behind SGLang 0.5.x's endpoints plus staged
    transfer: use it as sglang:URL (adapters loaded by path, as on SGLang) or local:URL
    (adapters streamed and verified). Stops cleanly on SIGINT/SIGTERM.
    """
    from tools import local_engine
    from tools.demo import quiet_libraries

    opts = local_engine.EngineOptions(
        engine_id=engine_id,
        port=port,
        artifact_root=str(artifact_root) if artifact_root else None,
        token=_secret(None, "", token_file, "LORALEDGER_ENGINE_TOKEN"),
    )
    local_engine.check_options(opts)
    quiet_libraries()

    def ready(url: str) -> None:
        if json:
            emit({"row": "listening", "engine": engine_id, "url": url, "pid": os.getpid()})
        else:
            print(
                f"loraledger engine: {engine_id} listening on {url} (pid {os.getpid()})", flush=True
            )

    _run(functools.partial(local_engine.run_engine, opts, on_ready=ready))


# --- agent ---------------------------------------------------------------------------------


@app.command()
@guarded
def agent(
    engine_spec: Annotated[
        str,
        typer.Option("--engine", help="The engine beside it, KIND:URL with KIND sglang or vllm."),
    ],
    artifacts: Annotated[
        Path,
        typer.Option("--artifacts", help="This host's artifact directory (the engine reads it)."),
    ],
    engine_id: Annotated[str, typer.Option("--id", help="The fleet member's engine id.")] = "e0",
    port: Annotated[int, typer.Option("--port", help="TCP port (0: any free port).")] = 30100,
    token_file: Annotated[
        Path | None,
        typer.Option(
            "--token-file",
            help="File whose first line is the bearer token its routes require; default: "
            "$LORALEDGER_AGENT_TOKEN. Required to listen beyond loopback.",
        ),
    ] = None,
    host: Annotated[str, typer.Option("--host", help="Listen address.")] = "127.0.0.1",
    served_model: Annotated[
        str, typer.Option("--served-model", help="vLLM's --served-model-name.")
    ] = "tiny",
    json: JsonOpt = False,
) -> None:
    """Run the engine-host agent beside an SGLang or vLLM server: no shared filesystem.

    It receives a version's buckets over loraledger's staged protocol, verifies them, writes
    the PEFT directory on this host's disk and asks its engine to load that path
    (docs/engines.md, The engine-host agent). Join it to the ledger as
    ID=agent:AGENT_URL,KIND:ENGINE_URL. Stops cleanly on SIGINT/SIGTERM.
    """
    from engines import agent as host_agent

    kind, _, url = engine_spec.partition(":")
    if kind not in ("sglang", "vllm") or not url.startswith(("http://", "https://")):
        raise ToolError(Exit.USAGE, f"--engine {engine_spec!r}: expected sglang:URL or vllm:URL")
    if not artifacts.is_dir():
        raise ToolError(Exit.USAGE, f"--artifacts {artifacts} is not a directory")
    token = _secret(None, "", token_file, "LORALEDGER_AGENT_TOKEN")

    def ready(base: str) -> None:
        if json:
            emit({"row": "listening", "engine": engine_id, "url": base, "pid": os.getpid()})
        else:
            print(f"loraledger agent: {engine_id} listening on {base} (pid {os.getpid()})")

    try:
        _run(
            functools.partial(
                host_agent.run,
                engine=engine_spec,
                artifacts=str(artifacts),
                engine_id=engine_id,
                host=host,
                port=port,
                token=token,
                engine_token=_secret(None, "", None, "LORALEDGER_ENGINE_TOKEN"),
                served_model=served_model,
                on_ready=ready,
            )
        )
    except ValueError as exc:
        raise ToolError(Exit.UNSAFE, str(exc)) from None


# --- check-engine --------------------------------------------------------------------------


@app.command("check-engine")
@guarded
def check_engine(
    url: Annotated[str, typer.Argument(help="The engine's base URL, e.g. http://127.0.0.1:30000")],
    kind: Annotated[
        str,
        typer.Option(
            "--kind", help="sglang, vllm or local (the bundled engine, staged and path loads)."
        ),
    ] = "sglang",
    model: Annotated[
        Path | None,
        typer.Option(
            "--model",
            help="Base model directory (or its config.json), for the throwaway adapters' "
            "shapes; default: the model path the server reports, read on this host.",
        ),
    ] = None,
    artifacts: Annotated[
        Path | None,
        typer.Option(
            "--artifacts",
            help="Where the throwaway adapter directories go; the engine must read them at the "
            "same path (default: a temporary directory on this host, deleted afterwards).",
        ),
    ] = None,
    api_key_file: Annotated[
        Path | None,
        typer.Option(
            "--api-key-file",
            help="File whose first line is the engine's API key; default: "
            "$LORALEDGER_ENGINE_TOKEN.",
        ),
    ] = None,
    long_tokens: Annotated[
        int | None,
        typer.Option(
            "--long-tokens",
            help="Length of the request kept running during the unload (default: most of "
            "the context, at most 1024).",
        ),
    ] = None,
    restart_command: Annotated[
        str | None,
        typer.Option(
            "--restart-command",
            help="A shell command that restarts the engine (and returns): also checks that a "
            "restart changes its incarnation. Use it on an engine that holds nothing.",
        ),
    ] = None,
    json: JsonOpt = False,
) -> None:
    """Check that a live engine behaves the way loraledger relies on (docs/engines.md).

    Publishes throwaway adapters, checks load/list, digest confirmation, same-name reloads,
    unload under a running request, refusal after unload, implicit reloads, prefix-cache
    isolation between versions and tensor vs path loads, then unloads everything it loaded.
    Exit 0 when everything the ledger needs holds, 1 when something does not, 12 when the
    engine cannot be reached.
    """
    from tools import check_engine as checker

    opts = checker.CheckOptions(
        kind=kind,
        url=url,
        model=str(model) if model else None,
        artifacts=str(artifacts) if artifacts else None,
        api_key=_secret(None, "", api_key_file, "LORALEDGER_ENGINE_TOKEN", "--api-key-file"),
        long_tokens=long_tokens,
        restart_command=restart_command,
    )
    checker.check_options(opts)
    report = _run(checker.check_engine, opts)
    if json:
        emit({"row": "check", **checker.as_json(report)})
    else:
        stdout_console().print(checker.render(report))
    if not report.ok:
        raise typer.Exit(int(Exit.FAILED))


# --- bench ---------------------------------------------------------------------------------


def _bench_command(name: str, summary: str) -> None:
    """Register ``loraledger bench NAME``: every bench takes the same options (``--store``
    only where the bench function has a ``store`` parameter)."""

    def command(
        quick: Annotated[
            bool, typer.Option("--quick", help="A small, fast run (CI smoke).")
        ] = False,
        directory: Annotated[
            Path | None, typer.Option("--dir", help="Scratch directory (default: a temp dir).")
        ] = None,
        json: JsonOpt = False,
        store: Annotated[
            str | None,
            typer.Option(
                "--store",
                help="Event store, for the benches that take one (ledger): sqlite (default) "
                "or postgres (a throwaway local server this run starts).",
            ),
        ] = None,
    ) -> None:
        from tools.bench import run_bench

        run_bench(name, quick=quick, directory=directory, json=json, store=store)

    command.__doc__ = summary
    command.__name__ = f"bench_{name}"
    bench_app.command(name)(guarded(command))


for _name, _summary in {
    "store": "Event store: group-committed appends and a verified replay vs raw sqlite3.",
    "ledger": "Ledger service: durable bind+release sessions/s vs raw sqlite3 (or asyncpg with "
    "--store postgres); recovery time.",
    "publish": "Publication to two local engines vs copying the bytes; longest generation gap.",
    "memory": "Projection memory after a million sessions bound, released and forgotten.",
    "ray": "Binds/s through the Ray ledger actor vs a dict in a Ray actor; batched calls.",
    "ray-publish": "Publication through Ray (object store, engine actors) vs in process.",
    "gateway": "OpenAI gateway vs a bare proxy vs direct to a stub engine: req/s, added TTFB.",
}.items():
    _bench_command(_name, _summary)


def main() -> None:
    """Console-script entry point."""
    os.environ.setdefault("PYTHONIOENCODING", "utf-8")
    stdout_before = _identity(1)
    try:
        app()
    except SystemExit as done:
        if done.code == 1 and _stdout_went_away(stdout_before):
            raise SystemExit(int(Exit.BROKEN_PIPE)) from None
        raise


def _identity(fd: int) -> tuple[int, int] | None:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _stdout_went_away(before: tuple[int, int] | None) -> bool:
    """Whether an exit 1 was the answer to a closed stdout outside any command: help is
    printed while click parses the options, before ``guarded`` runs, by a rich console whose
    answer to ``BrokenPipeError`` is to put /dev/null in place of stdout and exit 1. Nothing
    else here swaps stdout for /dev/null (``_quiet_stdout`` does, but exits 141 itself), so
    that mark means the reader went away (``loraledger --help | head -1``): 141, as from a
    command."""
    null = os.stat(os.devnull)
    devnull = (null.st_dev, null.st_ino)
    return before != devnull and _identity(1) == devnull


if __name__ == "__main__":
    main()
