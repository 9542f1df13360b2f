"""Rollout test rigs: real local engines, a real ledger over a memory log, a fleet, a gateway
with a provenance recorder.

* :func:`rig` -- the ledger alone, on an injected clock, with publication driven step by step
  in the ledger's command order (allocate -> claim_transport -> prepare / transfer / load on
  every engine with PREPARED/READY receipts -> commit; ``stage`` stops before the commit) and
  the reclaim driver swept by the test: every step happens when the test says so.
* :func:`plane_rig` -- the whole :class:`~publisher.drivers.plane.ControlPlane` on the wall clock:
  publications through the trainer facade, continuous reclaim, lease expiry, reconciler.

Engine test doubles wrap a *real* local engine: they only add what cannot be produced on demand
here (a reply lost after the engine did the work, a refused connection, a timestamp).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec
import pytest

from engines.contract import (
    AmbiguousReply,
    Candidate,
    Engine,
    EngineError,
    ErrorCode,
    Generation,
    SamplingParams,
    UnloadReceipt,
)
from engines.local.engine import LocalEngine
from engines.local.tinymodel import make_adapter
from engines.manifest import build_manifest
from evlog.memory import MemoryStore
from publisher.core.ledger import Ledger
from publisher.core.outcomes import Allocated
from publisher.drivers.fleet import Fleet
from publisher.drivers.plane import ControlPlane
from publisher.drivers.reclaim import ReclaimDriver
from publisher.drivers.trainer import TrainerClient
from publisher.gateway import Gateway, LocalView
from publisher.gateway.provenance import MemorySink, ProvenanceRecorder
from tests.engines.contract import aiter_list, buckets_of

# The tiny engine's library warnings (peft calls a deprecated transformers method on every
# injection; it warns when the active adapter is the one being freed): not ours, not news.
ENGINE_WARNINGS = [
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:Adapter .* was active which is now deleted:UserWarning"),
]
PROMPT = (11, 12, 13, 14)
SHORT = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


class Clock:
    """The ledger's time, moved by the test."""

    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Staged:
    version_id: int
    attempt: int
    lora_name: str
    digest: str


@dataclass
class Rig:
    ledger: Ledger
    store: MemoryStore
    clock: Any  # a Clock, or time.time under a control plane
    local: dict[str, LocalEngine]
    fleet: Fleet
    gateway: Gateway
    sink: MemorySink
    recorder: ProvenanceRecorder
    names: dict[int, str] = field(default_factory=dict)
    plane: ControlPlane | None = None

    async def stage(self, version_id: int, *, seed: int | None = None) -> Staged:
        """Everything of a publication but the commit: every engine READY."""
        config, tensors = make_adapter(version_id if seed is None else seed)
        manifest = build_manifest(config, tensors)
        allocated = await self.ledger.allocate(version_id, manifest.digest)
        assert isinstance(allocated, Allocated), allocated
        await self.ledger.claim_transport(version_id, allocated.attempt, "test-publisher")
        candidate = Candidate(
            lora_name=allocated.lora_name,
            digest=manifest.digest,
            attempt=allocated.attempt,
            manifest=manifest,
        )
        for engine_id in allocated.fleet:
            engine = self.local[engine_id]
            incarnation = await engine.incarnation()
            receipt = (allocated.attempt, engine_id, incarnation, manifest.digest)
            await engine.prepare(candidate)
            await self.ledger.record_prepared(version_id, *receipt, allocated.lora_name)
            await engine.transfer(candidate, aiter_list(buckets_of(tensors)))
            await engine.load(candidate)
            await self.ledger.record_ready(version_id, *receipt, allocated.lora_name)
        self.names[version_id] = allocated.lora_name
        return Staged(version_id, allocated.attempt, allocated.lora_name, manifest.digest)

    async def publish(self, version_id: int, *, seed: int | None = None) -> Any:
        """Publish and commit: by hand (the ledger's command order), or through the trainer
        facade and the publication driver when a control plane runs."""
        if self.plane is None:
            staged = await self.stage(version_id, seed=seed)
            return await self.ledger.commit(version_id, staged.attempt)
        config, tensors = make_adapter(version_id if seed is None else seed)
        outcome = await TrainerClient(self.plane).publish(tensors, config=config, step=version_id)
        assert outcome.status == "PUBLISHED", outcome
        assert outcome.lora_name is not None
        self.names[version_id] = outcome.lora_name
        return outcome

    def reclaimer(self) -> ReclaimDriver:
        """The reclaim driver over this rig, with the gateway as its in-flight source; tests
        call ``sweep()`` themselves (a control plane runs it continuously)."""
        if self.plane is not None:
            return self.plane.reclaimer
        return ReclaimDriver(self.ledger, self.fleet, sources=[self.gateway])


