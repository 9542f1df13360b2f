"""A publication asked again under the same request id (a remote trainer whose reply was lost)
answers what the first ask reached, from the log: never a second attempt, never the ``NO_OP``
a new request for a published step gets."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.contract import ErrorCode
from evlog.events import AttemptStarted
from publisher.drivers.publication import ErrorKind, PublicationError, PublicationStatus
from tests.engines.faulty_engine import Refuse
from tests.publisher.plane_kit import PEFT_WARNINGS, adapter_copy, faulty_engines, open_plane
from tests.support.log import events, of_type

pytestmark = [pytest.mark.anyio, PEFT_WARNINGS]

IDLE = 3600.0


async def test_a_published_request_asked_again_answers_the_same_outcome(tmp_path: Path) -> None:
    async with faulty_engines(1) as engines, open_plane(engines, tmp_path) as plane:
        first = await plane.publisher.publish(adapter_copy(1), version_id=1, request_id="r1")
        again = await plane.publisher.publish(adapter_copy(1), version_id=1, request_id="r1")
        other = await plane.publisher.publish(adapter_copy(1), version_id=1, request_id="r2")
        log = await events(plane.ledger)
    assert first.status == again.status == PublicationStatus.PUBLISHED
    assert (again.revision, again.attempt) == (first.revision, first.attempt)
    assert other.status == PublicationStatus.NO_OP
    assert len(of_type(log, AttemptStarted)) == 1


async def test_a_failed_request_asked_again_answers_its_failure_not_a_new_attempt(
    tmp_path: Path,
) -> None:
    async with (
        faulty_engines(1) as engines,
        open_plane(engines, tmp_path, probe_interval_s=IDLE) as plane,
    ):
        engines[0].inject("load", Refuse(code=ErrorCode.RANK_UNSUPPORTED))
        with pytest.raises(PublicationError) as first:
            await plane.publisher.publish(adapter_copy(1), version_id=1, request_id="r1")
        with pytest.raises(PublicationError) as again:
            await plane.publisher.publish(adapter_copy(1), version_id=1, request_id="r1")
        assert len(of_type(await events(plane.ledger), AttemptStarted)) == 1
        retry = await plane.publisher.publish(adapter_copy(1), version_id=1, request_id="r2")
    assert first.value.kind == again.value.kind == ErrorKind.RETRYABLE
    assert (again.value.details["attempt"], again.value.details["state"]) == (1, "FAILED_RETRYABLE")
    assert (retry.status, retry.attempt) == (PublicationStatus.PUBLISHED, 2)
