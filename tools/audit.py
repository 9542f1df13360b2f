"""``loraledger audit``: each session's version history, joined with its generations.

The log says which version a session was bound to; the provenance rows
(``publisher/gateway/provenance.py``) say which version each *generation* actually carried.
They are read from the store beside the log (``evlog/provenance_store.py``), where every face
sends its rows, whichever process served the turn -- or from a JSON-lines file when one is
named (``--provenance``). No store beside the log is said plainly (:attr:`Audited.note`),
never shown as a session without generations.

Joining them is the check a trainer's importance sampling rests on, so every generation
whose identity differs from its session's binding (version id, adapter name, digest, bound
revision) is reported as a mismatch, and so is a generation whose engine echoed
another adapter than the one it was sent (``served_name``), a generation of a session the
log never bound, and a generation that started after its session was released (closed, lease
expired, idle, owner restarted) and before it bound again: nothing held its version then, so
it may have been reclaimed under it, and the sample belongs to no binding a trainer can trust.
That last check compares the gateway's clock (``started_at``) with the ledger's
(``released_at``); on separate machines it is as exact as their clocks agree.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence

import msgspec

from evlog.errors import LoraLedgerError
from evlog.locations import describe
from evlog.provenance_store import provenance_location
from projections.audit import AuditFold, SessionAudit
from publisher.gateway.provenance import ProvenanceRow, decode_stored, read_rows
from tools.exitcodes import Exit, ToolError
from tools.logfile import open_log, open_provenance_beside

Progress = Callable[[int, int], None]
_EVERY = 4096


class AuditReport(msgspec.Struct, frozen=True, kw_only=True):
    audit: SessionAudit
    generations: tuple[ProvenanceRow, ...] = ()
    mismatches: tuple[str, ...] = ()


class Audited(msgspec.Struct, frozen=True, kw_only=True):
    """An audit: one report per session life, where its generations were read from (the
    store beside the log or the file named; None: nowhere), and why none could be read."""

    reports: list[AuditReport]
    provenance: str | None = None
    note: str | None = None


def load_provenance(path: str | os.PathLike[str]) -> list[ProvenanceRow]:
    if not os.path.exists(path):
        raise ToolError(Exit.MISSING, f"{path}: no such provenance file")
    try:
        return read_rows(path)
    except LoraLedgerError as exc:
        raise ToolError(Exit.CORRUPT, f"{path}: {exc.message}") from None
    except OSError as exc:
        raise ToolError(Exit.FAILED, f"{path}: cannot read: {exc}") from None


def join(audits: Sequence[SessionAudit], rows: Iterable[ProvenanceRow]) -> list[AuditReport]:
    """Attach each generation to the session life it ran in and check its identity. Pure.

    A row belongs to the life of its session that was bound when it started (the last one
    bound at or before ``started_at``); rows of sessions not audited are ignored."""
    lives: dict[str, list[int]] = {}
    for i, audit in enumerate(audits):
        lives.setdefault(audit.session, []).append(i)
    attached: list[list[ProvenanceRow]] = [[] for _ in audits]
    for row in rows:
        candidates = lives.get(row.session)
        if not candidates:
            continue
        chosen = candidates[0]
        for i in candidates:
            bound_at = audits[i].bound_at
            if bound_at is not None and bound_at <= row.started_at:
                chosen = i
        attached[chosen].append(row)
    reports: list[AuditReport] = []
    for audit, generations in zip(audits, attached, strict=True):
        generations.sort(key=lambda r: (-1 if r.turn is None else r.turn, r.started_at))
        reports.append(
            AuditReport(
                audit=audit,
                generations=tuple(generations),
                mismatches=tuple(m for row in generations for m in _mismatches(audit, row)),
            )
        )
    return reports


def _mismatches(audit: SessionAudit, row: ProvenanceRow) -> list[str]:
    who = f"request {row.request_id} (turn {row.turn})"
    if audit.version_id is None:
        return [f"{who} ran on v{row.version_id} but the log never bound {audit.session}"]
    out: list[str] = []
    expected = {
        "version": (audit.version_id, row.version_id),
        "adapter": (audit.lora_name, row.lora_name),
        "digest": (audit.digest, row.digest),
        "bound revision": (audit.revision, row.bound_revision),
    }
    for what, (bound, served) in expected.items():
        if bound != served:
            out.append(f"{who}: {what} {served} served, session bound to {bound}")
    if not row.attested:  # the engine itself said it applied another adapter
        out.append(f"{who}: the engine echoed adapter {row.served_name}, not {row.lora_name}")
    if audit.released_at is not None and row.started_at > audit.released_at:
        late = row.started_at - audit.released_at
        out.append(
            f"{who} started {late:.3f}s after {audit.session} was released "
            f"({audit.cause}, seq {audit.released_seq}): no binding held v{row.version_id}"
        )
    return out


async def audit_log(
    path: str | os.PathLike[str],
    *,
    sessions: Sequence[str] | None = None,
    owner: str | None = None,
    provenance: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
) -> Audited:
    """Audit ``sessions`` (ids), or every session of ``owner``, or (neither) every session,
    with their generations from the ``provenance`` file, or else from the store beside the
    log. The rows are read before the log: every binding a row names is already in it."""
    source: str | None = None
    note: str | None = None
    if provenance is not None:
        rows = load_provenance(provenance)
        source = os.fspath(provenance)
    else:
        rows, source = await _beside(path, sessions)
        if source is None:
            note = (
                f"no provenance store beside {describe(path)} (looked for "
                f"{provenance_location(path)}): generations are not shown; name a "
                "JSON-lines file with --provenance"
            )
    fold = AuditFold(sessions=sessions, owner=owner)
    async with open_log(path) as store:
        last = store.last_seq
        try:
            async for record in store.iterate():
                fold.apply(record)
                if progress is not None and record.seq % _EVERY == 0:
                    progress(record.seq, last)
        except LoraLedgerError as exc:
            raise ToolError.from_ledger(exc, path=str(path)) from None
    if progress is not None:
        progress(last, last)
    audits = fold.finish()
    reports = join([*audits, *_unknown_to_the_log(audits, rows, sessions, owner)], rows)
    return Audited(reports=reports, provenance=source, note=note)


async def _beside(
    path: str | os.PathLike[str], sessions: Sequence[str] | None
) -> tuple[list[ProvenanceRow], str | None]:
    """The rows of ``sessions`` (all when None) in the store beside the log at ``path``,
    and where it is; ``([], None)`` when there is no store there."""
    async with open_provenance_beside(path) as store:
        if store is None:
            return [], None
        try:
            bodies = await store.read(sessions)
            return decode_stored(bodies), store.location
        except LoraLedgerError as exc:
            raise ToolError.from_ledger(exc, path=store.location) from None


def _unknown_to_the_log(
    audits: Sequence[SessionAudit],
    rows: Sequence[ProvenanceRow],
    sessions: Sequence[str] | None,
    owner: str | None,
) -> list[SessionAudit]:
    """A life (owner ``""``, never bound) for each session asked about that has generations
    but no trace in the log, so its rows are reported (a session never bound) rather than
    dropped. Not when selecting by owner: a row names its gateway, not the session's owner."""
    if owner is not None:
        return []
    known = {a.session for a in audits}
    wanted = None if sessions is None else set(sessions)
    ghosts = dict.fromkeys(
        r.session
        for r in rows
        if r.session not in known and (wanted is None or r.session in wanted)
    )
    return [SessionAudit(session=session, owner="") for session in ghosts]
