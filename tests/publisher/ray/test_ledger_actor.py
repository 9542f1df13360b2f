"""The ledger actor and its client, on a real local Ray instance and real SQLite files:
the in-process API across Ray (outcomes, refusals with their codes, batches), coalesced round
trips, routing delivered with replies, leases renewed through the client, and the restart
story (Ray restarting the actor, or the actor recreated under its name) replaying every
binding from the log."""

from __future__ import annotations

import dataclasses
from typing import Any

import anyio
import msgspec
import pytest
import ray

from engines.local.tinymodel import make_adapter
from evlog.errors import LoraLedgerError
from publisher.core import commands as c
from publisher.core.errors import Code, LedgerInvalidInput, LedgerRefused
from publisher.core.outcomes import Bound, Released
from publisher.drivers.adapter_copy import AdapterCopy
from publisher.drivers.publication import ErrorKind, PublicationError
from publisher.ray.adapter_objects import check_descriptor, put_adapter
from publisher.ray.client import RayLedger
from publisher.ray.ledger_actor import LedgerConfig, LedgerInfo, start_ledger, stop_ledger
from publisher.ray.link import ActorLink
from publisher.ray.trainer import RayTrainerClient
from tests.publisher.ray.kit import ENGINES, create, renewal_refused
from tests.support.ledger import publish
from tests.support.waiting import wait_for

pytestmark = pytest.mark.anyio


async def test_the_client_speaks_the_in_process_api(ledger_factory: Any) -> None:
    lut = ledger_factory()
    async with RayLedger.connect(lut.name) as ledger:
        await create(ledger)
        await ledger.register_owner("w1")
        with pytest.raises(LoraLedgerError) as no_version:
            await ledger.bind("s0", "w1")
        assert type(no_version.value) is LedgerRefused
        assert no_version.value.code == Code.NO_PUBLISHED_VERSION
        published = await publish(ledger, 1)

        first = await ledger.bind("s1", "w1")
        again = await ledger.bind("s1", "w1")
        assert (first.version_id, first.lora_name, first.new) == (1, published.lora_name, True)
        assert again == Bound(
            session="s1",
            version_id=1,
            lora_name=published.lora_name,
            digest=first.digest,
            revision=1,
            new=False,
        )
        released = await ledger.release("s1", "w1")
        assert released == Released(session="s1", released=True, version_id=1, tombstoned=True)
        with pytest.raises(LoraLedgerError) as closed:
            await ledger.bind("s1", "w1")
        assert closed.value.code == Code.SESSION_CLOSED

        # a batch: each command decided on its own, refusals in place
        results = await ledger.execute_many(
            [
                c.Bind(session="s2", owner="w1"),
                c.Bind(session="s3", owner="stranger"),
                c.Release(session="s2", owner="w1"),
                c.Forget(sessions=("s1", "s2")),
            ]
        )
        assert isinstance(results[0], Bound) and results[0].session == "s2"
        assert isinstance(results[1], LoraLedgerError) and results[1].code == Code.UNKNOWN_OWNER
        assert isinstance(results[2], Released) and results[2].released
        assert results[3].count == 2  # type: ignore[union-attr]

        # a refusal raised by an actor method itself keeps its type and code too
        with pytest.raises(LoraLedgerError) as bad_ttl:
            await ledger.register_owner("w2", ttl_s=-1)
        assert (
            type(bad_ttl.value) is LedgerInvalidInput and bad_ttl.value.code == Code.INVALID_INPUT
        )

        status = await ledger.status()
        assert (status.default, status.sessions_bound, status.owners) == (1, 0, 1)


async def test_concurrent_calls_share_round_trips(ledger_factory: Any) -> None:
    lut = ledger_factory()
    async with RayLedger.connect(lut.name, max_in_flight=2) as ledger:
        await create(ledger)
        await ledger.register_owner("w1")
        await publish(ledger, 1)
        before = ledger.round_trips
        names = [f"s{i}" for i in range(300)]
        answers: dict[str, Bound] = {}

        async def bind(name: str) -> None:
            answers[name] = await ledger.bind(name, "w1")

        async with anyio.create_task_group() as tg:
            for name in names:
                tg.start_soon(bind, name)
        trips = ledger.round_trips - before
        # every caller got the answer for ITS session
        assert all(answers[n].session == n and answers[n].new for n in names)
        assert trips <= 30, f"300 concurrent binds took {trips} round trips"
        assert (await ledger.status()).sessions_bound == 300


