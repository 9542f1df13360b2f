"""Engines as Ray actors: :class:`EngineActor` hosts an engine in its own process, and
:class:`RayEngine` is the caller-side handle that implements the
:class:`~engines.contract.Engine` protocol, so a :class:`~publisher.drivers.fleet.Fleet` in any
process (the ledger actor's control plane, every rollout worker's gateway) holds it like an
in-process engine.

What the proxy preserves of the contract:

* **Every failure keeps its kind.** An ``EngineError`` raised in the actor comes back as the
  same class with its code (it pickles with its fields). A Ray transport failure (the actor
  died, restarted or is unreachable) proves nothing about what the engine did, so it is an
  :class:`~engines.contract.AmbiguousReply` with ``dispatched=True``: the gateway never
  resends the generation, and the publication driver treats the step as ambiguous.
* **A dead actor is remembered, and told apart.** Ray raises ``ActorDiedError`` only for an
  actor that will not come back (killed for good, restarts used up): the call that found out
  is ambiguous with code ``ENGINE_GONE``, and every later call on this handle is refused
  *before anything is sent* (``ENGINE_GONE``, ``dispatched=False``), so a gateway tries
  another holder and the reconciler's probe suspends the engine at once instead of counting
  failed probes for ``suspend_after_s`` (docs/engines.md#engines-as-ray-actors).
  ``ActorUnavailableError`` (the actor is restarting, or unreachable for a moment) is
  ``CONNECTION_LOST``; until a call on the handle succeeds again, a generation is preceded by
  an incarnation probe (at most ``recheck_timeout`` seconds) and refused unsent
  (``ENGINE_UNREACHABLE``, ``dispatched=False``) if the actor still does not answer: a turn
  is then served by another holder instead of being lost in the restart.
* **Bounded calls stay bounded.** The drivers wrap engine calls in deadlines; cancelling the
  await of a Ray call cancels nothing in the engine (a cancelled caller never half-does an
  engine operation, the local engine's own rule).
* **Staged transfer streams.** ``transfer`` sends one bucket per round trip as the caller's
  iterator yields them, so at most one bucket is in flight in the object store per transfer.
* **Or the actor pulls.** ``transfer_object`` hands the actor the ref of an adapter the trainer
  put in the object store (:mod:`publisher.ray.adapter_objects`): the actor fetches the bytes
  itself (node to node, not through the caller), refuses them cleanly (``DIGEST_MISMATCH``)
  unless they hash to the candidate's digest, and only then stages them. This is how a
  publication on Ray reaches engines without the ledger actor carrying any byte.

The proxy pickles (an actor handle and three strings), so it can be handed to other actors.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, suppress
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import ray
from ray.actor import ActorHandle
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from engines.contract import (
    AmbiguousReply,
    Bucket,
    Candidate,
    CleanRefusal,
    Engine,
    EngineCapabilities,
    ErrorCode,
    Generation,
    Inventory,
    Receipt,
    SamplingParams,
    Transport,
    UnloadReceipt,
    ends_requests,
)
from engines.drain import DEFAULT_DRAIN_TIMEOUT_S, Drain
from evlog.errors import INVALID_INPUT, InvalidInput
from publisher.drivers.adapter_copy import aiter_buckets
from publisher.logs import get_logger
from publisher.ray.adapter_objects import pull_tensors, verified_buckets
from publisher.ray.hosting import PortalHost
from publisher.ray.link import DEFAULT_NAMESPACE, unwrap

# How long a generation on a handle that was just unavailable waits for a probe first.
RECHECK_TIMEOUT_S = 1.0
# How long start_engine waits for the name of an engine actor it killed to be free again.
NAME_RELEASE_S = 10.0

log = get_logger("loraledger.ray")


class EngineInfo(msgspec.Struct, frozen=True, kw_only=True):
    engine_id: str
    kind: str
    transport: str
    endpoint: str = ""  # the hosted engine's own HTTP address, if it has one


class TransferStats(msgspec.Struct, frozen=True, kw_only=True):
    """Adapter bytes that reached an engine actor, by way (observability; the tests' proof
    that publication bytes bypass the ledger): ``inline_bytes`` came inside ``transfer_bucket``
    calls (from whoever called), ``pulled_bytes`` were fetched from the object store by the
    actor itself and verified; ``refused_pulls`` counts pulls refused (wrong digest, lost)."""

    inline_bytes: int = 0
    pulled_bytes: int = 0
    pulls: int = 0
    refused_pulls: int = 0


async def _one(bucket: Bucket) -> AsyncIterator[Bucket]:
    yield bucket


class EngineActor:
    """Hosts the engine that ``factory()`` builds (an async context manager yielding an
    ``Engine``, e.g. ``functools.partial(LocalEngine, "e0")``) for the actor's whole life.

    Create it with :func:`start_engine`. Counts the generations that reached it
    (``generate_calls``), which is how tests prove nothing above it ever resent one."""

    def __init__(self, factory: Callable[[], AbstractAsyncContextManager[Engine]]) -> None:
        self._host: PortalHost[Engine] = PortalHost(factory, name="engine")
        self._engine = self._host.value
        self._drain = Drain(self._engine.engine_id)  # generations admitted; closed by close()
        self._generate_calls = 0
        self._inline_bytes = self._pulled_bytes = self._pulls = self._refused_pulls = 0

    async def describe(self) -> EngineInfo:
        engine = self._engine
        return EngineInfo(
            engine_id=engine.engine_id,
            kind=engine.kind,
            transport=engine.transport,
            endpoint=engine.capabilities.endpoint,
        )

    async def actor_name(self) -> tuple[str, str]:
        """This actor's name and namespace (``""`` for an unnamed actor): how a restarted
        ledger actor finds it again (publisher/ray/engine_book.py)."""
        context = ray.get_runtime_context()
        return context.get_actor_name() or "", context.namespace

    async def incarnation(self) -> str:
        return await self._host.call(self._engine.incarnation)

    async def inventory(self) -> Inventory:
        return await self._host.call(self._engine.inventory)

    async def prepare(self, candidate: Candidate) -> Receipt:
        return await self._host.call(self._engine.prepare, candidate)

    async def transfer_bucket(self, candidate: Candidate, bucket: Bucket) -> None:
        self._inline_bytes += sum(t.tensor.nbytes for t in bucket.tensors)
        await self._host.call(self._engine.transfer, candidate, _one(bucket))

    async def transfer_object(
        self,
        candidate: Candidate,
        refs: list[ray.ObjectRef],
        bucket_bytes: int,
    ) -> None:
        """The staged ``transfer`` step with the bytes pulled from the object store: ``refs``
        holds one ref (in a list, so Ray hands it over unresolved and the pull happens here,
        where its failure is classified). The digest is recomputed from the pulled bytes before
        the engine sees any of them; a mismatch or a lost object is a clean refusal."""
        engine_id = self._engine.engine_id
        self._pulls += 1
        try:
            tensors = await pull_tensors(refs[0], engine_id)
            buckets = await anyio.to_thread.run_sync(
                verified_buckets, tensors, candidate, bucket_bytes, engine_id
            )
        except CleanRefusal:
            self._refused_pulls += 1
            raise
        self._pulled_bytes += sum(t.nbytes for t in tensors.values())
        await self._host.call(self._engine.transfer, candidate, aiter_buckets(buckets))

    async def transfer_stats(self) -> TransferStats:
        return TransferStats(
            inline_bytes=self._inline_bytes,
            pulled_bytes=self._pulled_bytes,
            pulls=self._pulls,
            refused_pulls=self._refused_pulls,
        )

    async def load(self, candidate: Candidate) -> Receipt:
        return await self._host.call(self._engine.load, candidate)

    async def unload(self, lora_name: str, attempt: int | None) -> UnloadReceipt:
        async def run() -> UnloadReceipt:
            return await self._engine.unload(lora_name, attempt=attempt)

        return await self._host.call(run)

    async def generate(
        self,
        prompt: str | Sequence[int],
        lora_name: str | None,
        params: SamplingParams,
        request_id: str | None,
        cache_salt: str | None,
    ) -> Generation:
        if self._drain.draining:  # refused before the engine sees it: another holder serves it
            raise self._drain.refused()
        self._generate_calls += 1

        async def run() -> Generation:
            return await self._engine.generate(
                prompt, lora_name, params, request_id=request_id, cache_salt=cache_salt
            )

        with self._drain.running():
            return await self._host.call(run)

    async def abort_request(self, request_id: str, lora_name: str | None) -> bool:
        """The hosted engine's confirmation (:class:`~engines.contract.EndsRequests`); False
        when it cannot confirm. Cancelling a Ray call cancels nothing here, so a caller that
        gave up on a generation asks this to end it."""
        ender = ends_requests(self._engine)
        if ender is None:
            return False
        return await self._host.call(ender.abort_request, request_id, lora_name)

    async def generate_calls(self) -> int:
        return self._generate_calls

    async def close(self, drain_timeout: float = 0.0) -> int:
        """Drain, then stop the engine: new generations are refused ``ENGINE_DRAINING`` (a
        gateway sends them to another holder), the ones running finish, at most
        ``drain_timeout`` seconds; those still running then end with ENGINE_STOPPED. Returns
        how many that was (0: drained)."""
        import anyio.to_thread

        self._drain.begin()
        left = await self._drain.wait(drain_timeout)
        await anyio.to_thread.run_sync(self._host.close)
        return left


class RayEngine:
    """Caller-side :class:`~engines.contract.Engine` for an :class:`EngineActor`. Build it
    with :meth:`connect` (asks the actor who it is) or directly when that is known.

    ``generate`` carries no ``extra_body`` across the actor. ``endpoint`` is the hosted
    engine's own HTTP address when it has one (an HTTP adapter in the actor): the OpenAI
    gateway actor sends generations there directly. It confirms a request's end
    (``confirms_end``): the actor asks its engine, and an actor known dead for good runs
    nothing any more.

    Each proxy object remembers what its calls learned about the actor (gone for good, or
    unavailable since the last answer; see the module docstring); a copy sent to another
    process starts with a clean slate and learns it again from its own first call."""

    def __init__(
        self,
        handle: ActorHandle,
        engine_id: str,
        kind: str,
        transport: Transport,
        endpoint: str = "",
    ):
        self.handle = handle
        self.engine_id = engine_id
        self.kind = kind
        self.transport: Transport = transport
        self.capabilities = EngineCapabilities(endpoint=endpoint, confirms_end=True)
        self.recheck_timeout = RECHECK_TIMEOUT_S
        self._gone: str | None = None  # why the actor is known dead for good
        self._unavailable = False  # the last transport failure left it restarting/unreachable

    @classmethod
    async def connect(cls, handle: ActorHandle) -> RayEngine:
        info: EngineInfo = await handle.describe.remote()
        return cls(handle, info.engine_id, info.kind, info.transport, info.endpoint)  # type: ignore[arg-type]

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            RayEngine,
            (self.handle, self.engine_id, self.kind, self.transport, self.capabilities.endpoint),
        )

    def __repr__(self) -> str:
        return f"RayEngine({self.engine_id!r}, kind={self.kind!r}, actor={self.actor_id[:12]})"

    @property
    def actor_id(self) -> str:
        """The Ray actor behind this handle (a replacement actor has another id)."""
        actor_id = getattr(self.handle, "_actor_id", None)
        return actor_id.hex() if actor_id is not None else ""

    @property
    def gone(self) -> bool:
        """Whether a call found the actor dead for good (``ActorDiedError``)."""
        return self._gone is not None

    async def _call(self, method: str, *args: Any) -> Any:
        if self._gone is not None:
            raise AmbiguousReply(
                ErrorCode.ENGINE_GONE,
                f"engine actor of {self.engine_id} is gone ({self._gone}); {method} not sent",
                engine_id=self.engine_id,
                dispatched=False,
            )
        try:
            result = await getattr(self.handle, method).remote(*args)
        except RayTaskError as exc:
            self._unavailable = False  # the actor answered (with an error)
            raise unwrap(exc) from None
        except ActorDiedError as exc:
            self._gone = str(exc).splitlines()[-1][:300]
            raise AmbiguousReply(
                ErrorCode.ENGINE_GONE,
                f"engine actor of {self.engine_id} died during {method}: {self._gone}",
                engine_id=self.engine_id,
            ) from exc
        except RayActorError as exc:  # ActorUnavailableError and any other transport loss
            self._unavailable = isinstance(exc, ActorUnavailableError) or self._unavailable
            raise AmbiguousReply(
                ErrorCode.CONNECTION_LOST,
                f"engine actor of {self.engine_id} failed during {method}: {exc}",
                engine_id=self.engine_id,
            ) from exc
        self._unavailable = False
        return result

    async def _reachable_before_sending(self, method: str) -> None:
        """After an ``ActorUnavailableError``: prove the actor answers again before a call
        that must not be lost (a generation), or refuse it unsent."""
        if not self._unavailable or self._gone is not None:
            return
        try:
            with anyio.fail_after(self.recheck_timeout):
                await self._call("incarnation")
        except (AmbiguousReply, TimeoutError) as exc:
            code = (
                exc.code
                if isinstance(exc, AmbiguousReply) and exc.code == ErrorCode.ENGINE_GONE
                else ErrorCode.ENGINE_UNREACHABLE
            )
            raise AmbiguousReply(
                code,
                f"engine actor of {self.engine_id} did not answer a probe since it was "
                f"unavailable; {method} not sent",
                engine_id=self.engine_id,
                dispatched=False,
            ) from exc

    async def incarnation(self) -> str:
        return await self._call("incarnation")  # type: ignore[no-any-return]

    async def inventory(self) -> Inventory:
        return await self._call("inventory")  # type: ignore[no-any-return]

    async def prepare(self, candidate: Candidate) -> Receipt:
        return await self._call("prepare", candidate)  # type: ignore[no-any-return]

    async def transfer(self, candidate: Candidate, buckets: AsyncIterable[Bucket]) -> None:
        async for bucket in buckets:
            await self._call("transfer_bucket", candidate, bucket)

    async def transfer_object(
        self,
        candidate: Candidate,
        ref: ray.ObjectRef,
        bucket_bytes: int,
    ) -> None:
        """``transfer`` of an adapter in the object store: the actor pulls and verifies it
        (:meth:`EngineActor.transfer_object`); only the ref crosses from this process."""
        await self._call("transfer_object", candidate, [ref], bucket_bytes)

    async def transfer_stats(self) -> TransferStats:
        """How many adapter bytes reached the engine actor, inline and pulled."""
        return await self._call("transfer_stats")  # type: ignore[no-any-return]

    async def load(self, candidate: Candidate) -> Receipt:
        return await self._call("load", candidate)  # type: ignore[no-any-return]

    async def unload(self, lora_name: str, *, attempt: int | None = None) -> UnloadReceipt:
        return await self._call("unload", lora_name, attempt)  # type: ignore[no-any-return]

    async def generate(
        self,
        prompt: str | Sequence[int],
        lora_name: str | None,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> Generation:
        """Sent once; a transport failure is ambiguous (``dispatched=True``), never resent.
        Refused unsent (``dispatched=False``) when the actor is known gone, or was unavailable
        and does not answer a probe now."""
        await self._reachable_before_sending("generate")
        return await self._call(  # type: ignore[no-any-return]
            "generate", prompt, lora_name, params, request_id, cache_salt
        )

    async def abort_request(self, request_id: str, lora_name: str | None) -> bool:
        """End ``request_id`` in the actor's engine and answer whether it confirms the end
        (:class:`~engines.contract.EndsRequests`). An actor dead for good (its process is
        gone) confirms it: nothing of that process runs."""
        try:
            return await self._call("abort_request", request_id, lora_name)  # type: ignore[no-any-return]
        except AmbiguousReply as exc:
            if exc.code == ErrorCode.ENGINE_GONE:
                return True
            raise

    async def generate_calls(self) -> int:
        """How many generations reached the engine actor (for audits and tests)."""
        return await self._call("generate_calls")  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        """A handle owns nothing: stopping the engine is its owner's job (:func:`stop_engine`)."""


