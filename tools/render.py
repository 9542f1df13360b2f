"""Rich renderables for every result the CLI prints: a pure function of the result each.

Kept apart from the commands so the same view serves every source of the same data: the
ledger status looks the same whether it was replayed from a file (``replay``) or fetched from
a running service (``status``).
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from projections.history import Entry
from projections.holders import ReclaimCause
from projections.incidents import Incident
from projections.stalls import Stall
from projections.status import LedgerStatus, OutageStatus
from tools.audit import AuditReport
from tools.demo import DemoRun
from tools.replay import ReplayResult
from tools.story import Story
from tools.timefmt import iso, span
from tools.verify import VerifyResult

_STATE_STYLE = {
    "LOADING": "yellow",
    "PUBLISHED": "bold green",
    "RETIRED": "cyan",
    "RECLAIMING": "magenta",
    "RECLAIMED": "dim",
    "FAILED_RETRYABLE": "red",
    "FAILED_FATAL": "bold red",
}


def state_text(state: str | None) -> Text:
    if state is None:
        return Text("-", style="dim")
    return Text(state, style=_STATE_STYLE.get(state, ""))


def status_view(status: LedgerStatus, *, title: str, at: float | None = None) -> RenderableType:
    """Header facts, then one table of versions and one of engines."""
    default = f"v{status.default}" if status.default is not None else "none"
    # Text objects, not markup: the deployment name comes from the log (user text).
    lines = [
        Text(
            f"deployment {status.deployment or '(not created)'}  epoch {status.epoch}  "
            f"seq {status.last_seq}" + (f"  recorded {iso(at)}" if at is not None else "")
        ),
        Text(
            f"default {default} (revision {status.default_revision})  "
            f"capacity {status.capacity_used}/{status.capacity}  "
            f"sessions bound {status.sessions_bound}  tombstones {status.tombstones}  "
            f"live owners {status.owners}"
            + (
                f"  max_staleness {status.max_staleness}"
                if status.max_staleness is not None
                else ""
            )
        ),
    ]
    if status.blocked_by:
        lines.append(
            Text(
                "publication blocked by unresolved versions "
                f"{', '.join(f'v{v}' for v in status.blocked_by)}",
                style="bold red",
            )
        )
    versions = Table(title="versions", title_justify="left", expand=False)
    for column in ("version", "state", "attempt", "revision", "bound", "held by", "adapter"):
        versions.add_column(column, justify="right" if column in {"attempt", "bound"} else "left")
    for v in status.versions:
        versions.add_row(
            f"v{v.version_id}",
            state_text(v.state),
            str(v.attempt),
            "-" if v.revision is None else str(v.revision),
            str(v.bound),
            ", ".join(v.holders) or "-",
            v.lora_name,
        )
    engines = Table(title="engines", title_justify="left", expand=False)
    for column in ("engine", "kind", "incarnation", "routable", "holds", "strays", "endpoint"):
        engines.add_column(column)
    version_of = {v.lora_name: v.version_id for v in status.versions}
    for e in status.engines:
        held = sorted((version_of.get(name, 0), name) for name in e.holds)
        engines.add_row(
            e.engine,
            e.kind,
            e.incarnation,
            Text("yes", style="green") if e.routable else Text("no", style="bold red"),
            ", ".join(f"v{vid}" if vid else name for vid, name in held) or "-",
            ", ".join(e.strays) or "-",
            e.endpoint or "-",
        )
    outages = [_outage_line(e.engine, e.unreachable) for e in status.engines if e.unreachable]
    impostors = [
        Text(
            f"engine {e.engine} serves other content under "
            + ", ".join(f"v{version_of.get(n, 0)} ({n})" for n in e.mismatched)
            + ": not routed there for those versions",
            style="bold red",
        )
        for e in status.engines
        if e.mismatched
    ]
    return Group(Text(title, style="bold"), *lines, versions, engines, *outages, *impostors)


def _outage_line(engine: str, outage: OutageStatus) -> Text:
    """An engine's outage in progress: since when, its first error, the failed turns."""
    seen = outage.source + (f" ({outage.reporter})" if outage.reporter else "")
    per_session = ", ".join(f"{f.session} {f.not_run}/{f.ambiguous}" for f in outage.failures)
    return Text(
        f"engine {engine} unreachable since {iso(outage.since)}, seen by {seen}: "
        f"{outage.error}; failed turns: {outage.not_run} not run (tried elsewhere), "
        f"{outage.ambiguous} ambiguous"
        + (f" (per session, not run/ambiguous: {per_session})" if per_session else ""),
        style="bold red",
    )