async def test_routing_arrives_with_the_replies_and_the_long_poll(ledger_factory: Any) -> None:
    lut = ledger_factory()
    async with (
        RayLedger.connect(lut.name) as publisher,
        RayLedger.connect(lut.name) as worker,
    ):
        await create(publisher)
        await worker.register_owner("w1")  # the owner's calls go through its own client
        v1 = await publish(publisher, 1)
        await worker.refresh()
        assert worker.view.holders(v1.lora_name) == ENGINES
        assert worker.view.default_revision == 1

        v2 = await publish(publisher, 2)
        # the worker sends nothing: the long poll brings the change as it is recorded
        await wait_for(
            "the worker's view has v2", lambda: worker.view.holders(v2.lora_name) == ENGINES
        )
        assert worker.view.default_revision == 2
        # and a reply carries routing computed after the command: the bind's routes to v2
        bound = await worker.bind("s1", "w1")
        assert bound.version_id == 2
        assert worker.view.holders(v2.lora_name) == ENGINES
        assert worker.view.default_revision == 2
        assert worker.view.holders(v1.lora_name) == ENGINES  # retired, still held


async def test_leases_are_renewed_through_the_client_and_expiry_is_learned(
    ledger_factory: Any,
) -> None:
    lut = ledger_factory(lease_check_s=0.1)
    async with RayLedger.connect(lut.name, renew_interval=0.05) as ledger:
        await create(ledger)
        await publish(ledger, 1)
        await ledger.register_owner("live", ttl_s=1.0)
        await ledger.register_owner("dead", ttl_s=1.0)
        await ledger.bind("s-dead", "dead")
        # three ttls: only renewals forwarded by the client keep "live" alive
        with anyio.fail_after(10):
            for _ in range(30):
                ledger.renew_lease("live", {("e0", 1): 1})
                await anyio.sleep(0.1)
        assert (await ledger.bind("s-live", "live")).new
        with pytest.raises(LoraLedgerError) as dead_bind:
            await ledger.bind("s-other", "dead")
        assert dead_bind.value.code == Code.LEASE_EXPIRED
        # the client learns the expiry from a renewal's reply, then refuses locally
        learned: LoraLedgerError | None = None
        with anyio.fail_after(5):
            while learned is None:
                try:
                    ledger.renew_lease("dead")
                except LoraLedgerError as exc:
                    learned = exc
                await anyio.sleep(0.05)
        assert learned.code == Code.LEASE_EXPIRED
        status = await ledger.status()
        assert status.owners == 1
        assert status.sessions_bound == 1  # "dead"'s session was released by the expiry


async def test_a_zombie_life_is_refused_and_its_successor_is_not(ledger_factory: Any) -> None:
    """Two lives of one owner renewing through one client (a worker restarted in the same
    process, its predecessor still renewing): the refusal is charged to the replaced life only,
    even when both renewed in the same window (publisher/renewals.py)."""
    lut = ledger_factory(lease_check_s=0.1)
    async with RayLedger.connect(lut.name, renew_interval=0.05) as ledger:
        await create(ledger)
        await publish(ledger, 1)
        await ledger.register_owner("w", ttl_s=1.0, incarnation="one")
        await ledger.register_owner("w", ttl_s=1.0, incarnation="two")  # replaces "one"
        ledger.renew_lease("w", {("e0", 1): 2}, incarnation="two")
        ledger.renew_lease("w", {("e0", 1): 5}, incarnation="one")  # the same window
        await wait_for(
            "the client to learn that renewals of life one are refused",
            lambda: renewal_refused(ledger, "w", "one", Code.OWNER_RESTARTED),
        )
        # two ttls of renewals by the successor alone keep it alive, never refused
        with anyio.fail_after(10):
            for _ in range(20):
                ledger.renew_lease("w", {("e0", 1): 2}, incarnation="two")
                await anyio.sleep(0.1)
        assert (await ledger.bind("s", "w", incarnation="two")).new