def start_engine(
    factory: Callable[[], AbstractAsyncContextManager[Engine]],
    *,
    name: str,
    namespace: str = DEFAULT_NAMESPACE,
    max_restarts: int = 0,
    detached: bool = False,
    timeout: float = 300.0,
    num_cpus: float = 0,
    num_gpus: float = 0,
    resources: Mapping[str, float] | None = None,
    scheduling_strategy: Any = None,
    node_id: str | None = None,
    max_concurrency: int = 1000,
) -> RayEngine:
    """Start an :class:`EngineActor` named ``name`` in ``namespace`` and return its proxy once
    the engine is up (blocking).

    Placement: ``num_cpus`` / ``num_gpus`` / ``resources`` are the actor's Ray resource
    request (the engine's process holds them for its life: give a GPU engine its GPUs here,
    so Ray sets ``CUDA_VISIBLE_DEVICES`` for it); ``scheduling_strategy`` is any Ray
    scheduling strategy (a placement group's, ``"SPREAD"``, a node affinity), and
    ``node_id`` is the shorthand for a hard node affinity (not both). ``max_restarts > 0``
    lets Ray restart a crashed engine: it comes back as a new incarnation behind the same
    handle, which the control plane's reconciler repairs before routing to it; with the
    default 0 a crash is final and the engine is suspended (docs/engines.md).

    An engine that is not up within ``timeout`` seconds (``GetTimeoutError``), or whose start
    fails, is killed before this raises, and its name is free again: a retry under the same
    name starts a new actor, and nothing keeps the resources asked for."""
    if node_id is not None and scheduling_strategy is not None:
        raise InvalidInput(INVALID_INPUT, "give node_id or scheduling_strategy, not both")
    if num_cpus < 0 or num_gpus < 0 or max_concurrency < 1:
        raise InvalidInput(
            INVALID_INPUT, "num_cpus and num_gpus must be >= 0, max_concurrency >= 1"
        )
    options: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "max_restarts": max_restarts,
        "max_task_retries": 0,  # never let Ray resend a generation
        "max_concurrency": max_concurrency,
        "num_cpus": num_cpus,
    }
    if num_gpus:
        options["num_gpus"] = num_gpus
    if resources:
        options["resources"] = dict(resources)
    if node_id is not None:
        scheduling_strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
    if scheduling_strategy is not None:
        options["scheduling_strategy"] = scheduling_strategy
    if detached:
        options["lifetime"] = "detached"
    handle = ray.remote(EngineActor).options(**options).remote(factory)
    try:
        info: EngineInfo = ray.get(handle.describe.remote(), timeout=timeout)
    except BaseException:
        # Not started in time (or its start failed): nobody will get a handle to this actor,
        # so end it here, or it keeps its resources and its name (a detached one forever)
        # and a retry under the same name is refused.
        _end_unstarted(handle, name, namespace)
        raise
    return RayEngine(handle, info.engine_id, info.kind, info.transport, info.endpoint)  # type: ignore[arg-type]


def _end_unstarted(handle: ActorHandle, name: str, namespace: str) -> None:
    """Kill an engine actor whose start was given up, and wait (bounded) until its name is
    free again, so the caller's retry under that name starts a new actor."""
    with suppress(RayActorError, ValueError):
        ray.kill(handle, no_restart=True)
    deadline = time.monotonic() + NAME_RELEASE_S
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            return  # the name is free
        time.sleep(0.05)
    log.warning("ray.engine_name_still_held", actor=name, namespace=namespace)


def stop_engine(
    engine: RayEngine, *, timeout: float = 30.0, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S
) -> None:
    """Drain the engine (new generations refused ``ENGINE_DRAINING``, the running ones
    finish, at most ``drain_timeout`` seconds), stop it cleanly (``timeout``), then end its
    actor (blocking). Route it away first (the ledger actor's ``remove_engine``), so that
    nothing new is sent to it meanwhile."""
    with suppress(RayActorError, ray.exceptions.GetTimeoutError):
        ray.get(engine.handle.close.remote(drain_timeout), timeout=timeout + drain_timeout)
    ray.kill(engine.handle, no_restart=True)