def timeline_view(subject: str, entries: Sequence[Entry]) -> RenderableType:
    table = Table(title=f"timeline of {subject}", title_justify="left")
    for column in ("seq", "time", "event", "from", "to", "detail"):
        table.add_column(column, justify="right" if column == "seq" else "left")
    if not entries:
        return Group(table, Text(f"(no events about {subject} in this range)", style="dim"))
    for e in entries:
        changed = e.from_state != e.to_state
        table.add_row(
            str(e.seq),
            iso(e.at),
            e.event,
            state_text(e.from_state) if changed else Text(""),
            state_text(e.to_state) if changed else Text(""),
            e.detail,
        )
    return table


def subject_views(result: ReplayResult, subject: int | str) -> list[RenderableType]:
    """What ``replay --version N`` (``subject`` the int N) or ``--engine E`` (the str E) prints
    about it: the timeline, then for a version why it stalled and what made its reclaims
    possible. One function, so the CLI and the operator's page (``/ui/version/N``,
    ``/ui/engine/E``) tell the same story."""
    if isinstance(subject, str):
        return [timeline_view(subject, result.engines.get(subject, []))]
    name = f"v{subject}"
    views = [timeline_view(name, result.versions.get(subject, []))]
    if result.stalls.get(subject):
        views.append(stalls_view(name, result.stalls[subject]))
    if result.reclaims.get(subject):
        views.append(reclaims_view(name, result.reclaims[subject]))
    return views


def stalls_view(subject: str, stalls: Sequence[Stall]) -> RenderableType:
    """Why a version stalled: each refusal or skip, what stood in the way, when it cleared."""
    table = Table(title=f"why {subject} stalled", title_justify="left")
    for column in ("seq", "time", "refused", "in the way", "cleared", "went on"):
        table.add_column(column, justify="right" if column == "seq" else "left")
    for st in stalls:
        ways: list[str] = []
        cleared: list[str] = []
        for o in st.obstacles:
            why = f" {o.reason.replace('_', ' ')}" if o.reason else ""
            bound = f" ({o.bound} sessions{_named(o.sessions, o.bound)})" if o.bound else ""
            ways.append(f"v{o.version_id} {o.state or '?'}{why}{bound}")
            if o.cleared_seq is None:
                cleared.append(f"v{o.version_id}: not in this range")
            else:
                after = span(None if o.cleared_at is None else o.cleared_at - st.at)
                cleared.append(
                    f"v{o.version_id} -> {o.cleared_to} at seq {o.cleared_seq} "
                    f"({o.cleared_by}, {after} later)"
                )
        went_on = (
            "-"
            if st.went_on_seq is None or st.went_on_at is None
            else f"seq {st.went_on_seq} ({span(st.went_on_at - st.at)} later)"
        )
        table.add_row(
            str(st.seq),
            iso(st.at),
            Text(f"{st.code}: {st.cause}"),
            Text("\n".join(ways) or "-"),
            Text("\n".join(cleared) or "-"),
            went_on,
        )
    return table


def _named(sessions: Sequence[str], count: int) -> str:
    """``: s1, s2`` (and how many more the record counted), or nothing when none is known."""
    if not sessions:
        return ""
    more = f" and {count - len(sessions)} more" if count > len(sessions) else ""
    return ": " + ", ".join(sessions) + more


def reclaims_view(subject: str, causes: Sequence[ReclaimCause]) -> RenderableType:
    """What made each reclaim of a version possible: the last binding of it to go, or its
    retirement when no session held it any more by then."""
    lines: list[RenderableType] = []
    for r in causes:
        last = r.last_release
        left = (
            None
            if last is None
            else f"{last.session} (owner {last.owner}, {last.cause}) at seq {last.seq}"
        )
        retired = "" if r.retired_seq is None else f" at seq {r.retired_seq}"
        if r.enabled_by == "release" and left is not None:
            why = f"the release of {left}, the last session bound to it (retired{retired})"
        elif left is not None:
            why = f"its retirement{retired} (its last session, {left}, had left before)"
        else:
            why = f"its retirement{retired} (no session was ever bound to it)"
        lines.append(
            Text(
                f"{subject} reclaim claimed at seq {r.claimed_seq} ({iso(r.claimed_at)}): "
                f"made possible by {why}"
            )
        )
    return Group(*lines)


def _health_view(found: Sequence[Incident]) -> RenderableType:
    return incidents_view(found, title=f"{len(found)} engine-health incidents")


