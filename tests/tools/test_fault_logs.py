"""The tools on a log written by the real ControlPlane while its engines misbehave.

The engines are real local engines behind ``FaultyEngine`` (the colleagues' fault injection):
a lost reply on load (ambiguous: FAILED_FATAL until inventories resolve it), a clean refusal
(FAILED_RETRYABLE, retried as attempt 2), and a lost reply on an unload (an ambiguous reclaim
the reconciler settles). The incidents ``replay`` finds must be exactly those, each resolved,
and the log must verify.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from engines.contract import ErrorCode
from evlog.sqlite import SQLiteStore
from projections.registry import VersionState
from publisher.drivers.publication import ErrorKind, PublicationError
from tests.engines.faulty_engine import Drop, Refuse
from tests.publisher.plane_kit import adapter_copy, faulty_engines, open_plane
from tests.support.waiting import wait_for
from tests.tools.conftest import Cli

pytestmark = pytest.mark.filterwarnings(
    "ignore:Adapter .* was active which is now deleted:UserWarning",
    "ignore:.*is_gradient_checkpointing.*:FutureWarning",
)


async def _faulty_run(path: Path, artifacts: Path) -> None:
    async with (
        SQLiteStore.open(path) as store,
        faulty_engines(2) as engines,
        open_plane(engines, artifacts, store=store, capacity=3, probe_interval_s=3600) as plane,
    ):
        ledger = plane.ledger
        await plane.publisher.publish(adapter_copy(1), version_id=1)
        await ledger.register_owner("w1", ttl_s=600)
        await ledger.bind("s-1", "w1")

        engines[1].inject("load", Drop())  # the load ran, its reply was lost
        with pytest.raises(PublicationError) as fatal:
            await plane.publisher.publish(adapter_copy(2), version_id=2)
        assert fatal.value.kind == ErrorKind.FATAL

        engines[1].inject("load", Refuse(code=ErrorCode.RANK_UNSUPPORTED))
        with pytest.raises(PublicationError) as clean:  # resolves v2 first, then refused
            await plane.publisher.publish(adapter_copy(3), version_id=3)
        assert clean.value.kind == ErrorKind.RETRYABLE
        await plane.publisher.publish(adapter_copy(3), version_id=3)  # attempt 2

        engines[0].inject("unload", Drop())
        await ledger.release("s-1", "w1")  # v1 is now retired and unused: reclaimed
        # the reclaim driver records the ambiguous unload and pokes the reconciler, whose
        # inventories settle it
        await wait_for(
            "v1 reclaimed",
            lambda: ledger.state.versions[1].state is VersionState.RECLAIMED,
            timeout=20,
        )


@pytest.fixture(scope="module")
def faulty_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("faulty")
    anyio.run(_faulty_run, folder / "faulty.db", folder)
    return folder / "faulty.db"


def _rows(stdout: str) -> list[dict[str, Any]]:  # JSON lines
    return [json.loads(line) for line in stdout.splitlines()]


def test_it_verifies(cli: Cli, faulty_log: Path) -> None:
    result = cli("verify", faulty_log, "--deep", "--json")
    assert result.returncode == 0, result.stdout
    assert _rows(result.stdout)[0]["ok"] is True


def test_the_injected_faults_are_the_incidents(cli: Cli, faulty_log: Path) -> None:
    result = cli("replay", faulty_log, "--incidents", "--json")
    incidents = [r for r in _rows(result.stdout) if r["row"] == "incident"]
    found = {(r["kind"], r["subject"]): r for r in incidents}
    assert set(found) == {
        ("fatal", "v2"),
        ("retried", "v3"),
        ("reclaim_ambiguous", "v1"),
        ("pinned_retired", "session s-1"),  # s-1 kept v1 after v3 replaced it
        ("blocked", "v3"),  # v3's first allocation met v2's fatal block: recorded, once
    }, incidents
    assert "in the way: v2" in str(found[("blocked", "v3")]["summary"])
    fatal = found[("fatal", "v2")]
    assert fatal["resolved"] is True and "CONNECTION_LOST" in str(fatal["summary"])
    assert len(fatal["seqs"]) >= 4  # the failure, both inventories, the resolution
    retried = found[("retried", "v3")]
    assert retried["resolution"] == "attempt 2 published"
    assert "clean RANK_UNSUPPORTED" in str(retried["summary"])
    assert found[("reclaim_ambiguous", "v1")]["resolved"] is True

    states = next(
        r for r in _rows(cli("replay", faulty_log, "--json").stdout) if r["row"] == "state"
    )
    final = {v["version_id"]: v["state"] for v in states["versions"]}
    assert final == {1: "RECLAIMED", 2: "FAILED_RETRYABLE", 3: "PUBLISHED"}


def test_the_timeline_and_the_audit_tell_the_same(cli: Cli, faulty_log: Path) -> None:
    timeline = [
        r
        for r in _rows(cli("replay", faulty_log, "--json", "--version", "2").stdout)
        if r["row"] == "timeline" and r["from_state"] != r["to_state"]
    ]
    assert [(r["from_state"], r["to_state"]) for r in timeline] == [
        (None, "LOADING"),
        ("LOADING", "FAILED_FATAL"),
        ("FAILED_FATAL", "FAILED_RETRYABLE"),
    ]
    (audit,) = _rows(cli("audit", faulty_log, "--session", "s-1", "--json").stdout)
    facts = [f["what"] for f in audit["version_facts"]]
    assert facts[-3:] == ["retired", "reclaiming", "reclaimed"]
