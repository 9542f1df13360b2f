"""The gateway on real local engines and a real ledger: routes only to holders, sends at most
once, counts in-flight requests through every exit, owns the cache namespace, and returns the
provenance of every result."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import anyio
import pytest

from engines.contract import SamplingParams
from engines.local.engine import LocalEngine
from engines.vllm import cache_salt_problem
from evlog.errors import LoraLedgerError
from publisher.core.errors import Code
from publisher.core.outcomes import Bound
from publisher.gateway import DispatchCode, DispatchError, version_salt
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
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.anyio, *ENGINE_WARNINGS]

LONG = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


async def bound_session(r: Rig, session: str, owner: str = "w") -> Bound:
    if owner not in r.ledger.state.owners:
        await r.ledger.register_owner(owner, ttl_s=60.0)
    return await r.ledger.bind(session, owner)


def wrapping(kinds: dict[str, type[Recording]]) -> Callable[[LocalEngine], Any]:
    return lambda engine: kinds.get(engine.engine_id, Recording)(engine)


# --- routing ---------------------------------------------------------------------------------


async def test_routes_only_to_routable_holders_sticky_per_session() -> None:
    async with rig(wrap=wrapping({})) as r:
        await r.publish(1)
        bound = await bound_session(r, "s1")
        # A session's turns follow each other (each resends the conversation). Concurrent
        # requests of one session are load like any other: over the bound they spread.
        for _ in range(20):
            await r.gateway.generate(bound, PROMPT, SHORT)
        calls = {e.engine_id: len(e.calls) for e in r.fleet}  # type: ignore[attr-defined]
        assert sorted(calls.values()) == [0, 20], calls  # one session: one engine, every turn
        # Many sessions spread over the holders (rendezvous hashing of their ids).
        others = [await bound_session(r, f"spread-{i}") for i in range(16)]
        for other in others:
            await r.gateway.generate(other, PROMPT, SHORT)
        spread = {e.engine_id: len(e.calls) - calls[e.engine_id] for e in r.fleet}  # type: ignore[attr-defined]
        assert min(spread.values()) >= 3, spread
        calls = {e.engine_id: len(e.calls) for e in r.fleet}  # type: ignore[attr-defined]

        # e0 restarts: it holds nothing and is not routable until repaired -> only e1 serves.
        await r.ledger.observe_restart("e0", "e0-new-life")
        before = dict(calls)
        for _ in range(6):
            served = await r.gateway.generate(bound, PROMPT, SHORT)
            assert served.engine == "e1"
        assert len(r.fleet["e0"].calls) == before["e0"]  # type: ignore[attr-defined]

        # No routable holder left: NO_ROUTE, and nothing reaches any engine.
        await r.ledger.observe_restart("e1", "e1-new-life")
        sent = sum(len(e.calls) for e in r.fleet)  # type: ignore[attr-defined, misc]
        with pytest.raises(LoraLedgerError) as info:
            await r.gateway.generate(bound, PROMPT, SHORT)
        assert info.value.code == DispatchCode.NO_ROUTE
        assert sum(len(e.calls) for e in r.fleet) == sent  # type: ignore[attr-defined, misc]


async def test_routing_follows_the_ledger_live() -> None:
    async with rig(engines=3, wrap=wrapping({})) as r:
        await r.publish(1)
        bound = await bound_session(r, "s1")
        # e2 restarts: until repair it holds nothing the ledger knows of and gets nothing.
        await r.ledger.observe_restart("e2", "e2-life-2")
        for _ in range(12):
            served = await r.gateway.generate(bound, PROMPT, SHORT)
            assert served.engine in {"e0", "e1"}
        assert r.fleet["e2"].calls == []  # type: ignore[attr-defined]
        # Repaired (v1 restored on it): the very next calls may use it.
        await r.ledger.restore_version(1, "e2", "e2-life-2")
        await r.ledger.repair_engine("e2", "e2-life-2")
        for i in range(12):
            await r.gateway.generate(await bound_session(r, f"later-{i}"), PROMPT, SHORT)
        assert len(r.fleet["e2"].calls) >= 2  # type: ignore[attr-defined]


async def test_an_engine_that_holds_the_version_is_not_routed_to_before_its_repair() -> None:
    """The engine restarted and v1 is back on it (restored), but the ledger has not repaired
    it: it holds the version and must still get nothing -- "holds" is not "routable"."""
    async with rig(wrap=wrapping({})) as r:
        await r.publish(1)
        bound = await bound_session(r, "s1")
        await r.ledger.observe_restart("e0", "e0-life-2")
        await r.ledger.restore_version(1, "e0", "e0-life-2")
        member = r.ledger.state.engines["e0"]
        assert r.names[1] in member.holds and not member.routable
        for _ in range(8):
            served = await r.gateway.generate(bound, PROMPT, SHORT)
            assert served.engine == "e1"
        assert r.fleet["e0"].calls == []  # type: ignore[attr-defined]

        # The only other holder goes: NO_ROUTE, never the unrepaired holder.
        await r.ledger.observe_restart("e1", "e1-life-2")
        with pytest.raises(DispatchError) as info:
            await r.gateway.generate(bound, PROMPT, SHORT)
        assert info.value.code == DispatchCode.NO_ROUTE
        assert r.fleet["e0"].calls == []  # type: ignore[attr-defined]

        await r.ledger.repair_engine("e0", "e0-life-2")
        assert (await r.gateway.generate(bound, PROMPT, SHORT)).engine == "e0"


# --- at most once ------------------------------------------------------------------------------


async def test_a_lost_reply_is_ambiguous_and_never_resent() -> None:
    async with rig(wrap=wrapping({"e0": LosesReply, "e1": LosesReply})) as r:
        await r.publish(1)
        bound = await bound_session(r, "s1")
        with pytest.raises(LoraLedgerError) as info:
            await r.gateway.generate(bound, PROMPT, SHORT, request_id="req-1")
        assert info.value.code == DispatchCode.AMBIGUOUS_DISPATCH
        assert info.value.details["request_id"] == "req-1"
        engines = list(r.fleet)
        # Exactly one dispatch reached an engine, and that engine really ran it.
        assert sum(len(e.calls) for e in engines) == 1  # type: ignore[attr-defined, misc]
        assert sum(e.reached for e in engines) == 1  # type: ignore[attr-defined]
        assert r.gateway.inflight_counts() == {}
        assert r.recorder.recorded == 0  # no sample without a reply, no provenance row


async def test_only_a_provable_non_dispatch_goes_to_another_holder() -> None:
    async with rig(wrap=wrapping({"e0": Unreachable})) as r:
        await r.publish(1)
        bound = await bound_session(r, "s1")
        for _ in range(6):
            served = await r.gateway.generate(bound, PROMPT, SHORT)
            assert served.engine == "e1"
        assert len(r.fleet["e1"].calls) == 6  # type: ignore[attr-defined]
        assert r.gateway.inflight_counts() == {}


async def test_no_reachable_holder_is_no_route() -> None:
    async with rig(wrap=wrapping({"e0": Unreachable, "e1": Unreachable})) as r:
        await r.publish(1)
        bound = await bound_session(r, "s1")
        with pytest.raises(LoraLedgerError) as info:
            await r.gateway.generate(bound, PROMPT, SHORT)
        assert info.value.code == DispatchCode.NO_ROUTE
        assert sorted(info.value.details["unreachable"]) == ["e0", "e1"]


async def test_a_clean_refusal_is_generation_failed_and_not_tried_elsewhere() -> None:
    async with rig(wrap=wrapping({})) as r:
        await r.publish(1)
        bound = await bound_session(r, "s1")
        too_long = SamplingParams(max_tokens=10_000)
        with pytest.raises(LoraLedgerError) as info:
            await r.gateway.generate(bound, PROMPT, too_long)
        assert info.value.code == DispatchCode.GENERATION_FAILED
        assert info.value.details["engine_code"] == "BAD_REQUEST"
        assert sum(len(e.calls) for e in r.fleet) == 1  # type: ignore[attr-defined, misc]
        assert r.gateway.inflight_counts() == {}


# --- in-flight counting ------------------------------------------------------------------------


async def test_in_flight_counts_through_completion_and_cancellation() -> None:
    async with rig() as r:
        await r.publish(1)
        bound = await bound_session(r, "s1")
        for engine in r.local.values():
            engine.pause_generation()
        async with anyio.create_task_group() as tg:
            tg.start_soon(r.gateway.generate, bound, PROMPT, LONG)
            await wait_for(
                "one request in flight", lambda: sum(r.gateway.inflight_counts().values()) == 1
            )
            ((engine_id, version_id),) = r.gateway.inflight_counts()
            assert version_id == 1
            evidence = {x.engine: x.count for x in r.gateway.inflight_evidence(1)}
            assert evidence == {"e0": int(engine_id == "e0"), "e1": int(engine_id == "e1")}
            assert all(x.reporter == "gw" for x in r.gateway.inflight_evidence(1))
            assert {x.count for x in r.gateway.inflight_evidence(2)} == {0}
            tg.cancel_scope.cancel()  # the caller goes away mid-generation
        assert r.gateway.inflight_counts() == {}
        assert r.gateway.inflight(engine_id, 1) == 0
        assert r.local[engine_id].refcount(bound.lora_name) == 0
        for engine in r.local.values():
            engine.continue_generation()
        await r.gateway.generate(bound, PROMPT, SHORT)
        assert r.gateway.inflight_counts() == {}


# --- cache namespace ---------------------------------------------------------------------------


async def test_client_cache_keys_are_replaced_by_the_version_salt() -> None:
    async with rig(wrap=wrapping({})) as r:
        await r.publish(1)
        await r.publish(2)
        s1 = await bound_session(r, "s1")  # v2 (the default now)
        await r.gateway.generate(
            s1,
            PROMPT,
            SHORT,
            extra_body={"extra_key": "shared", "cache_salt": "shared", "lora_path": "x", "k": 1},
        )
        calls = [call for e in r.fleet for call in e.calls]  # type: ignore[attr-defined]
        assert len(calls) == 1
        assert calls[0]["cache_salt"] == version_salt(s1)
        assert calls[0]["extra_body"] == {"k": 1}  # owned keys never forwarded
        assert calls[0]["lora_name"] == s1.lora_name


def test_the_version_salt_is_hex_unique_per_version_and_safe_on_every_engine() -> None:
    """The version salt travels with every generation to every engine. It used to be the
    version's ``lora_name``, which always contains ``@`` (docs/identities.md), and vLLM refuses any
    ``cache_salt`` containing ``@`` (HTTP 400), so every generation on a vLLM fleet failed.

    What must hold: lowercase hex only (no engine restricts that alphabet), accepted by the
    vLLM adapter's own check, one salt per version (two versions never share prefix-cache
    entries, whichever of deployment, version id or digest differs), and the same salt for
    every session and every gateway process serving that version (they may share entries)."""
    digests = ["0123456789abcdef" * 4, "fedcba9876543210" * 4, "f" * 64]

    def bound(name: str, version_id: int, digest: str, session: str = "s") -> Bound:
        return Bound(
            session=session,
            version_id=version_id,
            lora_name=name,
            digest=digest,
            revision=version_id,
            new=True,
        )

    versions = [
        bound(f"{prefix}@{deployment}-{vid}-{digest[:16]}", vid, digest)
        for prefix in ("agent", "agent-b")
        for deployment in ("demo", "demo-1", "demo-12")
        for vid in (1, 2, 12, 121)
        for digest in digests
    ]
    assert len({b.lora_name for b in versions}) == len(versions)
    salts = [version_salt(b) for b in versions]
    assert len(set(salts)) == len(versions)
    for b, salt in zip(versions, salts, strict=True):
        assert re.fullmatch(r"[0-9a-f]{32}", salt), salt
        assert cache_salt_problem(salt) is None
        assert cache_salt_problem(b.lora_name) is not None  # the old salt: vLLM refuses it
        # Another session of the same version, bound later: the same namespace.
        again = bound(b.lora_name, b.version_id, b.digest, session="other")
        assert version_salt(again) == salt


async def test_the_client_cannot_choose_the_prefix_cache_namespace() -> None:
    """On the real engine: two requests of one version share the cache whatever salts the
    client sends (the gateway's salt wins), so the client cannot pick a namespace."""
    async with rig(engines=1) as r:
        await r.publish(1)
        bound = await bound_session(r, "s1")
        prompt = tuple(range(20, 40))
        first = await r.gateway.generate(bound, prompt, SHORT, extra_body={"cache_salt": "A"})
        second = await r.gateway.generate(bound, prompt, SHORT, extra_body={"extra_key": "B"})
        assert first.generation.cached_tokens == 0
        assert second.generation.cached_tokens > 0


async def test_extra_fields_for_an_engine_that_takes_none_are_refused_before_dispatch() -> None:
    async with rig(engines=1) as r:
        await r.publish(1)
        bound = await bound_session(r, "s1")
        with pytest.raises(LoraLedgerError) as info:
            await r.gateway.generate(bound, PROMPT, SHORT, extra_body={"top_k": 3})
        assert info.value.code == Code.INVALID_INPUT
        assert r.gateway.dispatched == 0


# --- provenance ----------------------------------------------------------------------------------


async def test_every_result_carries_its_version_and_staleness() -> None:
    async with rig() as r:
        await r.publish(1)
        bound = await bound_session(r, "s1")
        served = await r.gateway.generate(bound, PROMPT, SHORT, turn=0, request_id="r-1")
        row = served.provenance
        assert (row.version_id, row.lora_name, row.digest) == (1, bound.lora_name, bound.digest)
        assert (row.bound_revision, row.head_revision, row.staleness) == (1, 1, 0)
        assert (row.session, row.turn, row.request_id) == ("s1", 0, "r-1")
        assert row.engine == served.generation.engine_id
        assert row.completion_tokens == len(served.generation.token_ids) == 2
        await r.publish(2)
        await r.publish(3)
        later = await r.gateway.generate(bound, PROMPT, SHORT, turn=1)
        assert later.version_id == 1 and later.staleness == 2
        assert later.generation.lora_name == bound.lora_name  # the engine echoes v1
        await wait_for("every provenance row to reach the sink", lambda: r.recorder.pending == 0)
        assert [x.request_id for x in r.sink.rows] == ["r-1", later.provenance.request_id]
        assert all(x.attested and x.served_name == bound.lora_name for x in r.sink.rows)


async def test_an_engine_naming_another_adapter_is_recorded_not_hidden() -> None:
    async with rig(wrap=wrapping({"e0": EchoesAnother, "e1": EchoesAnother})) as r:
        await r.publish(1)
        bound = await bound_session(r, "s1")
        served = await r.gateway.generate(bound, PROMPT, SHORT)
        assert served.provenance.lora_name == bound.lora_name  # what the session is bound to
        assert served.provenance.served_name == "agent@dep-999-0000000000000000"
        assert not served.provenance.attested
