"""The reference-count unit: each rule that SGLang got wrong at least once (docs/engines.md)."""

from __future__ import annotations

import anyio
import pytest

from engines.local.refs import RefCounter, RefError


def test_acquire_and_release_balance() -> None:
    refs = RefCounter("a")
    leases = [refs.acquire() for _ in range(3)]
    assert refs.count == 3
    for lease in leases:
        assert lease.release() is True
    assert refs.count == 0


def test_duplicate_terminal_signal_releases_once() -> None:
    refs = RefCounter("a")
    keep = refs.acquire()
    lease = refs.acquire()
    assert lease.release() is True
    assert lease.release() is False  # e.g. finish + abort echo
    assert lease.release() is False  # e.g. the finally after an explicit release
    assert refs.count == 1  # never below what the other holder still has
    keep.release()
    assert refs.count == 0


def test_closed_counter_refuses_new_holders_but_counts_releases() -> None:
    refs = RefCounter("a")
    lease = refs.acquire()
    refs.close()
    with pytest.raises(RefError):
        refs.acquire()
    assert refs.count == 1
    lease.release()
    assert refs.count == 0


def test_underflow_is_an_invariant_error_not_a_negative_count() -> None:
    refs = RefCounter("a")
    with pytest.raises(RefError):
        refs._release_one()
    assert refs.count == 0


@pytest.mark.anyio
async def test_wait_zero_wakes_exactly_when_the_last_holder_leaves() -> None:
    refs = RefCounter("a")
    first, second = refs.acquire(), refs.acquire()
    refs.close()
    woke = anyio.Event()

    async def waiter() -> None:
        await refs.wait_zero()
        woke.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()  # the waiter waits on the two holders
        first.release()
        await anyio.wait_all_tasks_blocked()  # it ran on the first release, if it woke at all
        assert not woke.is_set()
        second.release()
        with anyio.fail_after(10):  # a bound for a hang only: the wake is an event
            await woke.wait()


@pytest.mark.anyio
async def test_wait_zero_returns_at_once_when_unused() -> None:
    refs = RefCounter("a")
    refs.close()
    with anyio.fail_after(10):  # a bound for a hang only: nothing holds it
        await refs.wait_zero()