async def _bind_all(ledger: RayLedger, names: list[str], owner: str) -> dict[str, Any]:
    answers: dict[str, Any] = {}

    async def bind(name: str) -> None:
        try:
            answers[name] = await ledger.bind(name, owner)
        except LoraLedgerError as exc:
            answers[name] = exc

    async with anyio.create_task_group() as tg:
        for name in names:
            tg.start_soon(bind, name)
    return answers


async def test_ray_restarts_a_killed_ledger_and_it_replays_every_binding(
    ledger_factory: Any,
) -> None:
    lut = ledger_factory()
    async with RayLedger.connect(lut.name) as ledger:
        await create(ledger)
        await ledger.register_owner("w1", ttl_s=600)
        await publish(ledger, 1)
        early = [f"early{i}" for i in range(40)]
        first = await _bind_all(ledger, early, "w1")
        for name in early[:10]:
            await ledger.release(name, "w1")
        await publish(ledger, 2)
        epoch = (await ledger.status()).epoch

        # kill it while 8 streams of binds keep round trips in flight: Ray restarts it
        late = [f"late{i}" for i in range(80)]
        answered = 0
        quarter = anyio.Event()

        async def stream(names: list[str]) -> None:
            nonlocal answered
            for name in names:
                await ledger.bind(name, "w1")
                answered += 1
                if answered == 20:
                    quarter.set()

        async with anyio.create_task_group() as tg:
            for k in range(8):
                tg.start_soon(stream, late[k::8])
            with anyio.fail_after(10):
                await quarter.wait()
            ray.kill(lut.handle, no_restart=False)
        assert ledger.link.reconnects > 0, "the kill interrupted no call in flight"
        status = await ledger.status()
        assert status.epoch > epoch  # a new controller replayed the log
        assert status.sessions_bound == 30 + 80  # every binding, none twice
        after = await _bind_all(ledger, early + late, "w1")
        for name in early[:10]:
            assert isinstance(after[name], LoraLedgerError)
            assert after[name].code == Code.SESSION_CLOSED
        for name in early[10:]:
            assert (after[name].version_id, after[name].new) == (first[name].version_id, False)
            assert first[name].version_id == 1
        for name in late:
            assert (after[name].version_id, after[name].new) == (2, False)


async def test_a_ledger_recreated_under_its_name_reopens_the_same_file(
    ledger_factory: Any,
) -> None:
    lut = ledger_factory()
    async with RayLedger.connect(lut.name) as ledger:
        await create(ledger)
        await ledger.register_owner("w1", ttl_s=600)
        await publish(ledger, 1)
        bound = await _bind_all(ledger, [f"s{i}" for i in range(20)], "w1")
        lut.restart()  # ray.kill(no_restart=True), then start_ledger again
        again = await _bind_all(ledger, list(bound), "w1")
        assert all(again[n].new is False and again[n].version_id == 1 for n in bound)
        assert ledger.link.reconnects > 0  # the old handle died: looked up by name again
        assert (await ledger.status()).sessions_bound == 20


async def test_a_fenced_ledger_actor_stops_serving_and_says_so(ledger_factory: Any) -> None:
    """A second controller on the same log (another actor name) fences the first: the first
    must stop serving -- refuse every call ``FENCED``, status included, and say so when asked
    who it is -- without exiting (Ray would restart it and it would fence the newcomer in
    turn). It went on answering status and routing from the state it had."""
    lut = ledger_factory(lease_check_s=0.1)
    async with RayLedger.connect(lut.name, deregister_on_exit=False) as ledger:
        await create(ledger)
        await publish(ledger, 1)
        await ledger.register_owner("w1", ttl_s=600.0, incarnation="one")
        await ledger.bind("s1", "w1", incarnation="one")
    before: LedgerInfo = await lut.handle.describe.remote()
    rival_name = f"{lut.name}-rival"
    rival = await anyio.to_thread.run_sync(lambda: start_ledger(lut.config, name=rival_name))
    try:

        async def says_fenced() -> bool:
            return bool(getattr(await lut.handle.describe.remote(), "fenced", ""))

        await wait_for("the first ledger actor to say it is fenced", says_fenced, timeout=30)
        info: LedgerInfo = await lut.handle.describe.remote()
        assert "another controller" in info.fenced
        assert (info.pid, info.epoch) == (before.pid, before.epoch)  # the same life, not restarted
        link = ActorLink(lut.name, reconnect_timeout=0)
        calls: list[tuple[str, tuple[Any, ...]]] = [
            ("status", ()),
            ("routing", ()),
            ("execute_many", ([c.Bind(session="s2", owner="w1", incarnation="one")],)),
            ("renew_leases", ({("w1", "one"): {}},)),
            ("register_owner", ("w2", 30.0, "two")),
        ]
        for method, args in calls:
            with pytest.raises(LoraLedgerError) as refused:
                await link.call(method, *args)
            assert refused.value.code == Code.FENCED, method
        # starting it under its name again does not quietly hand back the fenced actor
        with pytest.raises(LoraLedgerError) as again:
            await anyio.to_thread.run_sync(lambda: start_ledger(lut.config, name=lut.name))
        assert again.value.code == Code.FENCED
        # the newcomer serves the log, bindings included
        async with RayLedger.connect(rival_name) as ledger:
            assert (await ledger.status()).sessions_bound == 1
        assert await anyio.to_thread.run_sync(lambda: stop_ledger(lut.name))  # ends cleanly
    finally:
        ray.kill(rival, no_restart=True)


