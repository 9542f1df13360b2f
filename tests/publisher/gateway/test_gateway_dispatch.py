"""What the gateway tells its caller about each dispatch, on real local engines and a real ledger:
every failure names the request, the engine and the version (a trainer that gets
``AMBIGUOUS_DISPATCH`` must be able to find the sample the engine may still produce), in-flight
evidence covers an empty fleet and a worker's own tally, request ids are unique per gateway, and
the provenance row is the engine's generation, field for field.

Written from the gateway mutation campaign's survivors (``python -m tests.mutation.campaign
gateway``): each test holds what a surviving mutant changed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import msgspec
import pytest
import structlog.testing

from engines.contract import CleanRefusal, ErrorCode, Generation, SamplingParams
from engines.local.engine import LocalEngine
from evlog.errors import LoraLedgerError
from evlog.events import InFlight
from publisher.core.errors import Code, LedgerError
from publisher.core.outcomes import Bound
from publisher.drivers.fleet import Fleet
from publisher.gateway import Attempt, DispatchCode, Gateway, InFlightCounter, LocalView
from publisher.gateway import view as view_module
from publisher.gateway.affinity import rendezvous
from publisher.gateway.dispatch import DEFAULT_PARAMS
from publisher.gateway.provenance import Usage
from tests.publisher.rollout_kit import (
    ENGINE_WARNINGS,
    PROMPT,
    SHORT,
    EchoesAnother,
    LosesReply,
    Recording,
    Rig,
    Unreachable,
    rig,
)

pytestmark = [pytest.mark.anyio, *ENGINE_WARNINGS]


class Refuses(Recording):
    """Refuses every generation cleanly, before running it (nothing generated)."""

    async def generate(self, *args: Any, **kwargs: Any) -> Generation:
        raise CleanRefusal(ErrorCode.BAD_REQUEST, "prompt too long", engine_id=self.engine_id)


class Breaks(Recording):
    """Fails with an error no engine adapter raises (a bug under the call): it may have sent."""

    async def generate(self, *args: Any, **kwargs: Any) -> Generation:
        raise RuntimeError("socket closed mid-read")


class KeepsParams(Recording):
    """Records the sampling parameters each generation was asked with."""

    def __init__(self, inner: LocalEngine) -> None:
        super().__init__(inner)
        self.params: list[SamplingParams] = []

    async def generate(
        self, prompt: str | Sequence[int], lora_name: str | None, params: SamplingParams, **kw: Any
    ) -> Generation:
        self.params.append(params)
        return await super().generate(prompt, lora_name, params, **kw)


class NamesItsOwnId(Recording):
    """Answers with the engine's own id for the request (as an OpenAI server's ``cmpl-...``)."""

    async def generate(self, *args: Any, **kwargs: Any) -> Generation:
        real = await super().generate(*args, **kwargs)
        return msgspec.structs.replace(real, request_id="cmpl-engine-side")


class NamesNoId(Recording):
    """Answers without a request id."""

    async def generate(self, *args: Any, **kwargs: Any) -> Generation:
        real = await super().generate(*args, **kwargs)
        return msgspec.structs.replace(real, request_id=None)


def only(kind: type[Recording]) -> Callable[[LocalEngine], Any]:
    return kind


async def _bound(r: Rig) -> Bound:
    await r.ledger.register_owner("w", ttl_s=60.0)
    return await r.ledger.bind("s1", "w")


async def _refusal(r: Rig, bound: Bound, **kwargs: Any) -> LoraLedgerError:
    with pytest.raises(LoraLedgerError) as info:
        await r.gateway.generate(bound, PROMPT, SHORT, **kwargs)
    return info.value


async def test_no_route_names_the_version_and_the_engines_that_could_not_be_reached() -> None:
    async with rig(engines=1, wrap=only(Unreachable)) as r:
        await r.publish(1)
        bound = await _bound(r)
        error = await _refusal(r, bound)
        assert (error.code, error.message) == (
            DispatchCode.NO_ROUTE,
            f"no routable engine holds {bound.lora_name} (unreachable: e0)",
        )
        assert error.details == {
            "lora_name": bound.lora_name,
            "version_id": 1,
            "unreachable": ["e0"],
        }
    async with rig(engines=1) as r:
        await r.publish(1)
        bound = await _bound(r)
        nobody = msgspec.structs.replace(bound, lora_name="agent@dep-9-0000000000000000")
        error = await _refusal(r, nobody)
        assert error.message == "no routable engine holds agent@dep-9-0000000000000000"
        assert error.details["unreachable"] == []


async def test_a_clean_refusal_names_the_engine_its_code_and_the_request() -> None:
    async with rig(engines=1, wrap=only(Refuses)) as r:
        await r.publish(1)
        bound = await _bound(r)
        error = await _refusal(r, bound, request_id="req-7")
        assert (error.code, error.message) == (
            DispatchCode.GENERATION_FAILED,
            "engine e0 refused the generation cleanly: BAD_REQUEST: prompt too long",
        )
        assert error.details == {
            "engine": "e0",
            "engine_code": "BAD_REQUEST",
            "request_id": "req-7",
            "version_id": 1,
        }
        assert r.gateway.inflight_counts() == {}


@pytest.mark.parametrize(
    ("kind", "engine_code", "reason"),
    [
        (LosesReply, "TIMEOUT", "TIMEOUT: reply lost after the engine ran it"),
        (Breaks, "", "RuntimeError('socket closed mid-read')"),
    ],
)
async def test_an_ambiguous_dispatch_names_what_the_caller_needs_to_find_the_sample(
    kind: type[Recording], engine_code: str, reason: str
) -> None:
    async with rig(engines=1, wrap=only(kind)) as r:
        await r.publish(1)
        bound = await _bound(r)
        error = await _refusal(r, bound, request_id="req-9")
        assert (error.code, error.message) == (
            DispatchCode.AMBIGUOUS_DISPATCH,
            f"request req-9 was sent to e0 and its outcome is unknown ({reason}); "
            "it was not resent",
        )
        assert error.details == {
            "engine": "e0",
            "engine_code": engine_code,
            "request_id": "req-9",
            "version_id": 1,
            "session": "s1",
        }
        assert r.gateway.inflight_counts() == {}


async def test_evidence_of_an_empty_fleet_is_one_zero_for_every_engine() -> None:
    """A claim must record what it relied on even when no engine is left: a wildcard zero."""
    gateway = Gateway(Fleet(), view=None, gateway_id="g", clock=lambda: 42.5)  # type: ignore[arg-type]
    assert gateway.inflight_evidence(3) == [InFlight(reporter="g", engine="*", count=0, at=42.5)]


async def test_evidence_keeps_an_engine_the_version_was_sent_to_after_it_leaves_the_fleet() -> None:
    async with rig() as r:
        await r.publish(1)
        bound = await _bound(r)
        served = await r.gateway.generate(bound, PROMPT, SHORT)
        r.fleet.remove(served.engine)
        reported = {x.engine for x in r.gateway.inflight_evidence(1)}
        assert reported == {"e0", "e1"}
        assert {x.engine for x in r.gateway.inflight_evidence(2)} == set(r.fleet.ids())


class TallyOnly:
    """An owner (a rollout worker's part the gateway sees) whose lease never ends: only its
    tally, and when it is forwarded, are under test."""

    def __init__(self) -> None:
        self.inflight = InFlightCounter()
        self.counted: list[dict[tuple[str, int], int]] = []  # the tally at each report

    def ensure_live(self) -> None:
        pass

    def report(self) -> None:
        self.counted.append(self.inflight.counts())

    async def confirm_live(self) -> None:
        pass


async def test_a_workers_tally_counts_its_requests_and_returns_to_zero() -> None:
    async with rig() as r:
        await r.publish(1)
        bound = await _bound(r)
        owner = TallyOnly()
        served = await r.gateway.generate(bound, PROMPT, SHORT, owner=owner)
        assert not owner.inflight and owner.inflight.counts() == {}
        assert r.gateway.inflight(served.engine, 1) == 0
        assert r.gateway.dispatched == 1
        # reported once admitted, before the request left: the count a remote ledger gets
        assert owner.counted == [{(served.engine, 1): 1}]
        await r.gateway.generate(bound, PROMPT, SHORT, owner=owner)
        assert r.gateway.dispatched == 2


async def test_request_ids_are_unique_per_gateway_and_counted_from_one() -> None:
    async with rig(engines=1) as r:
        await r.publish(1)
        bound = await _bound(r)
        first = await r.gateway.generate(bound, PROMPT, SHORT)
        second = await r.gateway.generate(bound, PROMPT, SHORT)
        other = Gateway(r.fleet, r.gateway.view)
        third = await other.generate(bound, PROMPT, SHORT)
        ids = [s.provenance.request_id for s in (first, second, third)]
        assert re.fullmatch(r"gw-[0-9a-f]{12}-1", ids[0]), ids
        assert ids[1] == ids[0][:-1] + "2"
        assert re.fullmatch(r"gateway-[0-9a-f]{12}-1", ids[2]), ids
        assert ids[2][8:20] != ids[0][3:15]  # each gateway process draws its own prefix


async def test_a_generation_without_params_uses_the_defaults() -> None:
    async with rig(engines=1, wrap=only(KeepsParams)) as r:
        await r.publish(1)
        bound = await _bound(r)
        await r.gateway.generate(bound, PROMPT)
        engine = r.fleet["e0"]
        assert isinstance(engine, KeepsParams)
        assert engine.params == [DEFAULT_PARAMS]


async def test_the_provenance_row_is_the_generation_field_for_field() -> None:
    async with rig(engines=1) as r:
        await r.publish(1)
        bound = await _bound(r)
        r.clock.advance(3.0)
        served = await r.gateway.generate(bound, PROMPT, SHORT)
        g, row = served.generation, served.provenance
        assert (row.incarnation, row.prompt_tokens, row.cached_tokens, row.finish_reason) == (
            g.incarnation,
            g.prompt_tokens,
            g.cached_tokens,
            g.finish_reason,
        )
        assert g.prompt_tokens > 0 and g.finish_reason in ("stop", "length")
        assert (row.started_at, row.finished_at) == (r.clock(), r.clock())
        assert (row.head_revision, row.head_revision_done, row.gateway) == (1, 1, "gw")


@pytest.mark.parametrize(
    ("kind", "expected"), [(NamesItsOwnId, "cmpl-engine-side"), (NamesNoId, "r-5")]
)
async def test_the_row_keeps_the_engines_request_id_or_else_the_gateways(
    kind: type[Recording], expected: str
) -> None:
    async with rig(engines=1, wrap=only(kind)) as r:
        await r.publish(1)
        bound = await _bound(r)
        served = await r.gateway.generate(bound, PROMPT, SHORT, request_id="r-5")
        assert served.provenance.request_id == expected


async def test_the_unsticky_choice_is_the_least_loaded_holder_and_counts_while_it_runs() -> None:
    """``sticky=False`` (a session's turns are otherwise pinned to one engine by rendezvous
    hashing, load breaking ties only): a request admitted on one engine makes the other the
    choice, whatever the round-robin start, and the counts name the busy pair only."""
    async with rig() as r:
        await r.publish(1)
        bound = await _bound(r)
        tally = InFlightCounter()
        busy = r.gateway.admit(bound, tally=tally, sticky=False)
        assert busy is not None and tally.get(busy, 1) == 1
        idle = ({"e0", "e1"} - {busy}).pop()
        assert [r.gateway.choose(bound, sticky=False) for _ in range(2)] == [idle, idle]
        assert (r.gateway.inflight(busy, 1), r.gateway.inflight(idle, 1)) == (1, 0)
        r.gateway.finish(busy, 1, tally)
        assert not tally and r.gateway.inflight_counts() == {}


async def test_load_counts_each_request_in_flight_and_nothing_once_it_finished() -> None:
    """The load least-loaded routing reads: each admitted request adds one to its engine, each
    finished one takes it back. An engine that served and is idle again is the equal of one
    that never served (equals take turns), and of two busy engines the less busy is chosen
    until it is as busy as the other."""
    async with rig() as r:
        await r.publish(1)
        bound = await _bound(r)
        assert r.gateway.admit(bound, tried=["e1"]) == "e0"  # placed on e0: e1 excluded
        r.gateway.finish("e0", 1)
        turns = []
        for _ in range(2):
            engine = r.gateway.admit(bound, sticky=False)
            assert engine is not None
            turns.append(engine)
            r.gateway.finish(engine, 1)
        assert sorted(turns) == ["e0", "e1"]
        for _ in range(3):
            assert r.gateway.admit(bound, tried=["e1"]) == "e0"
        assert r.gateway.admit(bound, tried=["e0"]) == "e1"
        assert [r.gateway.admit(bound, sticky=False) for _ in range(2)] == ["e1", "e1"]
        assert (r.gateway.inflight("e0", 1), r.gateway.inflight("e1", 1)) == (3, 3)
        for engine in ("e0", "e1") * 3:
            r.gateway.finish(engine, 1)
        assert r.gateway.inflight_counts() == {}


async def test_extra_fields_for_an_engine_that_takes_none_name_the_engine_and_fields() -> None:
    async with rig(engines=1) as r:
        await r.publish(1)
        bound = await _bound(r)
        owner = TallyOnly()
        with pytest.raises(LoraLedgerError) as info:
            await r.gateway.generate(
                bound, PROMPT, SHORT, extra_body={"top_k": 5, "seed": 1}, owner=owner
            )
        assert info.value.message == "engine e0 takes no extra body fields (['seed', 'top_k'])"
        # refused before anything was sent: counted nowhere, the worker's tally included
        assert not owner.inflight and r.gateway.inflight_counts() == {}
        assert r.gateway.dispatched == 0


async def test_the_choice_is_sticky_by_default_and_never_an_engine_already_tried() -> None:
    async with rig() as r:
        await r.publish(1)
        bound = await _bound(r)
        sticky = rendezvous(bound.session, ("e0", "e1"))
        assert [r.gateway.choose(bound) for _ in range(3)] == [sticky] * 3  # no rotation
        tally = InFlightCounter()
        assert not tally
        assert r.gateway.admit(bound, tried=["e0"], tally=tally) == "e1"
        assert tally  # one request in flight
        # e0 is the less loaded, but this request's try on it already failed
        assert r.gateway.choose(bound, tried=["e0"], sticky=False) == "e1"
        assert r.gateway.choose(bound, tried=["e0", "e1"], sticky=False) is None
        r.gateway.finish("e1", 1, tally)
        assert not tally


async def test_a_turn_leaves_an_engine_over_the_load_bound_and_stays_where_it_went() -> None:
    """Bounded load: two turns in flight on e0 and none on e1 put a third on e0 over
    ceil(1.25 x the mean), so a session whose rendezvous engine is e0 goes to e1; once the
    load is gone it stays on e1, where its prefix cache now is. ``load_eps = inf`` is the old
    pure rendezvous."""
    async with rig() as r:
        r.gateway.load_floor = 0  # the bound alone (by default no engine under 16 is over it)
        await r.publish(1)
        await r.ledger.register_owner("w", ttl_s=60.0)
        homed = [f"s{i}" for i in range(100) if rendezvous(f"s{i}", ("e0", "e1")) == "e0"]
        busy = [await r.ledger.bind(s, "w") for s in homed[:2]]
        assert [r.gateway.admit(b) for b in busy] == ["e0"] * 2  # within the bound each time
        moved = await r.ledger.bind(homed[2], "w")
        assert r.gateway.admit(moved) == "e1"
        r.gateway.finish("e1", 1)
        for _ in busy:
            r.gateway.finish("e0", 1)
        assert r.gateway.choose(moved) == "e1"
        r.gateway.load_eps = math.inf
        assert r.gateway.choose(moved) == "e0"


@pytest.mark.parametrize(("kind", "logged"), [(EchoesAnother, True), (Recording, False)])
async def test_a_result_from_another_adapter_is_logged_as_an_error(
    kind: type[Recording], logged: bool
) -> None:
    async with rig(engines=1, wrap=only(kind)) as r:
        await r.publish(1)
        bound = await _bound(r)
        with structlog.testing.capture_logs() as logs:
            await r.gateway.generate(bound, PROMPT, SHORT)
        wrong = [x for x in logs if x["event"] == "gateway.served_other_adapter"]
        assert len(wrong) == int(logged)
        if logged:
            assert (wrong[0]["log_level"], wrong[0]["engine"], wrong[0]["bound"]) == (
                "error",
                "e0",
                bound.lora_name,
            )


# --- the executor's one refresh before NO_ROUTE ---------------------------------------------------


class LaggingView(LocalView):
    """The ledger as a remote process sees it: a copy that shows no holder until it is
    refreshed (a bind can name a version published after the copy was read). ``refreshes``
    counts the reads; ``fails`` makes every read fail (the ledger out of reach)."""

    def __init__(self, ledger: Any, *, catches_up: bool = True, fails: bool = False) -> None:
        super().__init__(ledger)
        self.catches_up = catches_up
        self.fails = fails
        self.fresh = False
        self.refreshes = 0

    def holders(self, lora_name: str) -> tuple[str, ...]:
        return super().holders(lora_name) if self.fresh else ()

    async def refresh(self) -> None:
        self.refreshes += 1
        if self.fails:
            raise ConnectionError("the ledger cannot be reached")
        self.fresh = self.catches_up


@pytest.mark.parametrize(
    ("catches_up", "fails", "served"),
    [(True, False, True), (False, False, False), (True, True, False)],
    ids=["the copy catches up", "the copy stays empty", "the ledger cannot be read"],
)
async def test_a_view_that_shows_no_holder_is_refreshed_once_before_no_route(
    catches_up: bool, fails: bool, served: bool
) -> None:
    """A remote view may not show a version's holders yet: before answering NO_ROUTE the
    executor reads it again, once. A copy that then shows them serves the turn; one that does
    not, or cannot be read (logged with the request's id), is NO_ROUTE after that one read."""
    async with rig() as r:
        await r.publish(1)
        bound = await _bound(r)
        view = LaggingView(r.ledger, catches_up=catches_up, fails=fails)
        gateway = Gateway(r.fleet, view, gateway_id="remote")
        with structlog.testing.capture_logs() as logs:
            if served:
                assert (await gateway.generate(bound, PROMPT, SHORT, request_id="r-7")).engine
            else:
                with pytest.raises(LoraLedgerError) as info:
                    await gateway.generate(bound, PROMPT, SHORT, request_id="r-7")
                assert info.value.code == DispatchCode.NO_ROUTE
        assert view.refreshes == 1
        failed = [e for e in logs if e["event"] == "gateway.refresh_failed"]
        assert [e["request_id"] for e in failed] == (["r-7"] if fails else [])


# --- the row of an attempt ------------------------------------------------------------------------


class ReportsALaterLife(Recording):
    """Answers as an engine that restarted after the ledger recorded its life: the generation
    names the process life that served it, which the ledger does not know yet."""

    async def generate(self, *args: Any, **kwargs: Any) -> Generation:
        real = await super().generate(*args, **kwargs)
        return msgspec.structs.replace(real, incarnation="a-later-life")


async def test_a_row_names_the_life_that_served_it_or_the_one_the_ledger_knows() -> None:
    """The engine's own word first (a generation carries its incarnation); an attempt whose
    reply says nothing of it (the OpenAI relay) takes the life the ledger records for that
    engine."""
    async with rig(engines=1, wrap=only(ReportsALaterLife)) as r:
        await r.publish(1)
        bound = await _bound(r)
        served = await r.gateway.generate(bound, PROMPT, SHORT)
        assert served.provenance.incarnation == "a-later-life"
        known = r.ledger.state.engines["e0"].incarnation
        assert known and known != "a-later-life"
        attempt = Attempt(
            engine_id="e0", request_id="r-1", cache_salt="s", head_revision=1, started_at=0.0
        )
        row = await r.gateway.record(bound, attempt, Usage(), turn=None, request_id="r-1")
        assert row.incarnation == known


async def test_a_row_keeps_the_engines_request_id_beside_the_callers_only_when_they_differ() -> (
    None
):
    """``request_id`` is the caller's key (a client's x-request-id); the id the engine saw is
    kept beside it (to join the engine's own logs) when it is another, and left out when not."""
    async with rig(engines=1) as r:
        await r.publish(1)
        bound = await _bound(r)
        attempt = Attempt(
            engine_id="e0",
            request_id="trace-9-abc",
            cache_salt="s",
            head_revision=1,
            started_at=0.0,
        )
        other = await r.gateway.record(bound, attempt, Usage(), turn=2, request_id="trace-9")
        same = await r.gateway.record(bound, attempt, Usage(), turn=2, request_id="trace-9-abc")
        assert (other.request_id, other.engine_request_id) == ("trace-9", "trace-9-abc")
        assert (same.request_id, same.engine_request_id) == ("trace-9-abc", None)
        assert (other.turn, other.engine, other.gateway) == (2, "e0", "gw")


class HostClosesUnderTheCall(Recording):
    """An engine call that fails with a ledger error after it may have run: a Ray engine
    actor's host (``PortalHost.call``) answers ``LEDGER_CLOSED`` when its context stops during
    the call. Only the sender's own refusal before sending (``NotSent``) passes as it is."""

    async def generate(self, *args: Any, **kwargs: Any) -> Generation:
        await super().generate(*args, **kwargs)  # it ran
        raise LedgerError(Code.LEDGER_CLOSED, "the actor's host stopped during the call")


async def test_a_ledger_error_from_an_engine_call_is_ambiguous_not_a_refusal() -> None:
    """``LEDGER_CLOSED`` is of the ``Unavailable`` family (retry at will): passed through, a
    generation that may have run would be resent by its caller. It is ``AMBIGUOUS_DISPATCH``,
    counted as sent, never tried on another holder."""
    async with rig(wrap=only(HostClosesUnderTheCall)) as r:
        await r.publish(1)
        bound = await _bound(r)
        error = await _refusal(r, bound)
        assert error.code == DispatchCode.AMBIGUOUS_DISPATCH
        assert r.gateway.dispatched == 1 and r.gateway.inflight_counts() == {}


async def test_a_faces_own_rule_is_checked_before_each_attempt_after_the_bound() -> None:
    """``check`` (the OpenAI face's pin of ``model``) sees the binding, before anything is
    counted or sent; its refusal is the answer as it is, and every attempt is checked again."""
    async with rig() as r:
        await r.publish(1)
        bound = await _bound(r)
        seen: list[Bound] = []

        def pin(checked: Bound) -> None:
            seen.append(checked)
            if len(seen) > 1:
                raise LedgerError(Code.INVALID_STATE, "the rule now refuses")

        async def refused_cleanly(attempt: Attempt) -> None:
            raise CleanRefusal(ErrorCode.NOT_LOADED, "restarted empty", engine_id=attempt.engine_id)

        with pytest.raises(LedgerError) as info:
            await r.gateway.dispatch(bound, refused_cleanly, check=pin)
        assert info.value.code == Code.INVALID_STATE
        assert seen == [bound, bound]  # before the first attempt, and before the retry
        assert r.gateway.dispatched == 1 and r.gateway.inflight_counts() == {}


async def test_a_refresh_that_hangs_is_given_up_and_the_answer_is_no_route(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A remote ledger that is restarting must not hold a turn for its transport's whole
    reconnect time: the refresh before NO_ROUTE is bounded (``REFRESH_S``), then NO_ROUTE, a
    retryable answer, is given."""
    monkeypatch.setattr(view_module, "REFRESH_S", 0.05)

    class Hangs(LaggingView):
        async def refresh(self) -> None:
            self.refreshes += 1
            await anyio.sleep_forever()

    async with rig() as r:
        await r.publish(1)
        bound = await _bound(r)
        gateway = Gateway(r.fleet, Hangs(r.ledger), gateway_id="remote")
        with anyio.fail_after(30), pytest.raises(LoraLedgerError) as info:
            await gateway.generate(bound, PROMPT, SHORT)
        assert info.value.code == DispatchCode.NO_ROUTE
