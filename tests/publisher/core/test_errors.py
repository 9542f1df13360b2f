"""Every code of every owner has its family; no code string is defined twice across owners."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path
from typing import Any

import pytest

from evlog.errors import (
    INVALID_INPUT,
    Ambiguous,
    Corrupt,
    InvalidInput,
    LoraLedgerError,
    Refused,
    StoreCode,
    StoreError,
    Unavailable,
)
from publisher.core.errors import Code, LedgerError
from publisher.drivers.fleet import Fleet, FleetError
from publisher.drivers.publication import PUBLICATION_FAILED, ErrorKind, PublicationError
from publisher.gateway import DispatchCode, DispatchError
from publisher.sessions import RolloutWorker
from tests.support.paths import REPO

ROOT = REPO

LEDGER_FAMILY: dict[str, type[LoraLedgerError]] = {
    Code.INVALID_VERSION: InvalidInput,
    Code.INVALID_INPUT: InvalidInput,
    Code.LEDGER_CLOSED: Unavailable,
    Code.FENCED: Unavailable,
    **{
        code: Refused
        for code in (
            Code.VERSION_CONFLICT,
            Code.VERSION_REGRESSION,
            Code.PUBLICATION_BLOCKED,
            Code.CAPACITY_ERROR,
            Code.PUBLICATION_IN_PROGRESS,
            Code.READY_MISMATCH,
            Code.RECEIPT_OUT_OF_ORDER,
            Code.ENGINE_RESTARTED,
            Code.ATTEMPT_CONFLICT,
            Code.FLEET_MISMATCH,
            Code.NOT_READY,
            Code.VERDICT_CONFLICT,
            Code.UNKNOWN_VERSION,
            Code.INVALID_STATE,
            Code.SESSION_CLOSED,
            Code.SESSION_TOO_STALE,
            Code.NO_PUBLISHED_VERSION,
            Code.SESSION_STILL_BOUND,
            Code.UNKNOWN_OWNER,
            Code.LEASE_EXPIRED,
            Code.OWNER_RESTARTED,
            Code.OWNER_DEREGISTERED,
            Code.OWNER_SECRET_MISMATCH,
            Code.VERSION_NOT_BOUND,
            Code.NOT_RECLAIMABLE,
            Code.REQUESTS_IN_FLIGHT,
            Code.UNKNOWN_ENGINE,
            Code.ENGINE_EXISTS,
            Code.ENGINE_SUSPENDED,
            Code.NOT_INITIALIZED,
            Code.ALREADY_INITIALIZED,
            Code.COMMAND_CONFLICT,
        )
    },
}
DISPATCH_FAMILY: dict[str, type[LoraLedgerError]] = {
    DispatchCode.NO_ROUTE: Unavailable,
    DispatchCode.AMBIGUOUS_DISPATCH: Ambiguous,
    DispatchCode.GENERATION_FAILED: Refused,
}
FAMILIES = (Refused, Ambiguous, Unavailable, Corrupt)


def codes_of(namespace: type) -> set[str]:
    return {v for k, v in vars(namespace).items() if k.isupper() and isinstance(v, str)}


def the_family(exc: LoraLedgerError) -> type[LoraLedgerError]:
    found = [f for f in FAMILIES if isinstance(exc, f)]
    assert len(found) == 1, (exc, found)
    return InvalidInput if isinstance(exc, InvalidInput) else found[0]


def test_every_ledger_code_has_its_family() -> None:
    assert codes_of(Code) == set(LEDGER_FAMILY)
    for code, family in LEDGER_FAMILY.items():
        exc = LedgerError(code, "m", version_id=3)
        assert isinstance(exc, LedgerError) and the_family(exc) is family, code
        assert (exc.code, exc.details, str(exc)) == (code, {"version_id": 3}, f"{code}: m")


def test_every_gateway_code_has_its_family() -> None:
    assert codes_of(DispatchCode) == set(DISPATCH_FAMILY)
    for code, family in DISPATCH_FAMILY.items():
        exc = DispatchError(code, "m")
        assert isinstance(exc, DispatchError) and the_family(exc) is family, code
        assert not isinstance(exc, LedgerError)


def test_the_fleet_and_the_worker_raise_their_own_errors() -> None:
    with pytest.raises(FleetError) as missing:
        Fleet()["e9"]
    assert missing.value.code == Code.UNKNOWN_ENGINE and the_family(missing.value) is Refused
    assert not isinstance(missing.value, LedgerError)
    with pytest.raises(InvalidInput) as bad:
        RolloutWorker(None, None, owner="w1", ttl_s=0)  # type: ignore[arg-type]
    assert bad.value.code == INVALID_INPUT and not isinstance(bad.value, LedgerError)


def test_a_publication_error_keeps_its_kind_and_is_not_a_ledger_error() -> None:
    exc = PublicationError(PUBLICATION_FAILED, "m", kind=ErrorKind.FATAL, state="FAILED_FATAL")
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is PublicationError and not isinstance(again, LedgerError)
    assert (again.code, again.kind, again.details["state"]) == (
        PUBLICATION_FAILED,
        ErrorKind.FATAL,
        "FAILED_FATAL",
    )


@pytest.mark.parametrize(
    "exc",
    [
        *(LedgerError(code, "m", owner="w1") for code in LEDGER_FAMILY),
        *(DispatchError(code, "m", engine="e0") for code in DISPATCH_FAMILY),
        FleetError(Code.UNKNOWN_ENGINE, "m"),
        StoreError(StoreCode.STORE_FAILED, "m", cause="OSError"),
    ],
    ids=lambda exc: f"{type(exc).__name__}-{exc.code}",
)
def test_every_error_pickles_with_its_class(exc: LoraLedgerError) -> None:
    again = pickle.loads(pickle.dumps(exc))  # Ray ships exceptions this way
    assert type(again) is type(exc)
    assert (again.code, again.message, again.details) == (exc.code, exc.message, exc.details)


def _string_constants(path: Path) -> list[tuple[str, Any]]:
    """Every ``NAME = "LITERAL"`` assignment in a module or its class bodies."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            found.append((f"{path.relative_to(ROOT)}:{node.lineno}", node.value.value))
    return found


def test_no_code_string_is_defined_twice_across_the_owners() -> None:
    codes = (
        codes_of(StoreCode)
        | {INVALID_INPUT, PUBLICATION_FAILED}
        | set(LEDGER_FAMILY)
        | set(DISPATCH_FAMILY)
    )
    where: dict[str, list[str]] = {code: [] for code in codes}
    for package in ("evlog", "projections", "publisher", "engines", "tools"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for place, value in _string_constants(path):
                if value in where:
                    where[value].append(place)
    twice = {code: places for code, places in where.items() if len(places) != 1}
    assert twice == {}
