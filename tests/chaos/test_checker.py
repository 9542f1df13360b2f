"""The chaos checker on small hand-made histories: a clean one passes every invariant, and
each invariant fails on a history that breaks it (a checker that cannot fail proves nothing)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from tests.chaos import checker
from tests.chaos.history import ClientOp, EngineRecord, Fault, History, LogEntry

RID = "c0-1"
ENGINE_RID = f"{RID}-0123456789ab"


def _log(*events: tuple[str, dict[str, Any], float]) -> tuple[LogEntry, ...]:
    return tuple(LogEntry(seq=i, at=at, type=t, fields=f) for i, (t, f, at) in enumerate(events))


LOG = _log(
    ("VersionAllocated", {"version_id": 1, "lora_name": "policy-1", "digest": "d"}, 1.0),
    ("VersionPublished", {"version_id": 1, "attempt": 1, "revision": 1}, 2.0),
    ("SessionBound", {"session": "s0", "owner": "gw-a", "version_id": 1, "revision": 1}, 3.0),
    ("VersionPublished", {"version_id": 2, "attempt": 1, "revision": 2}, 12.0),
)
TURN = ClientOp(
    client="c0",
    kind="turn",
    invoked=3.0,
    completed=4.0,
    outcome="ok",
    session="s0",
    request_id=RID,
    version=1,
    engine="e0",
)
LATE_TURN = msgspec.structs.replace(TURN, request_id="c0-2", invoked=11.0, completed=11.5)
ENGINE = (
    EngineRecord(engine="e0", life=7, kind="load", at=1.5, lora_name="policy-1", attempt=1),
    EngineRecord(
        engine="e0", life=7, kind="start", at=3.2, lora_name="policy-1", request_id=ENGINE_RID
    ),
    EngineRecord(
        engine="e0", life=7, kind="end", at=3.8, lora_name="policy-1", request_id=ENGINE_RID
    ),
    EngineRecord(
        engine="e0",
        life=7,
        kind="start",
        at=11.1,
        lora_name="policy-1",
        request_id="c0-2-0123456789ab",
    ),
    EngineRecord(
        engine="e0",
        life=7,
        kind="end",
        at=11.2,
        lora_name="policy-1",
        request_id="c0-2-0123456789ab",
    ),
)
CLEAN = History(ops=(TURN, LATE_TURN), engine=ENGINE, log=LOG, heal=10.0)


def _only(h: History, invariant: str) -> list[checker.Violation]:
    found = checker.check(h)
    others = {k: v for k, v in found.items() if k != invariant and v}
    assert not others, others
    assert found[invariant], f"{invariant} did not see the violation"
    return found[invariant]


def test_a_clean_history_keeps_every_promise() -> None:
    assert all(not v for v in checker.check(CLEAN).values()), checker.check(CLEAN)


def test_pinning_sees_a_turn_served_on_another_version_than_the_engine_ran() -> None:
    wrong = EngineRecord(
        engine="e0", life=7, kind="start", at=3.2, lora_name=None, request_id=ENGINE_RID
    )
    h = msgspec.structs.replace(CLEAN, engine=(ENGINE[0], wrong, *ENGINE[2:]))
    assert "ran None" in _only(h, "pinning")[0].detail


def test_pinning_sees_a_header_that_is_not_the_bound_version() -> None:
    h = msgspec.structs.replace(CLEAN, ops=(msgspec.structs.replace(TURN, version=2), LATE_TURN))
    found = checker.pinning(h)
    assert any("bound v1" in v.detail for v in found), found


def test_at_most_once_sees_a_request_started_twice() -> None:
    again = msgspec.structs.replace(ENGINE[1], engine="e1", request_id=f"{RID}-ba9876543210")
    h = msgspec.structs.replace(CLEAN, engine=(*ENGINE, again))
    found = checker.at_most_once(h)
    assert found and "started 2 times" in found[0].detail


def test_at_most_once_sees_an_ambiguous_answer_for_a_turn_that_never_ran() -> None:
    lost = msgspec.structs.replace(
        TURN, outcome="fail", request_id="c0-9", invoked=5.0, completed=6.0, code="AMBIGUOUS"
    )
    h = msgspec.structs.replace(CLEAN, ops=(*CLEAN.ops, lost))
    assert _only(h, "at_most_once")
    faulted = msgspec.structs.replace(
        h, faults=(Fault(target="e0", kind="kill", at=5.5, healed=7.0),)
    )
    assert not checker.at_most_once(faulted)  # the engine died: its record may be lost


@pytest.mark.parametrize("kind", ["unload", "unloading"], ids=["freed", "asked"])
def test_safe_reclaim_sees_an_adapter_unloaded_under_a_running_request(kind: str) -> None:
    unload = EngineRecord(engine="e0", life=7, kind=kind, at=3.5, lora_name="policy-1")  # type: ignore[arg-type]
    h = msgspec.structs.replace(CLEAN, engine=(*ENGINE, unload))
    assert _only(h, "safe_reclaim")
    later_life = msgspec.structs.replace(unload, life=8)
    assert not checker.safe_reclaim(msgspec.structs.replace(CLEAN, engine=(*ENGINE, later_life)))


@pytest.mark.parametrize(
    "op",
    [
        msgspec.structs.replace(TURN, session="s-unbound", request_id="c0-1"),
        ClientOp(client="c0", kind="close", invoked=5, completed=6, outcome="ok", session="s0"),
        ClientOp(client="trainer", kind="publish", invoked=5, completed=6, outcome="ok", version=3),
    ],
    ids=["bind", "close", "publication"],
)
def test_durability_sees_an_acknowledged_write_missing_from_the_log(op: ClientOp) -> None:
    h = msgspec.structs.replace(CLEAN, ops=(*CLEAN.ops, op))
    assert checker.durability(h)


def test_continuity_sees_a_session_released_that_its_client_kept() -> None:
    released = (
        "SessionReleased",
        {"session": "s0", "owner": "gw-a", "version_id": 1, "cause": "owner_restarted"},
        9.0,
    )
    h = msgspec.structs.replace(CLEAN, log=(*LOG, *_log(released)))
    assert any("owner_restarted" in v.detail for v in checker.continuity(h))
    refused = msgspec.structs.replace(LATE_TURN, outcome="fail", code="SESSION_CLOSED")
    h = msgspec.structs.replace(CLEAN, ops=(TURN, LATE_TURN, refused))
    assert _only(h, "continuity")


def test_liveness_sees_no_publication_and_no_turn_after_the_heal() -> None:
    h = msgspec.structs.replace(CLEAN, heal=20.0)
    found = checker.liveness(h, bound=5.0)
    assert {v.detail.split(" ")[0] for v in found} == {"no", "s0:"}, found


def test_observability_sees_an_engine_kill_the_log_never_told() -> None:
    killed = Fault(target="e0", kind="kill", at=4.0, healed=5.0)
    h = msgspec.structs.replace(CLEAN, faults=(killed,))
    assert _only(h, "observability")
    told = _log(("EngineUnreachable", {"engine": "e0", "at": 4.1}, 4.2))
    assert not checker.observability(msgspec.structs.replace(h, log=(*LOG, *told)))
    short_stop = Fault(target="e0", kind="stop", at=4.0, healed=5.0)
    assert not checker.observability(msgspec.structs.replace(CLEAN, faults=(short_stop,)))


def test_observability_waits_for_serve_to_be_back_when_a_fault_took_it_away() -> None:
    """The log has one writer: an engine killed just before ``serve`` went down for longer
    than the bound can only show once serve is back, and then within the bound."""
    killed = Fault(target="e0", kind="kill", at=4.0, healed=5.0)
    serve_down = Fault(target="serve", kind="term", at=6.0, healed=50.0)
    told_late = _log(("EngineUnreachable", {"engine": "e0", "at": 55.0}, 55.0))
    h = msgspec.structs.replace(CLEAN, faults=(killed, serve_down), log=(*LOG, *told_late))
    assert not checker.observability(h)
    never_told = msgspec.structs.replace(h, log=LOG)
    assert checker.observability(never_told)
    serve_only_briefly_down = Fault(target="serve", kind="term", at=6.0, healed=8.0)
    h = msgspec.structs.replace(h, faults=(killed, serve_only_briefly_down))
    assert checker.observability(h), "told 51 s after the kill, serve back 47 s before"
