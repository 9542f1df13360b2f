"""Adapter bytes on Ray go through the object store, not through the ledger actor: real actors
(a trainer, the ledger hosting the control plane, two engine actors hosting local engines) on
a local Ray instance.

What is proven, each from the component's own account rather than from a mock:

* the publish call carries a descriptor of a few kilobytes (its size as Ray serializes it) for
  an adapter of a mebibyte; no byte reaches an engine actor inline (``transfer_bucket``), each
  pulls the whole adapter from the object store once; the ledger's process pulls it once too,
  for the durable copy, and that is all it holds of it;
* the engines hold the version under the adapter's digest (their own inventories);
* an object whose bytes do not hash to the descriptor's digest is refused by every engine
  before anything is staged, and the attempt ends FAILED_RETRYABLE with nothing loaded;
* an object whose owner (the trainer) died is refused cleanly by every engine
  (``ADAPTER_BYTES_LOST``): FAILED_RETRYABLE, nothing loaded;
* after the trainer process is gone (and its objects with it), a restarted engine is restored
  from the durable copy and becomes routable again; the restore's bytes go through the object
  store too (put by the ledger actor, pulled by the engine actor), never inline.
"""

from __future__ import annotations

import contextlib
import functools
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import pytest
import ray
from ray.exceptions import OwnerDiedError, RayActorError

from engines.contract import Candidate, CleanRefusal
from engines.local.admission import ServingLimits
from engines.local.engine import LocalEngine
from engines.local.tinymodel import make_adapter
from engines.manifest import TensorData
from publisher.drivers.adapter_copy import AdapterCopy
from publisher.drivers.engine_ops import EngineTimeouts
from publisher.drivers.engine_protocol import stage_and_load
from publisher.drivers.publication import PublicationError
from publisher.ray.adapter_objects import AdapterDescriptor, put_adapter
from publisher.ray.engine import RayEngine, start_engine, stop_engine
from publisher.ray.ledger_actor import LedgerConfig, PlaneConfig, start_ledger, stop_ledger
from publisher.ray.link import ActorLink
from publisher.ray.stored_adapter import ObjectPayload
from publisher.ray.trainer import RayTrainerClient

pytestmark = [pytest.mark.anyio, pytest.mark.filterwarnings("ignore::UserWarning")]

NAMESPACE = "loraledger-test-objects"
RANK = 256  # 8 tensors of 128 KiB: a 1 MiB adapter, far above Ray's inline-argument size
LIMITS = ServingLimits(max_lora_rank=RANK)
TIMEOUTS = EngineTimeouts(probe=10, inventory=20, prepare=30, transfer=60, load=60, unload=60)
PLANE_OPTIONS: dict[str, Any] = {
    "probe_interval_s": 0.2,
    "reclaim_tick_s": 0.1,
    "timeouts": TIMEOUTS,
    "cleanup_timeout": 20.0,
    "bucket_bytes": 256 * 1024,  # several buckets per adapter on the engine side
}


def adapter(seed: int) -> tuple[dict[str, Any], dict[str, TensorData]]:
    return make_adapter(seed, r=RANK)


class TrainerActor:
    """A trainer process: publishes step ``n``'s adapter through :class:`RayTrainerClient`.
    ``keep`` puts one more copy and keeps it, so a test can watch the process's objects die
    with it."""

    def __init__(self, ledger_name: str) -> None:
        self.client = RayTrainerClient(ledger_name, namespace=NAMESPACE)
        self.kept: list[AdapterDescriptor] = []

    async def publish(self, step: int) -> Any:
        config, tensors = adapter(step)
        return await self.client.publish(tensors, config, step=step)

    async def keep(self, step: int) -> list[ray.ObjectRef]:
        config, tensors = adapter(step)
        self.kept.append(put_adapter(AdapterCopy.from_state_dict(tensors, config)))
        return [self.kept[-1].ref]


