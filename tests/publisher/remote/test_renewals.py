"""``PendingRenewals``, the per-life book both remote clients forward renewals from: each
life ``(owner, incarnation)`` keeps its own newest counts and its own refusal."""

from __future__ import annotations

import pytest

from evlog.errors import LoraLedgerError
from publisher.core.errors import Code, LedgerRefused
from publisher.remote.renewals import PendingRenewals


def test_each_life_keeps_its_newest_counts_and_zeros_are_dropped() -> None:
    book = PendingRenewals()
    book.record("w", "one", {("e0", 1): 5})
    book.record("w", "two", {("e0", 1): 2, ("e1", 1): 0})
    book.record("w", "one", {("e0", 1): 4})  # newer than the first of its life
    assert book.wanted.is_set()
    assert book.take() == {("w", "one"): {("e0", 1): 4}, ("w", "two"): {("e0", 1): 2}}
    assert not book.wanted.is_set() and book.take() == {}


def test_a_forward_kept_after_a_failure_never_hides_a_newer_renewal() -> None:
    book = PendingRenewals()
    book.record("w", "one", {("e0", 1): 5})
    taken = book.take()
    book.record("w", "one", {("e0", 1): 1})  # recorded while the forward was on the way
    for life, counts in taken.items():
        book.keep(life, counts)  # it did not reach the ledger
    book.keep(("w", "two"), {("e0", 2): 3})
    assert book.wanted.is_set()
    assert book.take() == {("w", "one"): {("e0", 1): 1}, ("w", "two"): {("e0", 2): 3}}


def test_a_refusal_is_charged_to_its_life_only_until_it_registers_again() -> None:
    book = PendingRenewals()
    first = LedgerRefused(Code.OWNER_RESTARTED, "owner w was restarted")
    book.refused(("w", "one"), first)
    book.refused(("w", "one"), LedgerRefused(Code.LEASE_EXPIRED, "later"))  # the first stays
    book.record("w", "two", None)  # the successor is untouched
    with pytest.raises(LoraLedgerError) as zombie:
        book.record("w", "one", {("e0", 1): 1})
    assert zombie.value is first
    assert book.take() == {("w", "two"): {}}
    book.registered(("w", "one"))
    book.record("w", "one", None)
    book.ended(("w", "one"))
    assert book.take() == {}


def test_a_relays_sessions_are_joined_until_forwarded_and_kept_when_not() -> None:
    """Counts are a state (the newest wins), the sessions a relay had a turn of are news:
    every one recorded since the last forward goes out once, and a forward that did not reach
    the ledger keeps them for the next."""
    book = PendingRenewals()
    book.record("face", "a", {("e0", 1): 1}, ["s1", "s2"])
    book.record("face", "a", {}, ["s2", "s3"])
    book.record("w", "x", {("e0", 1): 2})
    assert book.take() == {("face", "a"): {}, ("w", "x"): {("e0", 1): 2}}
    assert book.take_sessions() == {("face", "a"): ("s1", "s2", "s3")}
    assert book.take_sessions() == {}
    book.keep(("face", "a"), {}, ("s1", "s2", "s3"))  # that forward failed
    book.record("face", "a", {("e0", 1): 1}, ["s4"])
    assert book.take() == {("face", "a"): {("e0", 1): 1}}
    assert book.take_sessions() == {("face", "a"): ("s1", "s2", "s3", "s4")}
    book.record("face", "a", {}, ["s5"])
    book.ended(("face", "a"))  # deregistered: nothing of it is forwarded any more
    assert (book.take(), book.take_sessions()) == ({}, {})


def test_a_pended_life_is_forwarded_again_with_its_newest_counts() -> None:
    """A confirmation needs the ledger's answer about a life even when nothing new was
    recorded: ``pend`` sends its newest counts again, never over a newer pending renewal."""
    book = PendingRenewals()
    book.record("w", "one", {("e0", 1): 3})
    book.take()
    assert not book.wanted.is_set()
    book.pend(("w", "one"))
    assert book.wanted.is_set()
    assert book.take() == {("w", "one"): {("e0", 1): 3}}
    book.record("w", "one", {("e0", 1): 1})
    book.pend(("w", "one"))  # the pending renewal is newer: it stays
    book.pend(("w", "new"))  # a life that never renewed is forwarded with no counts
    assert book.take() == {("w", "one"): {("e0", 1): 1}, ("w", "new"): {}}


def test_an_ended_life_is_forgotten_and_ending_or_registering_twice_is_harmless() -> None:
    """Deregistration forgets a life's counts, so a later confirmation of it forwards none;
    a life ended after its renewal was forwarded, or registered without a refusal, is no
    error (a client calls both on every deregistration and registration)."""
    book = PendingRenewals()
    refusal = LedgerRefused(Code.LEASE_EXPIRED, "lease of w expired")
    assert book.lost(("w", "one")) is None
    book.refused(("w", "one"), refusal)
    assert book.lost(("w", "one")) is refusal and book.lost(("w", "two")) is None
    book.registered(("w", "one"))
    book.registered(("w", "one"))  # nothing refused any more
    assert book.lost(("w", "one")) is None
    book.record("w", "one", {("e0", 1): 2})
    book.take()  # forwarded: nothing pending for it now
    book.ended(("w", "one"))
    book.ended(("w", "one"))
    book.pend(("w", "one"))
    assert book.take() == {("w", "one"): {}}


def test_a_key_is_seen_once_answered_and_unseen_once_a_zero_may_land() -> None:
    """``unseen`` says a life counts a request the ledger may hold at zero (its renewal must be
    answered before the request is sent). A key sent at zero stops being seen when that forward
    is taken, not when it is answered; an older forward's answer never marks a key seen that a
    later take carried at zero; a failed forward forgets everything of its life."""
    book = PendingRenewals()
    life = ("w", "one")
    book.record(*life, {("e0", 1): 1})
    assert book.unseen(life)
    first = book.take()
    book.answered(first, book.takes)
    assert not book.unseen(life)
    book.record(*life, {("e0", 1): 2})  # a second request on a seen key rides the timer
    assert not book.unseen(life)
    book.record(*life, {("e0", 1): 1, ("e1", 1): 1})  # another engine: its first count
    assert book.unseen(life)
    second, number = book.take(), book.takes
    book.answered(second, number)
    assert not book.unseen(life)

    book.record(*life, {})  # every request ended
    zero = book.take()  # on its way: the ledger may hear zero any moment now
    book.record(*life, {("e0", 1): 1})
    assert book.unseen(life)
    book.answered(second, number)  # a late answer of the older forward changes nothing
    assert book.unseen(life)
    book.answered(zero, book.takes)
    assert book.unseen(life)

    book.answered(book.take(), book.takes)
    assert not book.unseen(life)
    book.keep(life, {("e0", 1): 1})  # a forward that failed: the ledger may have restarted
    assert book.unseen(life)
