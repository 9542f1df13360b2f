"""Trying another holder: a generation that provably did not run -- never sent, or
refused cleanly by an engine that does not hold the name (a restarted, empty engine routing
has not caught up with) -- goes to another routable holder of the same version, once per
holder; anything that may have run never does. On real local engines and a real ledger; the
restarted engine is a double (:class:`RestartedEmpty`) answering what a fresh local engine
answers for a name it never loaded."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from engines.contract import AmbiguousReply, CleanRefusal, EngineError, ErrorCode, Generation
from engines.local.engine import LocalEngine
from evlog.errors import LoraLedgerError
from publisher.core.outcomes import Bound
from publisher.drivers.engine_ops import lacks_adapter, says_about_engine
from publisher.gateway import DispatchCode, Gateway, try_elsewhere
from publisher.gateway.affinity import rendezvous
from tests.publisher.rollout_kit import (
    ENGINE_WARNINGS,
    PROMPT,
    SHORT,
    LosesReply,
    Recording,
    Rig,
    Unreachable,
    rig,
)

pytestmark = [pytest.mark.anyio, *ENGINE_WARNINGS]


class RestartedEmpty(Recording):
    """An engine that restarted behind routing's back: the fresh process holds nothing and
    refuses the name before running anything (the local engine's ``NOT_LOADED``)."""

    async def generate(
        self, prompt: Any, lora_name: str | None, *args: Any, **kw: Any
    ) -> Generation:
        self.calls.append({"lora_name": lora_name, "request_id": kw.get("request_id")})
        raise CleanRefusal(
            ErrorCode.NOT_LOADED,
            f"LoRA adapter {lora_name} is not loaded",
            engine_id=self.engine_id,
        )


def on(engine_id: str, kind: type[Recording]) -> Callable[[LocalEngine], Any]:
    """Wrap only ``engine_id`` in ``kind``; every other engine is recorded as is."""
    return lambda engine: kind(engine) if engine.engine_id == engine_id else Recording(engine)


def session_going_to(engine_id: str, holders: tuple[str, ...] = ("e0", "e1")) -> str:
    """A session id whose first choice (rendezvous, no load) is ``engine_id``."""
    return next(s for s in (f"s{i}" for i in range(1000)) if rendezvous(s, holders) == engine_id)


async def _bound(r: Rig, session: str) -> Bound:
    await r.ledger.register_owner("w", ttl_s=60.0)
    return await r.ledger.bind(session, "w")


def calls(r: Rig, engine_id: str) -> int:
    engine = r.fleet[engine_id]
    assert isinstance(engine, Recording)
    return len(engine.calls)


@pytest.mark.parametrize(
    ("error", "elsewhere"),
    [
        (AmbiguousReply(ErrorCode.ENGINE_UNREACHABLE, "refused", dispatched=False), True),
        (AmbiguousReply(ErrorCode.ENGINE_GONE, "known dead", dispatched=False), True),
        (CleanRefusal(ErrorCode.NOT_LOADED, "not loaded"), True),
        (AmbiguousReply(ErrorCode.ENGINE_GONE, "died during the call"), False),
        (AmbiguousReply(ErrorCode.CONNECTION_LOST, "actor restarting"), False),
        (AmbiguousReply(ErrorCode.TIMEOUT, "no reply"), False),
        (CleanRefusal(ErrorCode.NAME_RECLAIMED, "reclaimed"), False),
        (CleanRefusal(ErrorCode.BAD_REQUEST, "bad prompt"), False),
    ],
)
def test_only_what_provably_did_not_run_goes_elsewhere(error: EngineError, elsewhere: bool) -> None:
    assert try_elsewhere(error) is elsewhere


@pytest.mark.parametrize(
    ("error", "about_engine", "missing"),
    [
        (CleanRefusal(ErrorCode.NOT_LOADED, "not loaded"), True, True),
        (CleanRefusal(ErrorCode.NAME_RECLAIMED, "reclaimed"), True, True),
        (AmbiguousReply(ErrorCode.ENGINE_UNREACHABLE, "refused", dispatched=False), True, False),
        (AmbiguousReply(ErrorCode.ENGINE_GONE, "dead"), True, False),
        (AmbiguousReply(ErrorCode.TIMEOUT, "no reply"), True, False),
        (AmbiguousReply(ErrorCode.SERVER_ERROR, "503"), True, False),
        (CleanRefusal(ErrorCode.BAD_REQUEST, "bad prompt"), False, False),
        (CleanRefusal(ErrorCode.INVALID_NAME, "bad name"), False, False),
    ],
)
def test_failures_about_the_engine_are_told_apart_from_bad_requests(
    error: EngineError, about_engine: bool, missing: bool
) -> None:
    """What the gateway reports through ``on_engine_trouble`` (about the engine), and which of
    those its receiver answers with an inventory read rather than a probe (a missing adapter)."""
    assert says_about_engine(error) is about_engine
    assert lacks_adapter(error) is missing


async def test_a_clean_not_loaded_is_served_by_the_other_holder() -> None:
    async with rig(wrap=on("e0", RestartedEmpty)) as r:
        heard: list[tuple[str, str]] = []
        r.gateway.on_engine_trouble = lambda engine, exc, **_: heard.append((engine, exc.code))
        await r.publish(1)
        bound = await _bound(r, session_going_to("e0"))
        served = await r.gateway.generate(bound, PROMPT, SHORT, request_id="req-1")
        assert served.engine == "e1"
        assert served.version_id == 1
        assert (calls(r, "e0"), calls(r, "e1")) == (1, 1)  # once per holder, nothing resent
        e0, e1 = r.fleet["e0"], r.fleet["e1"]
        assert isinstance(e0, Recording) and isinstance(e1, Recording)
        assert e0.calls[0]["request_id"] == e1.calls[0]["request_id"]  # the same request
        assert heard == [("e0", ErrorCode.NOT_LOADED)]
        assert r.gateway.inflight_counts() == {}


async def test_the_hook_given_at_construction_hears_an_unreachable_engine() -> None:
    """How deployments wire it (serve, demo, Ray): the constructor's ``on_engine_trouble``."""
    async with rig(wrap=on("e0", Unreachable)) as r:
        heard: list[tuple[str, str]] = []
        gateway = Gateway(
            r.fleet,
            r.gateway.view,
            on_engine_trouble=lambda engine, exc, **_: heard.append((engine, exc.code)),
        )
        await r.publish(1)
        bound = await _bound(r, session_going_to("e0"))
        served = await gateway.generate(bound, PROMPT, SHORT, request_id="req-3")
        assert served.engine == "e1"
        assert heard == [("e0", ErrorCode.ENGINE_UNREACHABLE)]


async def test_when_every_holder_refuses_the_last_refusal_is_the_answer() -> None:
    async with rig(wrap=lambda e: RestartedEmpty(e)) as r:
        heard: list[tuple[str, str]] = []
        r.gateway.on_engine_trouble = lambda engine, exc, **_: heard.append((engine, exc.code))
        await r.publish(1)
        bound = await _bound(r, session_going_to("e0"))
        with pytest.raises(LoraLedgerError) as info:
            await r.gateway.generate(bound, PROMPT, SHORT, request_id="req-2")
        assert info.value.code == DispatchCode.GENERATION_FAILED
        assert info.value.details == {
            "engine": "e1",
            "engine_code": ErrorCode.NOT_LOADED,
            "request_id": "req-2",
            "version_id": 1,
        }
        assert info.value.message.startswith("engine e1 refused the generation cleanly: ")
        cause = info.value.__cause__
        assert isinstance(cause, CleanRefusal) and cause.engine_id == "e1"
        assert heard == [("e0", ErrorCode.NOT_LOADED), ("e1", ErrorCode.NOT_LOADED)]
        assert (calls(r, "e0"), calls(r, "e1")) == (1, 1)
        assert r.gateway.inflight_counts() == {}


async def test_a_single_holder_that_refuses_answers_as_before() -> None:
    async with rig(engines=1, wrap=lambda e: RestartedEmpty(e)) as r:
        await r.publish(1)
        bound = await _bound(r, "s1")
        with pytest.raises(LoraLedgerError) as info:
            await r.gateway.generate(bound, PROMPT, SHORT)
        assert info.value.code == DispatchCode.GENERATION_FAILED
        assert info.value.details["engine_code"] == ErrorCode.NOT_LOADED


async def test_an_ambiguous_dispatch_is_never_tried_on_the_other_holder() -> None:
    async with rig(wrap=on("e0", LosesReply)) as r:
        await r.publish(1)
        bound = await _bound(r, session_going_to("e0"))
        with pytest.raises(LoraLedgerError) as info:
            await r.gateway.generate(bound, PROMPT, SHORT)
        assert info.value.code == DispatchCode.AMBIGUOUS_DISPATCH
        assert (calls(r, "e0"), calls(r, "e1")) == (1, 0)


async def test_an_unsent_request_then_a_refusal_then_a_holder_that_serves() -> None:
    """Three holders: unreachable, refusing, serving -- each tried once, in routing order."""
    wraps = {"e0": Unreachable, "e1": RestartedEmpty}

    def wrap(engine: LocalEngine) -> Any:
        return wraps.get(engine.engine_id, Recording)(engine)

    async with rig(engines=3, wrap=wrap) as r:
        await r.publish(1)
        holders = ("e0", "e1", "e2")
        session = next(
            s
            for s in (f"s{i}" for i in range(1000))
            if rendezvous(s, holders) == "e0" and rendezvous(s, holders, exclude=("e0",)) == "e1"
        )
        bound = await _bound(r, session)
        served = await r.gateway.generate(bound, PROMPT, SHORT)
        assert served.engine == "e2"
        assert (calls(r, "e1"), calls(r, "e2")) == (1, 1)
        assert r.gateway.dispatched == 3  # e0 refused the connection: counted, never sent
