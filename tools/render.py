"""Rich renderables for every result the CLI prints: a pure function of the result each.

Kept apart from the commands so the same view serves every source of the same data: the
ledger status looks the same whether it was replayed from a file (``replay``) or fetched from
a running service (``status``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from projections.history import Entry
from projections.incidents import Incident
from publisher.ledger import LedgerStatus
from tools.audit import AuditReport
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
    lines = [
        f"deployment {status.deployment or '(not created)'}  epoch {status.epoch}  "
        f"seq {status.last_seq}" + (f"  recorded {iso(at)}" if at is not None else ""),
        f"default {default} (revision {status.default_revision})  "
        f"capacity {status.capacity_used}/{status.capacity}  "
        f"sessions bound {status.sessions_bound}  tombstones {status.tombstones}  "
        f"live owners {status.owners}",
    ]
    if status.blocked_by:
        lines.append(
            f"[bold red]publication blocked by unresolved versions "
            f"{', '.join(f'v{v}' for v in status.blocked_by)}[/]"
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
    for e in status.engines:
        engines.add_row(
            e.engine,
            e.kind,
            e.incarnation,
            Text("yes", style="green") if e.routable else Text("no", style="bold red"),
            str(len(e.holds)),
            ", ".join(e.strays) or "-",
            e.endpoint or "-",
        )
    return Group(
        Text(title, style="bold"), *[Text.from_markup(line) for line in lines], versions, engines
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


def incidents_view(found: Sequence[Incident]) -> RenderableType:
    if not found:
        return Text("no incidents", style="green")
    table = Table(title=f"{len(found)} incidents", title_justify="left")
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
    if a.version_id is None:
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
        detail = (
            f"turn {g.turn} on {g.engine} v{g.version_id}: {g.prompt_tokens}+"
            f"{g.completion_tokens} tokens, {g.finish_reason}, lag {g.staleness} "
            f"(req {g.request_id})"
        )
        rows.append((g.started_at, -1, "generation", detail, Text("")))
    if a.released_seq is not None and a.released_at is not None:
        cause = a.cause or ""
        if a.lease_expired_seq is not None:
            cause += f" (owner lease expired at seq {a.lease_expired_seq})"
        rows.append((a.released_at, a.released_seq, "RELEASED", cause, Text("")))
    if a.forgotten_seq is not None:
        rows.append(
            (a.released_at or 0.0, a.forgotten_seq, "forgotten", "tombstone dropped", Text(""))
        )
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
        return Text(
            f"OK {result.path}: {result.records} records, chain intact, every invariant holds "
            f"at every seq (head {result.head_hash[:16]}, {result.seconds:.2f}s)",
            style="green",
        )
    where = f" at seq {result.first_bad_seq}" if result.first_bad_seq is not None else ""
    lines = [
        Text(f"FAILED {result.path}{where} [{result.stage}]: {result.problem}", style="bold red")
    ]
    if result.stage in ("chain", "invariants") and result.records:
        lines.append(
            Text(
                f"records 1..{(result.first_bad_seq or 1) - 1} are trustworthy "
                f"(chain verified {result.records} records)",
                style="dim",
            )
        )
    return Group(*lines)


def kv_view(title: str, data: dict[str, Any]) -> RenderableType:
    table = Table(title=title, title_justify="left", show_header=False)
    table.add_column("key")
    table.add_column("value")
    for key, value in data.items():
        table.add_row(key, str(value))
    return table
