"""The engine contract's non-draining branch (``unload_drains=False``, vLLM's behaviour) against
the engine double the ledger's in-flight tests use for such engines
(:class:`tests.publisher.rollout_kit.NonDraining`: the real local engine, with an unload that
answers as soon as the name is forgotten). The real vLLM shows the same behaviour in
``tests/integration/test_vllm_engine.py`` (marked ``vllm``); its contract run cannot hold a
request between tokens, so there the contract skips both unload-under-request tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engines.artifacts import ArtifactStore
from engines.local.admission import ServingLimits
from engines.local.engine import LocalEngine
from tests.engines.contract import (
    Capabilities,
    EngineContract,
    EngineUnderTest,
    contract_fixture,
)
from tests.publisher.rollout_kit import ENGINE_WARNINGS, NonDraining

pytestmark = [pytest.mark.anyio, *ENGINE_WARNINGS]


@contextlib.asynccontextmanager
async def non_draining(tmp_path: Path) -> AsyncIterator[EngineUnderTest]:
    store = ArtifactStore(tmp_path / "artifacts")
    limits = ServingLimits(max_lora_rank=32)
    async with LocalEngine("nd-0", limits=limits, artifact_root=store.root) as engine:
        yield EngineUnderTest(
            engine=NonDraining(engine),
            caps=Capabilities(unload_drains=False, reclaimed_refusal=True),
            store=store,
            hold=engine.pause_generation,
            release=engine.continue_generation,
            refcount=engine.refcount,
        )


eut = contract_fixture({"non-draining": non_draining})


class TestNonDrainingDouble:
    """The contract's unload tests: the draining one skips (the flag says so), the
    non-draining one asserts what the flag declares, and the others check that the double's
    unload keeps the engine's answers (idempotent, attempt-fenced)."""

    _contract = EngineContract
    test_unload_waits_for_in_flight_requests = _contract.test_unload_waits_for_in_flight_requests
    test_an_unload_that_does_not_drain_answers_under_a_running_request = (
        _contract.test_an_unload_that_does_not_drain_answers_under_a_running_request
    )
    test_unload_then_repeat_is_idempotent = _contract.test_unload_then_repeat_is_idempotent
    test_generation_after_unload = _contract.test_generation_after_unload
    test_stale_attempt_cleanup_never_touches_the_newer_attempt = (
        _contract.test_stale_attempt_cleanup_never_touches_the_newer_attempt
    )
    test_cleaned_up_attempt_cannot_come_back = _contract.test_cleaned_up_attempt_cannot_come_back
