"""What :mod:`engines.guard` refuses before a handler runs, and how it says so: strict JSON
(numbers a handler can use: finite floats, integers that fit a signed 64-bit) and a body over
its cap. The boundaries are the promise (2^63 - 1 is an id SQLite stores; 2^63 is not), and
the messages name the offending text, cut to a length that cannot flood a log."""

from __future__ import annotations

import msgspec
import pytest

from engines.guard import INT_LIMIT, BadBody, BodyTooLarge, strict_decode, strict_json


@pytest.mark.parametrize("value", [-INT_LIMIT, INT_LIMIT - 1, 0])
def test_every_signed_64_bit_integer_is_accepted(value: int) -> None:
    assert strict_json(f'{{"n": {value}}}') == {"n": value}


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (str(INT_LIMIT), f"integer {INT_LIMIT} is out of range (|n| < 2^63)"),
        (str(-INT_LIMIT - 1), f"integer {-INT_LIMIT - 1} is out of range (|n| < 2^63)"),
        # 21 characters: refused on its length, before int() reads it, the text cut at 24
        ("1" + "0" * 20, "integer 100000000000000000000... is out of range (|n| < 2^63)"),
        ("9" * 30, "integer 999999999999999999999999... is out of range (|n| < 2^63)"),
        ("NaN", "NaN is not a number JSON allows"),
        ("-Infinity", "-Infinity is not a number JSON allows"),
        ("1e400", "1e400 is out of the range of a 64-bit float"),
        ("1." + "0" * 45 + "e400", "1." + "0" * 38 + " is out of the range of a 64-bit float"),
    ],
)
def test_a_number_a_handler_cannot_use_is_refused_naming_its_text(text: str, why: str) -> None:
    with pytest.raises(BadBody) as refused:
        strict_json(text)
    assert str(refused.value) == why


def test_a_body_that_is_not_json_or_not_the_type_says_so() -> None:
    with pytest.raises(BadBody, match=r"^body is not JSON: Expecting property name"):
        strict_json(b"{")
    with pytest.raises(BadBody, match=r"^bad request body: Expected `int`, got `str`"):
        strict_decode(b'"7"', int)
    assert strict_decode(b"7", int) == 7
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert("7", int)  # what strict_decode turns into BadBody


def test_a_body_over_its_cap_names_the_cap() -> None:
    refused = BodyTooLarge(1024)
    assert (refused.limit, str(refused)) == (1024, "request body over 1024 bytes")
