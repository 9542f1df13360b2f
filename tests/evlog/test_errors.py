"""The error families and the store's codes: each code has one family, errors survive pickling."""

from __future__ import annotations

import pickle

import pytest

from evlog.errors import (
    FAMILIES,
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

STORE_FAMILY = {
    StoreCode.SEQ_CONFLICT: Refused,
    INVALID_INPUT: InvalidInput,
    StoreCode.STORE_CLOSED: Unavailable,
    StoreCode.STORE_FAILED: Unavailable,
    StoreCode.CHAIN_BROKEN: Corrupt,
    StoreCode.CORRUPT_RECORD: Corrupt,
    StoreCode.CORRUPT_STORE: Corrupt,
    StoreCode.UNKNOWN_SCHEMA: Corrupt,
}


def codes_of(namespace: type) -> set[str]:
    return {v for k, v in vars(namespace).items() if k.isupper() and isinstance(v, str)}


def test_every_store_code_has_its_family() -> None:
    assert codes_of(StoreCode) | {INVALID_INPUT} == set(STORE_FAMILY)
    for code, family in STORE_FAMILY.items():
        exc = StoreError(code, "what happened", seq=7)
        assert isinstance(exc, StoreError) and isinstance(exc, family), code
        assert [f for f in (Refused, Ambiguous, Unavailable, Corrupt) if isinstance(exc, f)] == [
            Refused if family is InvalidInput else family
        ]
        assert (exc.code, exc.message, exc.details) == (code, "what happened", {"seq": 7})
        assert str(exc) == f"{code}: what happened"


def test_invalid_input_is_a_refusal_and_the_other_families_are_apart() -> None:
    assert issubclass(InvalidInput, Refused)
    apart = [f for f in FAMILIES if f is not InvalidInput]
    for a in apart:
        assert issubclass(a, LoraLedgerError)
        assert [b for b in apart if issubclass(a, b)] == [a]


def test_errors_pickle_with_class_code_message_and_details() -> None:
    for code in STORE_FAMILY:
        exc = StoreError(code, "m", seq=3, problems=["a"])
        again = pickle.loads(pickle.dumps(exc))
        assert type(again) is type(exc)
        assert (again.code, again.message, again.details, str(again)) == (
            exc.code,
            exc.message,
            exc.details,
            str(exc),
        )
    for plain in (LoraLedgerError("X", "m", a=1), InvalidInput(INVALID_INPUT, "m")):
        again = pickle.loads(pickle.dumps(plain))
        assert type(again) is type(plain) and again.details == plain.details


def test_an_owner_refuses_a_code_it_does_not_declare() -> None:
    with pytest.raises(ValueError, match="StoreError has no code 'NO_SUCH_CODE'"):
        StoreError("NO_SUCH_CODE", "m")


def test_a_code_is_declared_once_per_owner_in_the_owner_family_shape() -> None:
    class Owner(LoraLedgerError):
        pass

    class OwnerRefused(Owner, Refused, codes=["A"]):
        pass

    assert type(Owner("A", "m")) is OwnerRefused
    with pytest.raises(TypeError, match="declared twice"):

        class OwnerAlsoRefused(Owner, Refused, codes=["A"]):
            pass

    with pytest.raises(TypeError, match="class X"):

        class Backwards(Refused, Owner, codes=["B"]):
            pass