async def test_an_unreachable_ledger_is_ledger_closed(ray_instance: Any) -> None:
    with pytest.raises(LoraLedgerError) as gone:
        async with RayLedger.connect("nobody-here", reconnect_timeout=0.5):
            pass
    assert gone.value.code == Code.LEDGER_CLOSED


async def test_start_ledger_refuses_to_serve_another_file(
    ledger_factory: Any, tmp_path: Any
) -> None:
    lut = ledger_factory()
    with pytest.raises(LoraLedgerError) as other:
        start_ledger(LedgerConfig(path=str(tmp_path / "other.db")), name=lut.name)
    assert other.value.code == Code.ALREADY_INITIALIZED


async def test_a_trainer_whose_ledger_stays_unreachable_gets_a_publication_error(
    ray_instance: Any,
) -> None:
    """In process, every publication that did not happen is a ``PublicationError``, and a
    training loop skips it (``except PublicationError``). On Ray, a ledger actor unreachable
    past the reconnect timeout was a bare ``LedgerError`` that ended such a loop."""
    config, tensors = make_adapter(1)
    trainer = RayTrainerClient("nobody-here", reconnect_timeout=0.5)
    with pytest.raises(PublicationError) as failed:
        await trainer.publish(tensors, config, step=1)
    assert (failed.value.code, failed.value.kind) == (Code.LEDGER_CLOSED, ErrorKind.RETRYABLE)
    assert failed.value.details["version_id"] == 1


async def test_publishing_needs_a_control_plane(ledger_factory: Any) -> None:
    lut = ledger_factory()  # a bare ledger: nothing drives engines
    config, tensors = make_adapter(1)
    with pytest.raises(LoraLedgerError) as refused:
        await RayTrainerClient(lut.name).publish(tensors, config, step=1)
    assert refused.value.code == Code.INVALID_STATE


def test_a_descriptor_whose_manifest_lies_is_refused(ray_instance: Any) -> None:
    """The ledger records the descriptor's digest, so its manifest must hash to it (the bytes
    themselves are checked by every engine that pulls them:
    tests/publisher/ray/test_adapter_objects.py)."""
    config, tensors = make_adapter(2)
    adapter = AdapterCopy.from_state_dict(tensors, config)
    descriptor = put_adapter(adapter)
    assert check_descriptor(descriptor) is descriptor
    assert (descriptor.digest, descriptor.size_bytes) == (adapter.digest, adapter.size_bytes)
    info = descriptor.manifest.tensors[0]
    lying = msgspec.structs.replace(
        descriptor.manifest,
        tensors=(msgspec.structs.replace(info, sha256="0" * 64), *descriptor.manifest.tensors[1:]),
    )
    with pytest.raises(LoraLedgerError) as refused:
        check_descriptor(dataclasses.replace(descriptor, manifest=lying))
    assert refused.value.code == Code.INVALID_INPUT
    with pytest.raises(LoraLedgerError) as not_one:
        check_descriptor(adapter)
    assert not_one.value.code == Code.INVALID_INPUT