def incidents_view(found: Sequence[Incident], *, title: str = "") -> RenderableType:
    if not found:
        return Text("no incidents", style="green")
    table = Table(title=title or f"{len(found)} incidents", title_justify="left")
    for column in ("time", "kind", "subject", "what", "lasted", "outcome", "seqs"):
        table.add_column(column)
    for i in found:
        if i.resolved is None:
            outcome = Text("-", style="dim")
        elif i.resolved:
            outcome = Text(i.resolution or "resolved", style="green")
        else:
            outcome = Text(i.resolution or "unresolved", style="bold red")
        table.add_row(
            iso(i.at),
            i.kind,
            i.subject,
            i.summary,
            span(i.duration_s),
            outcome,
            ", ".join(str(s) for s in i.seqs),
        )
    return table


def audit_view(report: AuditReport) -> RenderableType:
    """One session life as a single time-ordered table: binding, the version's milestones,
    each generation, the release."""
    a = report.audit
    if a.version_id is None and a.released_seq is None:
        head = f"session {a.session}: not in the log (only in its provenance rows)"
    elif a.version_id is None:
        head = f"session {a.session} (owner {a.owner}): closed before it ever bound"
    else:
        head = (
            f"session {a.session} (owner {a.owner}) -> v{a.version_id} {a.lora_name} "
            f"digest {(a.digest or '')[:16]} revision {a.revision}"
        )
    rows: list[tuple[float, int, str, str, Text]] = []
    if a.bound_seq is not None and a.bound_at is not None:
        rows.append(
            (
                a.bound_at,
                a.bound_seq,
                "BOUND",
                f"v{a.version_id} at revision {a.revision}",
                Text(""),
            )
        )
    for f in a.version_facts:
        mark = Text("while bound", style="yellow") if f.during else Text("")
        rows.append((f.at, f.seq, f"v{a.version_id} {f.what}", f.detail, mark))
    for g in report.generations:
        ended = f"{g.finish_reason} {g.refusal_code}" if g.refusal_code else g.finish_reason
        detail = (
            f"turn {g.turn} on {g.engine} v{g.version_id}: {g.prompt_tokens}+"
            f"{g.completion_tokens} tokens, {ended}, staleness {g.staleness} "
            f"(req {g.request_id})"
        )
        rows.append((g.started_at, -1, "generation", detail, Text("")))
    if a.released_seq is not None and a.released_at is not None:
        cause = a.cause or ""
        if a.lease_expired_seq is not None:
            cause += f" (owner lease expired at seq {a.lease_expired_seq})"
        rows.append((a.released_at, a.released_seq, "RELEASED", cause, Text("")))
    if a.forgotten_seq is not None:
        at = a.forgotten_at if a.forgotten_at is not None else a.released_at or 0.0
        rows.append((at, a.forgotten_seq, "forgotten", "tombstone dropped", Text("")))
    rows.sort(key=lambda r: (r[0], r[1] if r[1] >= 0 else float("inf")))
    table = Table(title=head, title_justify="left")
    for column in ("time", "seq", "what", "detail", ""):
        table.add_column(column, justify="right" if column == "seq" else "left")
    for at, seq, what, detail, mark in rows:
        table.add_row(iso(at), "-" if seq < 0 else str(seq), what, detail, mark)
    parts: list[RenderableType] = [table]
    if a.released_seq is None and a.version_id is not None:
        parts.append(Text("still bound at the end of the log", style="yellow"))
    for problem in report.mismatches:
        parts.append(Text(f"MISMATCH {problem}", style="bold red"))
    return Group(*parts)


def verify_view(result: VerifyResult) -> RenderableType:
    if result.ok:
        verdict = Text(
            f"OK {result.path}: {result.records} records, chain intact, every invariant holds "
            f"at every seq (head {result.head_hash[:16]}, {result.seconds:.2f}s)",
            style="green",
        )
        if not result.incidents:
            return verdict
        # Intact, but engines were quarantined or lost adapters: say which, and when.
        return Group(verdict, _health_view(result.incidents))
    where = f" at seq {result.first_bad_seq}" if result.first_bad_seq is not None else ""
    lines: list[RenderableType] = [
        Text(f"FAILED {result.path}{where} [{result.stage}]: {result.problem}", style="bold red")
    ]
    if result.incidents:
        lines.append(_health_view(result.incidents))
    if result.stage in ("chain", "invariants") and result.records:
        lines.append(
            Text(
                f"records 1..{(result.first_bad_seq or 1) - 1} are trustworthy "
                f"(chain verified {result.records} records)",
                style="dim",
            )
        )
    return Group(*lines)