@contextlib.asynccontextmanager
async def rig(
    *,
    engines: int = 2,
    capacity: int = 8,
    wrap: Callable[[LocalEngine], Engine] | None = None,
    recorder_capacity: int = 8192,
    timeout: float = 60.0,
    store: MemoryStore | None = None,
) -> AsyncIterator[Rig]:
    """``timeout`` bounds the whole test: a broken guarantee must fail it, never hang it
    (e.g. an unload that waits forever for a request it should never have run under).
    ``store``: the log to use (a test's own MemoryStore subclass); a fresh one by default."""
    clock = Clock()
    store = MemoryStore() if store is None else store
    with anyio.fail_after(timeout):
        async with _rig(clock, store, engines, capacity, wrap, recorder_capacity) as r:
            yield r


@contextlib.asynccontextmanager
async def _rig(
    clock: Clock,
    store: MemoryStore,
    engines: int,
    capacity: int,
    wrap: Callable[[LocalEngine], Engine] | None,
    recorder_capacity: int,
) -> AsyncIterator[Rig]:
    async with contextlib.AsyncExitStack() as stack:
        ledger = await stack.enter_async_context(Ledger.open(store, clock=clock))
        await ledger.create_deployment("dep", prefix="agent", capacity=capacity)
        local: dict[str, LocalEngine] = {}
        for i in range(engines):
            engine = await stack.enter_async_context(LocalEngine(f"e{i}"))
            local[engine.engine_id] = engine
            incarnation = await engine.incarnation()
            await ledger.join_engine(engine.engine_id, incarnation)
            await ledger.repair_engine(engine.engine_id, incarnation)
        fleet = Fleet(wrap(e) if wrap else e for e in local.values())
        for member in fleet:  # a double that owns tasks lives in the rig's block
            if isinstance(member, KeepsRunning):
                await stack.enter_async_context(member)
        sink = MemorySink()
        recorder = await stack.enter_async_context(
            ProvenanceRecorder(sink, capacity=recorder_capacity)
        )
        gateway = Gateway(fleet, LocalView(ledger), gateway_id="gw", recorder=recorder, clock=clock)
        yield Rig(ledger, store, clock, local, fleet, gateway, sink, recorder)


@contextlib.asynccontextmanager
async def plane_rig(
    root: Path,
    *,
    engines: int = 2,
    capacity: int = 8,
    reclaim_tick_s: float = 0.05,
    timeout: float = 300.0,
) -> AsyncIterator[Rig]:
    """The full control plane (publication driver, continuous reclaim with this gateway as
    an in-flight source, reconciler, lease expiry) over real local engines and a memory log,
    on the wall clock."""
    with anyio.fail_after(timeout):
        async with contextlib.AsyncExitStack() as stack:
            local: dict[str, LocalEngine] = {}
            for i in range(engines):
                engine = await stack.enter_async_context(LocalEngine(f"e{i}"))
                local[engine.engine_id] = engine
            store = MemoryStore()
            plane = await stack.enter_async_context(
                ControlPlane.open(
                    store,
                    Fleet(local.values()),
                    deployment="dep",
                    prefix="agent",
                    capacity=capacity,
                    artifact_root=root / "artifacts",
                    reclaim_tick_s=reclaim_tick_s,
                    probe_interval_s=0.5,
                )
            )
            sink = MemorySink()
            recorder = await stack.enter_async_context(ProvenanceRecorder(sink))
            gateway = Gateway(
                plane.fleet, LocalView(plane.ledger), gateway_id="gw", recorder=recorder
            )
            plane.add_inflight_source(gateway)
            yield Rig(
                plane.ledger,
                store,
                time.time,
                local,
                plane.fleet,
                gateway,
                sink,
                recorder,
                plane=plane,
            )


# --- engine doubles (a real engine underneath) ------------------------------------------------


class Recording:
    """A real engine that records what each generate call received and how many reached it."""

    def __init__(self, inner: LocalEngine) -> None:
        self.inner = inner
        self.engine_id = inner.engine_id
        self.kind = inner.kind
        self.transport = inner.transport
        # Its generate takes (and records) caller body fields; the real engine never sees them.
        self.capabilities = msgspec.structs.replace(inner.capabilities, extra_body=True)
        self.calls: list[dict[str, Any]] = []
        self.reached = 0  # generations the real engine actually ran
        self.generated_at: list[float] = []  # when each generation came back from the engine
        self.unload_started: dict[str, float] = {}  # name -> when an unload of it was sent
        self.unloaded_at: dict[str, float] = {}  # name -> when the engine's unload returned
        # names whose unload was sent while requests were still running on them here
        self.unloaded_under_requests: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def unload(self, lora_name: str, *, attempt: int | None = None) -> Any:
        self._unload_sent(lora_name)
        receipt = await self.inner.unload(lora_name, attempt=attempt)
        self.unloaded_at[lora_name] = time.monotonic()
        return receipt

    def _unload_sent(self, lora_name: str) -> None:
        self.unload_started.setdefault(lora_name, time.monotonic())
        if self.inner.refcount(lora_name):
            self.unloaded_under_requests.append(lora_name)

    async def generate(
        self,
        prompt: str | Sequence[int],
        lora_name: str | None,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        extra_body: dict[str, Any] | None = None,
    ) -> Generation:
        self.calls.append(
            {
                "lora_name": lora_name,
                "request_id": request_id,
                "cache_salt": cache_salt,
                "extra_body": extra_body,
            }
        )
        result = await self.inner.generate(
            prompt, lora_name, params, request_id=request_id, cache_salt=cache_salt
        )
        self.reached += 1
        self.generated_at.append(time.monotonic())
        return result


