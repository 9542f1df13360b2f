"""What a publication reads of an adapter, whether or not this process holds its bytes.

In process, the publication driver is handed an
:class:`~publisher.drivers.adapter_copy.AdapterCopy`: the bytes are here, and every staged engine
gets them as buckets. On Ray the driver runs in the ledger actor, and the bytes should not travel
through it (one actor would carry every byte to every engine): the trainer puts them in Ray's object
store once and the driver gets a descriptor instead (:mod:`publisher.ray.adapter_objects`). Both
satisfy :class:`AdapterSource`, so the driver's steps and failure rules are written once.

What differs is *how the bytes reach an engine*. ``buckets`` is either the buckets themselves
(the engine's ``transfer`` gets them) or a :class:`Payload`, which sends them its own way (an
engine actor pulls them from the object store and checks them against the candidate's digest
before anything is staged). ``tensors`` is read for the durable copy (the artifact store) and
may block while it fetches, so the driver reads it in a worker thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol, runtime_checkable

from engines.contract import Bucket, Candidate, Engine
from engines.manifest import Manifest, TensorData


@runtime_checkable
class Payload(Protocol):
    """How an adapter's bytes reach one staged engine when the caller does not hold them.

    ``send`` plays the role of ``engine.transfer`` in the staged protocol (between prepare and
    load) and follows its contract: an :class:`~engines.contract.EngineError` of the right kind
    on failure (clean when nothing was staged, e.g. bytes that do not match the digest)."""

    async def send(self, engine: Engine, candidate: Candidate) -> None: ...


class AdapterSource(Protocol):
    """The adapter a :class:`~publisher.drivers.publication.PublicationDriver` publishes."""

    @property
    def digest(self) -> str: ...

    @property
    def size_bytes(self) -> int: ...

    @property
    def manifest(self) -> Manifest: ...

    @property
    def buckets(self) -> Iterable[Bucket] | Payload:
        """What staged engines get: the buckets, or a payload that sends them."""
        ...

    @property
    def tensors(self) -> Mapping[str, TensorData]:
        """Every tensor, for the artifact store (may block: read it off the event loop)."""
        ...


RestoreBytes = Callable[[Mapping[str, TensorData], int], Iterable[Bucket] | Payload]
"""How the bytes of a restore (a repair reloading a version from the artifact store) reach a
staged engine: ``(tensors, bucket_bytes)`` to the buckets themselves (the default,
:func:`~publisher.drivers.adapter_copy.plan_buckets`) or a :class:`Payload` that sends them its
own way (on Ray: put in the object store once and pulled by the engine actor, so a repair's
bytes do not pass through the ledger actor's calls either). Blocking: called in a worker
thread."""