def story_view(story: Story, run: DemoRun, *, fleet: str) -> RenderableType:
    """The demo's story: what the log says happened, then where to look next."""
    from tools.story import VersionStory

    def rel(at: float | None) -> str:
        return "-" if at is None else f"+{at:.1f}s"

    stats = run.stats
    head = Text.assemble(
        ("What happened", "bold"),
        f" (told from the log: {story.events} events over {story.duration_s:.1f}s; "
        f"{story.generations} generations in the provenance file"
        + (f" and {story.failed_requests} failed requests" if story.failed_requests else "")
        + f"; wall time {stats.wall_s:.0f}s "
        f"on {fleet})",
    )
    table = Table(title="versions", title_justify="left")
    for column in (
        "version",
        "published",
        "publish took",
        "retired",
        "reclaimed",
        "reclaim lag",
        "sessions",
        "generations",
        "state now",
    ):
        table.add_column(column, justify="left" if column in ("version", "state now") else "right")
    versions: list[VersionStory] = list(story.versions)
    for v in versions:
        table.add_row(
            f"v{v.version_id}",
            rel(v.published_at),
            span(v.publish_s),
            rel(v.retired_at),
            rel(v.reclaimed_at),
            span(v.reclaim_lag_s),
            str(v.sessions),
            str(v.generations),
            state_text(v.state),
        )
    lines: list[str | Text] = []  # plain text, never markup: names come from the log
    published = [v for v in versions if v.published_at is not None]
    lines.append(
        f"- The trainer published {len(published)} versions while sessions generated; "
        f"{story.sessions} sessions on {story.owners} rollout workers bound on their first "
        f"generation: "
        + ", ".join(f"{n} to v{vid}" for vid, n in story.sessions_per_version.items())
        + "."
    )
    if story.pinned:
        engines = ", ".join(f"{n} on {e}" for e, n in story.per_engine.items())
        lines.append(
            f"- Every one of the {story.generations} generations ({engines}) was served by its "
            f"session's bound version (provenance checked against the log: 0 mismatches); "
            f"{story.spanning} sessions kept their version after it was retired."
        )
    else:
        lines.append(
            Text(f"- {story.mismatches} generations ran on another version!", style="bold red")
        )
    if story.later_turns:

        def frac(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.2f}"

        lines.append(
            f"- Sticky routing: {story.later_on_first_engine} of {story.later_turns} later turns "
            "ran on their session's first engine; cached share of their prompts "
            f"{frac(story.cached_same)} there vs {frac(story.cached_moved)} on another engine."
        )
    idle = [e for e in story.fleet if not story.per_engine.get(e)]
    if idle and story.generations:
        lines.append(
            Text(
                f"- {', '.join(idle)} served no generation: every request routed "
                "there was refused (run with -v to see why).",
                style="bold yellow",
            )
        )
    for vid in story.skipped:
        lines.append(
            f"- v{vid} was SKIPPED: the capacity was full while older versions were still "
            "pinned by sessions; the trainer went on and a later step published."
        )
    for r in story.restarts:
        restored = ", ".join(f"v{v}" for v in r.restored) or "nothing"
        retried = sum(stats.retried.values())
        detail = ", ".join(f"{n} {code}" for code, n in sorted(stats.retried.items()))
        if r.repaired_at is not None:
            lines.append(
                f"- Engine {r.engine} restarted at {rel(r.at)} ({r.old[:8]} -> {r.new[:8]}): the "
                f"reconciler reloaded {restored} and made it routable again "
                f"{span(r.unroutable_s)} later; "
                + (
                    f"{retried} request(s) that hit it meanwhile were retried by the rollout "
                    f"({detail})."
                    if retried
                    else "no request was refused meanwhile."
                )
            )
        else:
            lines.append(
                Text(f"- Engine {r.engine} restarted and was never repaired.", style="bold red")
            )
    reclaimed = [v for v in versions if v.reclaimed_at is not None]
    if reclaimed:
        lags = [v.reclaim_lag_s for v in reclaimed if v.reclaim_lag_s is not None]
        lines.append(
            f"- Reclaim: {', '.join(f'v{v.version_id}' for v in reclaimed)} were unloaded from "
            f"every engine as soon as nothing used them"
            + (f" (within {span(max(lags))} of their last release)." if lags else ".")
        )
    where = [
        f"log:        {run.log}",
        f"provenance: {run.provenance}",
    ]
    if run.plot:
        where.append(f"plot:       {run.plot}")
    return Group(
        head,
        table,
        *[line if isinstance(line, Text) else Text(line) for line in lines],
        Text(""),
        *[Text(line) for line in where],
    )


def try_view(commands: Sequence[str]) -> RenderableType:
    return Group(
        Text("Try:", style="bold"), *[Text(f"  {command}", style="cyan") for command in commands]
    )