class NonDraining(Recording):
    """An engine whose unload does not drain, as vLLM's: it forgets the name and answers at
    once, while requests already running on the adapter go on (vLLM keeps them going:
    ``tests/integration/test_vllm_engine.py``). The real engine underneath unregisters the
    name at once and drains in its own task; this double answers as soon as the name is gone,
    without waiting for the drain. Against such an engine an unload cannot be a barrier, so
    only the ledger's in-flight rule keeps a version loaded while a request runs on it."""

    async def unload(self, lora_name: str, *, attempt: int | None = None) -> Any:
        self._unload_sent(lora_name)
        if lora_name not in self.inner.loaded_adapters():
            return await self.inner.unload(lora_name, attempt=attempt)  # nothing to drain
        refused: list[EngineError] = []
        async with anyio.create_task_group() as tg:

            async def real_unload() -> None:
                # The engine drains in its own task group: cancelling this wait leaves the
                # drain running. A refusal (a stale attempt) comes before the name goes.
                try:
                    await self.inner.unload(lora_name, attempt=attempt)
                except EngineError as exc:
                    refused.append(exc)
                tg.cancel_scope.cancel()

            tg.start_soon(real_unload)
            while lora_name in self.inner.loaded_adapters():  # noqa: ASYNC110 -- no event
                await anyio.sleep(0.001)
            tg.cancel_scope.cancel()  # forgotten: answer now, whatever still runs on it
        if refused:
            raise refused[0]
        self.unloaded_at[lora_name] = time.monotonic()
        return UnloadReceipt(
            engine_id=self.engine_id,
            incarnation=await self.inner.incarnation(),
            lora_name=lora_name,
            was_loaded=True,
        )


class KeepsRunning(NonDraining):
    """A remote engine that does not drain on unload (:class:`NonDraining`) and learns of a
    caller's cancel only when it is told: the generation runs in the engine's own task group
    (as an HTTP server's handler, or a Ray actor's call), so a caller that is cancelled, times
    out or loses the reply leaves it running. :meth:`abort_request` is the engine's abort by
    request id; it takes effect once the test sets ``abort_lands`` (an engine whose abort
    reaches the running request late, as vLLM and SGLang's do after a step: "the engine kept
    generating ~2 s"), and answers once the request ended. With ``unconfirmable`` the engine
    cannot be asked at all (its abort fails, as over a dead connection)."""

    def __init__(self, inner: LocalEngine) -> None:
        super().__init__(inner)
        self.abort_lands = anyio.Event()
        self.unconfirmable = False
        self.aborts: list[str] = []  # request ids it was asked to end
        self.running = 0  # generations still running on the engine, whoever waits for them
        self._tg: anyio.abc.TaskGroup | None = None

    async def __aenter__(self) -> KeepsRunning:
        self._tg = await anyio.create_task_group().__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(None, None, None)

    async def generate(self, *args: Any, **kwargs: Any) -> Generation:
        assert self._tg is not None, "use it in an `async with` (it owns the engine's tasks)"
        done = anyio.Event()
        outcome: list[Generation | BaseException] = []

        async def run() -> None:
            self.running += 1
            try:
                outcome.append(await Recording.generate(self, *args, **kwargs))
            except Exception as exc:
                outcome.append(exc)
            finally:
                self.running -= 1
                done.set()

        self._tg.start_soon(run)
        await done.wait()  # a cancelled caller stops waiting; the generation goes on
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0]

    async def abort_request(self, request_id: str, lora_name: str | None) -> bool:
        self.aborts.append(request_id)
        if self.unconfirmable:
            raise AmbiguousReply(
                ErrorCode.CONNECTION_LOST, "abort not answered", engine_id=self.engine_id
            )
        await self.abort_lands.wait()
        return await self.inner.abort_request(request_id, lora_name)


class LosesReply(Recording):
    """The engine runs the generation for real, then the reply is lost (a timeout after
    dispatch): the caller sees ``AmbiguousReply(dispatched=True)``."""

    async def generate(self, *args: Any, **kwargs: Any) -> Generation:
        await super().generate(*args, **kwargs)
        raise AmbiguousReply(
            ErrorCode.TIMEOUT, "reply lost after the engine ran it", engine_id=self.engine_id
        )


class EchoesAnother(Recording):
    """Runs the generation for real, then claims another adapter served it (a wrong-adapter
    bug of the kind that looked like staleness for weeks in other RL frameworks)."""

    async def generate(self, *args: Any, **kwargs: Any) -> Generation:
        real = await super().generate(*args, **kwargs)
        return msgspec.structs.replace(real, lora_name="agent@dep-999-0000000000000000")


class Unreachable(Recording):
    """Connection refused before anything was sent (``dispatched=False``)."""

    async def generate(self, *args: Any, **kwargs: Any) -> Generation:
        raise AmbiguousReply(
            ErrorCode.ENGINE_UNREACHABLE,
            "connection refused",
            engine_id=self.engine_id,
            dispatched=False,
        )