@dataclass
class Deployment:
    ledger_name: str
    engines: list[RayEngine]
    link: ActorLink

    async def status(self) -> Any:
        return await self.link.call("status")

    async def holds(self, engine: RayEngine) -> dict[str, str | None]:
        inventory = await engine.inventory()
        return {a.lora_name: a.digest for a in inventory.adapters}


@contextlib.asynccontextmanager
async def deployment(
    tmp_path: Path, *, restarts: tuple[int, ...] = (0, 0)
) -> AsyncIterator[Deployment]:
    """Two engine actors (``restarts[i]``: Ray restarts allowed) and a ledger actor hosting the
    control plane over them; everything is stopped by handle afterwards."""
    tag = uuid.uuid4().hex[:8]
    ledger_name = f"ledger-{tag}"
    engines: list[RayEngine] = []
    try:
        for i, max_restarts in enumerate(restarts):
            start: Callable[[], RayEngine] = functools.partial(
                start_engine,
                functools.partial(LocalEngine, f"e{i}", limits=LIMITS),
                name=f"{tag}-e{i}",
                namespace=NAMESPACE,
                max_restarts=max_restarts,
            )
            engines.append(await anyio.to_thread.run_sync(start))
        config = LedgerConfig(
            path=str(tmp_path / "ledger.db"),
            plane=PlaneConfig(
                deployment="dep",
                prefix="agent",
                capacity=4,
                artifact_root=str(tmp_path / "artifacts"),
                engines=tuple(engines),
                options=PLANE_OPTIONS,
            ),
        )
        await anyio.to_thread.run_sync(
            lambda: start_ledger(config, name=ledger_name, namespace=NAMESPACE)
        )
        yield Deployment(ledger_name, engines, ActorLink(ledger_name, namespace=NAMESPACE))
    finally:
        with contextlib.suppress(Exception):
            stop_ledger(ledger_name, namespace=NAMESPACE)
        for engine in engines:
            with contextlib.suppress(Exception):
                stop_engine(engine)


def serialized_size(value: Any) -> int:
    """Bytes Ray ships for ``value`` as a call argument (its own serializer; contained
    ObjectRefs travel as refs)."""
    from ray._private.worker import global_worker

    serialized = global_worker.get_serialization_context().serialize(value)
    return int(serialized.total_bytes)


async def test_the_ledger_actor_moves_decisions_and_engines_pull_the_bytes(
    ray_instance: Any, tmp_path: Path
) -> None:
    config, tensors = adapter(1)
    copy = AdapterCopy.from_state_dict(tensors, config)
    assert copy.size_bytes == 8 * RANK * 128 * 4  # 1 MiB
    # What the trainer's publish call carries, as Ray serializes it: the descriptor.
    argument = serialized_size(put_adapter(copy))
    whole = serialized_size(dict(copy.tensors))
    assert whole >= copy.size_bytes
    assert argument < 8 * 1024 and argument * 100 < copy.size_bytes, (argument, whole)

    async with deployment(tmp_path) as d:
        trainer = ray.remote(TrainerActor).options(num_cpus=0).remote(d.ledger_name)
        try:
            outcome = await trainer.publish.remote(1)
        finally:
            ray.kill(trainer, no_restart=True)
        assert (outcome.status, outcome.digest) == ("PUBLISHED", copy.digest), outcome
        for engine in d.engines:
            assert (await d.holds(engine)) == {outcome.lora_name: copy.digest}
            stats = await engine.transfer_stats()
            # nothing came inline; the actor pulled the adapter itself, once, and kept it
            assert (stats.inline_bytes, stats.pulled_bytes) == (0, copy.size_bytes), stats
            assert (stats.pulls, stats.refused_pulls) == (1, 0), stats
        pulls = await d.link.call("pull_stats")
        # the ledger got one descriptor and pulled the bytes once, for the durable copy
        assert (pulls.descriptors, pulls.pulled_bytes) == (1, copy.size_bytes), pulls
        assert (tmp_path / "artifacts" / copy.digest).is_dir()


