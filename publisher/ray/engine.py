"""Engines as Ray actors: :class:`EngineActor` hosts an engine in its own process, and
:class:`RayEngine` is the caller-side handle that implements the
:class:`~engines.contract.Engine` protocol, so a :class:`~publisher.fleet.Fleet` in any
process (the ledger actor's control plane, every rollout worker's gateway) holds it like an
in-process engine.

What the proxy preserves of the contract:

* **Every failure keeps its kind.** An ``EngineError`` raised in the actor comes back as the
  same class with its code (it pickles with its fields). A Ray transport failure (the actor
  died, restarted or is unreachable) proves nothing about what the engine did, so it is an
  :class:`~engines.contract.AmbiguousReply` with ``dispatched=True``: the gateway never
  resends the generation, and the publication driver treats the step as ambiguous.
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

from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, suppress
from typing import Any

import anyio.to_thread
import msgspec
import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError, RayTaskError

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
)
from publisher.adapter_copy import aiter_buckets
from publisher.ray.adapter_objects import pull_tensors, verified_buckets
from publisher.ray.hosting import PortalHost
from publisher.ray.link import DEFAULT_NAMESPACE, unwrap


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
        self._generate_calls += 1

        async def run() -> Generation:
            return await self._engine.generate(
                prompt, lora_name, params, request_id=request_id, cache_salt=cache_salt
            )

        return await self._host.call(run)

    async def generate_calls(self) -> int:
        return self._generate_calls

    async def close(self) -> None:
        """Stop the engine (in-flight generations end with ENGINE_STOPPED)."""
        import anyio.to_thread

        await anyio.to_thread.run_sync(self._host.close)


class RayEngine:
    """Caller-side :class:`~engines.contract.Engine` for an :class:`EngineActor`. Build it
    with :meth:`connect` (asks the actor who it is) or directly when that is known.

    It declares no optional capability: ``generate`` carries no ``extra_body`` across the
    actor. ``endpoint`` is the hosted engine's own HTTP address when it has one (an HTTP
    adapter in the actor): the OpenAI gateway actor sends generations there directly."""

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
        self.capabilities = EngineCapabilities(endpoint=endpoint)

    @classmethod
    async def connect(cls, handle: ActorHandle) -> RayEngine:
        info: EngineInfo = await cls._remote(handle, "describe", "?")
        return cls(handle, info.engine_id, info.kind, info.transport, info.endpoint)  # type: ignore[arg-type]

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            RayEngine,
            (self.handle, self.engine_id, self.kind, self.transport, self.capabilities.endpoint),
        )

    def __repr__(self) -> str:
        return f"RayEngine({self.engine_id!r}, kind={self.kind!r})"

    @staticmethod
    async def _remote(handle: ActorHandle, method: str, engine_id: str, *args: Any) -> Any:
        try:
            return await getattr(handle, method).remote(*args)
        except RayTaskError as exc:
            raise unwrap(exc) from None
        except RayActorError as exc:
            raise AmbiguousReply(
                ErrorCode.CONNECTION_LOST,
                f"engine actor of {engine_id} failed during {method}: {exc}",
                engine_id=engine_id,
            ) from exc

    async def _call(self, method: str, *args: Any) -> Any:
        return await self._remote(self.handle, method, self.engine_id, *args)

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
        """Sent once; a transport failure is ambiguous (``dispatched=True``), never resent."""
        return await self._call(  # type: ignore[no-any-return]
            "generate", prompt, lora_name, params, request_id, cache_salt
        )

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
) -> RayEngine:
    """Start an :class:`EngineActor` named ``name`` and return its proxy once the engine is
    up (blocking). ``max_restarts > 0`` lets Ray restart a crashed engine: it comes back as
    a new incarnation, which the control plane's reconciler repairs before routing to it."""
    options: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "max_restarts": max_restarts,
        "max_task_retries": 0,  # never let Ray resend a generation
        "max_concurrency": 1000,
        "num_cpus": 0,
    }
    if detached:
        options["lifetime"] = "detached"
    handle = ray.remote(EngineActor).options(**options).remote(factory)
    info: EngineInfo = ray.get(handle.describe.remote(), timeout=timeout)
    return RayEngine(handle, info.engine_id, info.kind, info.transport, info.endpoint)  # type: ignore[arg-type]


def stop_engine(engine: RayEngine, *, timeout: float = 30.0) -> None:
    """Stop the engine cleanly, then end its actor (blocking)."""
    with suppress(RayActorError, ray.exceptions.GetTimeoutError):
        ray.get(engine.handle.close.remote(), timeout=timeout)
    ray.kill(engine.handle, no_restart=True)
