"""The chaos run's checker: the promises, checked against what was observed.

It reads only the history (``tests/chaos/history.py``): the clients' operations, the engines'
own records, the faults and the raw log events. It never asks the projections or any code
under test what happened, so a bug in a fold cannot hide a bug in a decision. Each invariant
is one function returning its violations (empty: it held); :func:`check` runs them all.

What each one holds, and why it reads what it reads:

* **pinning** -- a served turn ran on its session's version: the answer's version header is
  the version the log bound the session to, and the engine that ran it (its own record, found
  by the request id) used that version's adapter name, on the engine the header names.
* **at most once** -- no client request started on an engine twice; and no turn was answered
  ``AMBIGUOUS_DISPATCH`` when it provably did not run (no engine started it while every engine
  stayed up through the turn: nothing could have lost its record).
* **safe reclaim** -- no unload of an adapter reached an engine, and none was freed, while a
  request of that engine's same process life was running on it. The ledger promises the
  first (it asks only when its in-flight evidence is zero): an engine that drains before it
  frees (SGLang) would hide a ledger that asks too early, one that does not (vLLM) would
  free the weights under the request.
* **durability** -- every acknowledged bind (a served turn), close and publication is in the
  log.
* **continuity** -- no session ended except by its client (``closed`` after a close it asked
  for), idle release, staleness or an operator; and no turn was refused ``SESSION_CLOSED`` on a
  session its client had not closed.
* **liveness** -- after the last fault healed, a publication committed and every live
  session's next turn was served, within ``bound`` seconds.
* **observability** -- every engine fault that took the engine away (SIGKILL, SIGTERM, a
  SIGSTOP or a partition of at least ``stop_visible_s``) shows in the log as a record of that
  engine (outage, restart, suspension, failures) within ``bound`` seconds (of serve being
  back, should a fault on serve have taken the log's writer away meanwhile). A shorter freeze or
  partition, or a fault of one link, may end before any probe or turn meets it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import msgspec

from tests.chaos.history import ClientOp, EngineRecord, History, client_request_of

LIVENESS_BOUND_S = 90.0  # generous: a loaded 2-core CI machine restarts processes slowly
OBSERVABILITY_BOUND_S = 30.0
# A freeze this long must be seen: twice serve's probe timeout (10 s), as a probe gives up
# 10 s after it began and, on a loaded machine, the next probe may begin seconds late.
FREEZE_SEEN_S = 20.0
# Faults that end the process (it must be restarted): always visible in the log.
TAKES_THE_PROCESS_AWAY = ("kill", "term", "restart")
CLIENT_CAUSES = ("closed",)
LEDGER_CAUSES = ("idle", "too_stale", "operator")
ENGINE_EVENTS = (
    "EngineUnreachable",
    "EngineRestarted",
    "EngineSuspended",
    "DispatchFailures",
    "EngineRepaired",
)


class Violation(msgspec.Struct, frozen=True):
    invariant: str
    detail: str


def _bound_versions(h: History) -> dict[str, int]:
    return {e.fields["session"]: e.fields["version_id"] for e in h.of_type("SessionBound")}


def _names(h: History) -> dict[int, str]:
    return {e.fields["version_id"]: e.fields["lora_name"] for e in h.of_type("VersionAllocated")}


def _starts_by_request(h: History) -> dict[str, list[EngineRecord]]:
    starts: dict[str, list[EngineRecord]] = defaultdict(list)
    for r in h.engine:
        if r.kind == "start" and r.request_id:
            starts[client_request_of(r.request_id)].append(r)
    return starts


def _turns(h: History, outcome: str) -> list[ClientOp]:
    return [op for op in h.ops if op.kind == "turn" and op.outcome == outcome]


def pinning(h: History) -> list[Violation]:
    bound, names, starts = _bound_versions(h), _names(h), _starts_by_request(h)
    out: list[Violation] = []
    for op in _turns(h, "ok"):
        where = f"{op.request_id} (session {op.session})"
        if op.session in bound and op.version != bound[op.session]:
            out.append(
                Violation("pinning", f"{where} answered v{op.version}, bound v{bound[op.session]}")
            )
        ran = starts.get(op.request_id, [])
        if not ran:
            out.append(Violation("pinning", f"{where} was answered but no engine ran it"))
        expected = names.get(op.version) if op.version is not None else None
        for r in ran:
            if r.lora_name != expected or r.engine != op.engine:
                out.append(
                    Violation(
                        "pinning",
                        f"{where}: header v{op.version} on {op.engine}, engine {r.engine} ran "
                        f"{r.lora_name!r} (v{op.version} is {expected!r})",
                    )
                )
    return out


def is_engine(target: str) -> bool:
    """Engines are named ``e0``, ``e1``...; gateways ``gw-*``, the ledger ``serve``."""
    return target[:1] == "e" and target[1:].isdigit()


def touches_an_engine(target: str) -> bool:
    """A fault's target is an engine, or a link to one (``serve->e0``, which carries the
    gateways' generations too; ``serve->agent``, ``e2``'s control path)."""
    ends = target.split("->")
    return any(is_engine(end) or end == "agent" for end in ends)


def _engines_faulted(h: History, start: float, end: float) -> bool:
    return any(touches_an_engine(f.target) and f.at <= end and f.healed >= start for f in h.faults)


def at_most_once(h: History) -> list[Violation]:
    out = [
        Violation("at_most_once", f"{rid} started {len(rs)} times: {[r.engine for r in rs]}")
        for rid, rs in _starts_by_request(h).items()
        if len(rs) > 1
    ]
    starts = _starts_by_request(h)
    for op in _turns(h, "fail"):
        if "AMBIGUOUS" not in op.code or op.request_id in starts:
            continue
        if not _engines_faulted(h, op.invoked, op.completed):
            out.append(
                Violation(
                    "at_most_once",
                    f"{op.request_id} answered ambiguous, but no engine ran it and none failed",
                )
            )
    return out


def safe_reclaim(h: History) -> list[Violation]:
    running: dict[tuple[str, int, str], list[tuple[float, float]]] = defaultdict(list)
    begun: dict[tuple[str, int, str, str], float] = {}
    for r in sorted(h.engine, key=lambda r: r.at):
        if r.lora_name is None:
            continue
        key = (r.engine, r.life, r.lora_name)
        if r.kind == "start":
            begun[(*key, r.request_id)] = r.at
        elif r.kind == "end" and (*key, r.request_id) in begun:
            running[key].append((begun.pop((*key, r.request_id)), r.at))
    for (engine, life, name, _rid), at in begun.items():  # never ended in that life
        running[(engine, life, name)].append((at, float("inf")))
    out: list[Violation] = []
    for r in h.engine:
        if r.kind not in ("unloading", "unload") or r.lora_name is None:
            continue
        what = "asked to unload" if r.kind == "unloading" else "freed"
        for start, end in running[(r.engine, r.life, r.lora_name)]:
            if start < r.at < end:
                out.append(
                    Violation(
                        "safe_reclaim",
                        f"{r.lora_name} {what} on {r.engine} at {r.at:.3f} while a request "
                        f"ran on it ({start:.3f} to {end:.3f})",
                    )
                )
    return out


def durability(h: History) -> list[Violation]:
    bound = {(e.fields["session"], e.fields["version_id"]) for e in h.of_type("SessionBound")}
    released = {e.fields["session"] for e in h.of_type("SessionReleased")}
    published = {e.fields["version_id"] for e in h.of_type("VersionPublished")}
    out: list[Violation] = []
    for op in h.ops:
        if op.outcome != "ok":
            continue
        if op.kind == "turn" and (op.session, op.version) not in bound:
            out.append(Violation("durability", f"{op.session} served v{op.version}, no such bind"))
        elif op.kind == "close" and op.session not in released:
            out.append(Violation("durability", f"{op.session} closed, no release in the log"))
        elif op.kind == "publish" and op.version not in published:
            out.append(Violation("durability", f"v{op.version} published, not in the log"))
    return out


def continuity(h: History) -> list[Violation]:
    closes = {op.session: op.invoked for op in h.ops if op.kind == "close"}
    out: list[Violation] = []
    for e in h.of_type("SessionReleased"):
        session, cause = e.fields["session"], e.fields.get("cause", "closed")
        if cause in LEDGER_CAUSES:
            continue
        if cause in CLIENT_CAUSES and session in closes:
            continue
        out.append(Violation("continuity", f"{session} released ({cause}), its client did not"))
    for op in _turns(h, "fail"):
        if "SESSION_CLOSED" in op.code and op.session not in closes:
            out.append(Violation("continuity", f"{op.request_id}: {op.session} refused as closed"))
    return out


def liveness(h: History, bound: float = LIVENESS_BOUND_S) -> list[Violation]:
    end = h.heal + bound
    out: list[Violation] = []
    if not any(h.heal <= e.at <= end for e in h.of_type("VersionPublished")):
        out.append(Violation("liveness", f"no publication committed within {bound:g} s of heal"))
    closed = {op.session for op in h.ops if op.kind == "close"}
    sessions = {op.session for op in h.ops if op.kind == "turn"} - closed
    released = {e.fields["session"] for e in h.of_type("SessionReleased")}
    for session in sorted(sessions - released):
        if not any(
            op.session == session and op.invoked >= h.heal and op.completed <= end
            for op in _turns(h, "ok")
        ):
            out.append(
                Violation("liveness", f"{session}: no turn served within {bound:g} s of heal")
            )
    return out


def _serve_back(h: History, at: float, bound: float) -> float:
    """When ``serve``, the log's one writer, could record again what happened at ``at``: ``at``
    itself, or the heal of a fault on serve (its process, or its partition) that began
    before the bound ran out and lasted past ``at``."""
    return max(
        [
            at,
            *(
                f.healed
                for f in h.faults
                if f.target == "serve" and f.at <= at + bound and f.healed >= at
            ),
        ]
    )


def observability(
    h: History, bound: float = OBSERVABILITY_BOUND_S, stop_visible_s: float = FREEZE_SEEN_S
) -> list[Violation]:
    out: list[Violation] = []
    for f in h.faults:
        if not is_engine(f.target):
            continue  # a link's fault, or a gateway's or serve's
        brief = f.kind not in TAKES_THE_PROCESS_AWAY and f.healed - f.at < stop_visible_s
        if brief:  # a freeze or a partition shorter than serve's probes need to see it
            continue
        until = _serve_back(h, f.at, bound) + bound
        seen = any(
            e.fields.get("engine") == f.target and f.at <= e.at <= until
            for e in h.of_type(*ENGINE_EVENTS)
        )
        if not seen:
            out.append(
                Violation(
                    "observability",
                    f"{f.kind} of {f.target} at {f.at:.3f}: nothing in the log within {bound:g} s",
                )
            )
    return out


INVARIANTS: dict[str, Callable[[History], list[Violation]]] = {
    "pinning": pinning,
    "at_most_once": at_most_once,
    "safe_reclaim": safe_reclaim,
    "durability": durability,
    "continuity": continuity,
    "liveness": liveness,
    "observability": observability,
}


def check(h: History) -> dict[str, list[Violation]]:
    """Every invariant's violations, by name (each list empty when the run kept its promises)."""
    return {name: invariant(h) for name, invariant in INVARIANTS.items()}