async def test_bytes_that_do_not_match_the_digest_are_refused_by_every_engine(
    ray_instance: Any, tmp_path: Path
) -> None:
    config, tensors = adapter(2)
    genuine = AdapterCopy.from_state_dict(tensors, config)
    name, first = next(iter(sorted(tensors.items())))
    flipped = bytes([first.data[0] ^ 1]) + first.data[1:]
    tampered = {**tensors, name: msgspec.structs.replace(first, data=flipped)}

    async with deployment(tmp_path) as d:
        # the genuine manifest, a ref to other bytes of the same shapes
        lying = AdapterDescriptor(manifest=genuine.manifest, ref=ray.put(tampered))
        with pytest.raises(PublicationError) as failed:
            await d.link.call("publish", lying, 2)
        err = failed.value
        assert (err.kind, err.details["cause"]) == ("RETRYABLE", "DIGEST_MISMATCH"), err
        assert err.details["state"] == "FAILED_RETRYABLE"
        for engine in d.engines:
            assert engine.engine_id in err.message
            assert (await d.holds(engine)) == {}  # refused before anything was staged
            stats = await engine.transfer_stats()
            assert (stats.pulls, stats.refused_pulls, stats.pulled_bytes) == (1, 1, 0), stats
        assert not (tmp_path / "artifacts" / genuine.digest).exists()  # no durable copy either

        # the same step with the genuine bytes is a new attempt, and lands
        outcome = await d.link.call("publish", put_adapter(genuine), 2)
        assert (outcome.status, outcome.attempt) == ("PUBLISHED", 2), outcome
        for engine in d.engines:
            assert (await d.holds(engine)) == {outcome.lora_name: genuine.digest}


async def _until_owner_died(ref: ray.ObjectRef) -> None:
    """Wait until Ray freed an object whose owner process ended (about a second)."""
    with anyio.fail_after(30):
        while True:
            try:
                await anyio.to_thread.run_sync(lambda: ray.get(ref, timeout=10))
            except OwnerDiedError:
                return
            await anyio.sleep(0.2)


async def _until_dead(actor: Any) -> None:
    ray.kill(actor, no_restart=True)
    with anyio.fail_after(30):
        while True:
            try:
                await actor.keep.remote(0)
            except RayActorError:
                return
            await anyio.sleep(0.05)


async def test_bytes_whose_owner_died_are_refused_cleanly_and_nothing_is_loaded(
    ray_instance: Any, tmp_path: Path
) -> None:
    """The trainer owns its objects (docs/publication.md): if it dies mid-publication, the
    engines' pulls fail cleanly and the attempt ends FAILED_RETRYABLE."""
    config, tensors = adapter(4)
    genuine = AdapterCopy.from_state_dict(tensors, config)
    async with deployment(tmp_path) as d:
        owner = ray.remote(TrainerActor).options(num_cpus=0).remote(d.ledger_name)
        (ref,) = await owner.keep.remote(4)
        await _until_dead(owner)
        await _until_owner_died(ref)
        orphaned = AdapterDescriptor(manifest=genuine.manifest, ref=ref)
        with pytest.raises(PublicationError) as failed:
            await d.link.call("publish", orphaned, 4)
        err = failed.value
        assert (err.kind, err.details["cause"]) == ("RETRYABLE", "ADAPTER_BYTES_LOST"), err
        assert err.details["state"] == "FAILED_RETRYABLE"
        for engine in d.engines:
            assert (await d.holds(engine)) == {}
            stats = await engine.transfer_stats()
            assert (stats.pulls, stats.refused_pulls) == (1, 1), stats


