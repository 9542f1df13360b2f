"""The read-only tools over a log: ``loraledger replay``, ``audit`` and ``verify``. They never
write to the log they read (``tools/logfile.py`` opens it)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated

import typer

from evlog.locations import redacted
from tools.cli.common import JsonOpt, LogArg, guarded, run_async
from tools.exitcodes import Exit, ToolError
from tools.output import emit, stderr_console, stdout_console, to_json

# --- replay --------------------------------------------------------------------------------


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
    from tools.render import (
        incidents_view,
        status_view,
        subject_views,
    )
    from tools.replay import replay as run_replay
    from tools.timefmt import iso, parse_at, parse_duration

    when = parse_at(at) if at is not None else None
    threshold = parse_duration(stuck_after)
    if plot is not None and not plot.parent.is_dir():
        raise ToolError(Exit.USAGE, f"--plot {plot}: no such directory {plot.parent}")
    versions, engines = version or [], engine or []
    with progress_bar("replaying", json=json) as update:
        result = run_async(
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
        for causes in result.reclaims.values():
            for cause in causes:
                emit(to_json(cause, row="reclaim"))
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
    title = f"{redacted(log)} at seq {result.seq}{limit}{asked}"
    out.print(status_view(status, title=title, at=result.at))
    subjects: list[int | str] = [*versions, *engines]
    for about in subjects:
        for view in subject_views(result, about):
            out.print(view)
    if result.incidents is not None:
        out.print(incidents_view(result.incidents))
    if written is not None:
        out.print(f"plot written to {written}")


# --- audit ---------------------------------------------------------------------------------


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
            help="Read the generations from this JSON-lines file instead of the provenance "
            "store beside the log (where every face's rows are kept).",
        ),
    ] = None,
    json: JsonOpt = False,
) -> None:
    """Per-session version history: bind, the version's milestones, release, and every
    generation (from the provenance store beside the log, or --provenance), each checked
    against the binding."""
    from tools.audit import audit_log
    from tools.progress import progress_bar
    from tools.render import audit_view

    if not (session or owner or all_sessions):
        raise ToolError(Exit.USAGE, "say which sessions: --session S, --owner W or --all")
    if all_sessions and (session or owner):
        raise ToolError(Exit.USAGE, "--all audits every session: drop --session/--owner")
    with progress_bar("auditing", json=json) as update:
        audited = run_async(
            functools.partial(
                audit_log,
                log,
                sessions=session or None,
                owner=owner,
                provenance=provenance,
                progress=update,
            )
        )
    reports = audited.reports
    if audited.note is not None:
        stderr_console().print(f"note: {audited.note}", markup=False)
    if not reports:
        wanted = ", ".join(session or []) or (f"owner {owner}" if owner else "any session")
        raise ToolError(Exit.FAILED, f"{redacted(log)}: no session matches ({wanted})")
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
            if audited.provenance is not None and not report.generations:
                out.print(
                    f"no generations of {report.audit.session} in {audited.provenance}",
                    markup=False,
                )
    if any(report.mismatches for report in reports):
        raise typer.Exit(int(Exit.FAILED))


# --- verify --------------------------------------------------------------------------------


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

    with progress_bar("verifying", json=json) as update:
        result = run_async(functools.partial(verify_log, log, deep=deep, progress=update))
    if json:
        emit(to_json(result, row="verify"))
    else:
        stdout_console().print(verify_view(result))
    if not result.ok:
        raise typer.Exit(result.exit_code)