async def test_a_restarted_engine_is_restored_after_the_trainer_is_gone(
    ray_instance: Any, tmp_path: Path
) -> None:
    config, tensors = adapter(3)
    digest = AdapterCopy.from_state_dict(tensors, config).digest
    async with deployment(tmp_path, restarts=(0, 1)) as d:
        trainer = ray.remote(TrainerActor).options(num_cpus=0).remote(d.ledger_name)
        outcome = await trainer.publish.remote(3)
        assert outcome.status == "PUBLISHED", outcome
        (kept,) = await trainer.keep.remote(3)

        # The trainer process ends, and every object it owned with it.
        await _until_dead(trainer)
        await _until_owner_died(kept)

        # Engine e1's process dies; Ray restarts it empty, as a new incarnation.
        e1 = d.engines[1]
        before = await e1.incarnation()
        ray.kill(e1.handle, no_restart=False)
        with anyio.fail_after(60):
            while True:
                with contextlib.suppress(Exception):
                    if await e1.incarnation() != before:
                        break
                await anyio.sleep(0.1)

        # The reconciler restores v3 from the ledger's durable copy, then routes to it again.
        with anyio.fail_after(60):
            while True:
                status = await d.status()
                member = next(e for e in status.engines if e.engine == "e1")
                if member.incarnation != before and member.routable:
                    break
                await anyio.sleep(0.1)
        assert outcome.lora_name in member.holds
        assert (await d.holds(e1)) == {outcome.lora_name: digest}
        stats = await e1.transfer_stats()  # the new incarnation's: the restore's bytes
        # through the object store, pulled by the engine actor, not inline from the ledger
        size = len(tensors) * RANK * 128 * 4
        assert (stats.inline_bytes, stats.pulled_bytes, stats.pulls) == (0, size, 1), stats
        generation = await e1.generate((1, 2, 3), outcome.lora_name, _greedy())
        assert generation.lora_name == outcome.lora_name


def _greedy() -> Any:
    from engines.contract import SamplingParams

    return SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


async def test_an_engine_in_the_ledgers_process_gets_the_pulled_bytes_verified(
    ray_instance: Any,
) -> None:
    """The payload's other way (an engine that is not an actor, e.g. in the ledger's own
    process): the bytes are pulled here, verified and bucketed; through the whole staged
    procedure, and refused before staging when they do not hash to the digest."""
    config, tensors = adapter(5)
    copy = AdapterCopy.from_state_dict(tensors, config)
    name, first = next(iter(sorted(tensors.items())))
    tampered = {**tensors, name: msgspec.structs.replace(first, data=bytes(first.nbytes))}
    candidate = Candidate(
        lora_name="pulled-5", digest=copy.digest, attempt=1, manifest=copy.manifest
    )
    async with LocalEngine("local-0", limits=LIMITS) as engine:
        with pytest.raises(CleanRefusal) as refused:
            await stage_and_load(
                engine, candidate, ObjectPayload(ray.put(tampered), 256 * 1024), timeouts=TIMEOUTS
            )
        assert refused.value.code == "DIGEST_MISMATCH"
        assert (await engine.inventory()).names() == frozenset()
        loaded = await stage_and_load(
            engine,
            msgspec.structs.replace(candidate, attempt=2),
            ObjectPayload(ray.put(dict(tensors)), 256 * 1024),
            timeouts=TIMEOUTS,
        )
        assert loaded.ready.digest == copy.digest
        entries = {a.lora_name: a.digest for a in loaded.inventory.adapters}
        assert entries == {"pulled-5": copy.digest}


async def test_a_ray_trainer_can_roll_back_as_in_process(ray_instance: Any, tmp_path: Path) -> None:
    """``RayTrainerClient`` claims ``TrainerClient``'s API, yet had no ``allow_rollback``: the
    explicit rollback that ``VERSION_REGRESSION`` tells a trainer to mean was impossible on
    Ray."""
    async with deployment(tmp_path) as d:
        client = RayTrainerClient(d.ledger_name, namespace=NAMESPACE)
        config, tensors = adapter(3)
        assert (await client.publish(tensors, config, step=3)).status == "PUBLISHED"
        config, tensors = adapter(2)
        with pytest.raises(PublicationError) as refused:
            await client.publish(tensors, config, step=2)
        assert refused.value.code == "VERSION_REGRESSION"
        meant = await client.publish(tensors, config, step=2, allow_rollback=True)
        assert meant.status == "PUBLISHED", meant
        assert (await d.status()).default == 2
