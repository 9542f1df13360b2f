"""AdapterCopy: the owned, frozen copy of one adapter that a publication sends.

Why a copy first: a trainer keeps stepping its optimizer while a publication is under way. If
the bytes sent to engine B were read from the live parameters a few milliseconds after the
bytes sent to engine A, the two engines would serve different weights under one immutable name
and one digest: a half-updated fleet. So the copy takes every tensor into immutable ``bytes``
(numpy, torch on any device, bfloat16 included, via :func:`engines.manifest.tensor_from_array`),
copies the config into canonical JSON, and computes the manifest and digest with
:func:`engines.manifest.build_manifest` -- the single digest function -- *from that copy*.
Every byte that later reaches an engine or the artifact store is read from these objects;
nothing keeps a reference to the trainer's tensors.

("Snapshot" in this code base means the projection cache of the event log, ``evlog.store``.)

Buckets are planned once, here: tensors in name order, packed greedily up to ``bucket_bytes``
(default 64 MiB), never split; a tensor larger than a bucket travels alone in its own bucket.
Bucketing never changes the digest.
"""

from __future__ import annotations

import enum
import json
import types
from collections.abc import Iterable, Mapping
from typing import Any

from engines.contract import Bucket, BucketTensor
from engines.manifest import (
    Manifest,
    ManifestError,
    TensorData,
    build_manifest,
    canonical_config,
    tensor_from_array,
)

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024


class AdapterCopyError(ValueError):
    """The adapter cannot be copied (non-JSON config, unsupported tensor, no tensors)."""


def plan_buckets(
    tensors: Mapping[str, TensorData], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> tuple[Bucket, ...]:
    """Pack tensors (sorted by name) into buckets of at most ``bucket_bytes``; a tensor is
    never split, and one larger than ``bucket_bytes`` gets a bucket of its own."""
    if bucket_bytes < 1:
        raise AdapterCopyError(f"bucket_bytes {bucket_bytes} must be >= 1")
    buckets: list[Bucket] = []
    current: list[BucketTensor] = []
    size = 0
    for name in sorted(tensors):
        t = tensors[name]
        if current and size + t.nbytes > bucket_bytes:
            buckets.append(Bucket(len(buckets), tuple(current)))
            current, size = [], 0
        current.append(BucketTensor(name, t))
        size += t.nbytes
    if current:
        buckets.append(Bucket(len(buckets), tuple(current)))
    return tuple(buckets)


def normalize_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON-only deep copy of a PEFT config: sets become sorted lists, enums their values,
    tuples lists. Anything else that JSON cannot carry exactly is refused (it would make the
    digest depend on a ``repr``)."""
    if not isinstance(config, Mapping):
        raise AdapterCopyError(f"adapter config must be a mapping, not {type(config).__name__}")
    value = _jsonable(config, "config")
    try:
        return json.loads(canonical_config(value))  # type: ignore[no-any-return]
    except ManifestError as exc:
        raise AdapterCopyError(str(exc)) from exc


def _jsonable(value: Any, path: str) -> Any:
    if isinstance(value, enum.Enum):
        return _jsonable(value.value, path)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise AdapterCopyError(f"{path} has a non-string key {key!r}")
            out[key] = _jsonable(item, f"{path}.{key}")
        return out
    if isinstance(value, set | frozenset):
        items = [_jsonable(item, path) for item in value]
        try:
            return sorted(items)
        except TypeError as exc:
            raise AdapterCopyError(f"{path} is a set of unorderable values") from exc
    if isinstance(value, list | tuple):
        return [_jsonable(item, f"{path}[{i}]") for i, item in enumerate(value)]
    raise AdapterCopyError(
        f"{path} holds a {type(value).__name__}, which JSON cannot carry exactly"
    )


def _owned(name: Any, value: Any) -> TensorData:
    if not isinstance(name, str) or not name:
        raise AdapterCopyError(f"tensor names must be non-empty strings, got {name!r}")
    try:
        if isinstance(value, TensorData):
            # already owned bytes; re-wrap anything that is not exactly ``bytes`` (a bytearray
            # or memoryview could still be written to by whoever handed it over)
            if type(value.data) is bytes:
                return value
            return TensorData(value.dtype, tuple(value.shape), bytes(value.data))
        return tensor_from_array(value)
    except ManifestError as exc:
        raise AdapterCopyError(f"tensor {name!r}: {exc}") from exc


class AdapterCopy:
    """An immutable adapter: canonical config, owned tensors, manifest, digest and buckets.

    Build it with :meth:`from_state_dict` or :meth:`from_peft_model`. All attributes are
    read-only; ``tensors`` is a read-only mapping of :class:`TensorData` (immutable ``bytes``),
    and ``config`` returns a fresh copy on every access.
    """

    __slots__ = ("_buckets", "_config", "_manifest", "_tensors")

    def __init__(
        self,
        config: Mapping[str, Any],
        tensors: Mapping[str, TensorData],
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        owned = {name: _owned(name, t) for name, t in tensors.items()}
        if not owned:
            raise AdapterCopyError("an adapter needs at least one tensor")
        canonical = normalize_config(config)
        try:
            manifest = build_manifest(canonical, owned)
        except ManifestError as exc:
            raise AdapterCopyError(str(exc)) from exc
        self._config = canonical
        self._tensors = types.MappingProxyType(owned)
        self._manifest = manifest
        self._buckets = plan_buckets(owned, bucket_bytes)

    def __setattr__(self, name: str, value: Any) -> None:
        if hasattr(self, "_buckets"):
            raise AttributeError("an AdapterCopy is immutable")
        object.__setattr__(self, name, value)

    # --- construction --------------------------------------------------------------------

    @classmethod
    def from_state_dict(
        cls,
        state_dict: Mapping[str, Any],
        config: Mapping[str, Any],
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> AdapterCopy:
        """``{peft key: numpy array | torch tensor | TensorData}`` plus the PEFT config."""
        if not isinstance(state_dict, Mapping):
            raise AdapterCopyError(f"state dict must be a mapping, not {type(state_dict).__name__}")
        return cls(config, state_dict, bucket_bytes=bucket_bytes)

    @classmethod
    def from_peft_model(
        cls,
        model: Any,
        *,
        adapter_name: str = "default",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> AdapterCopy:
        """The adapter ``adapter_name`` of a peft model: ``get_peft_model_state_dict`` (keys as
        peft saves them) and its ``peft_config``, marked ``inference_mode`` as peft's
        ``save_pretrained`` does."""
        from peft import get_peft_model_state_dict  # deferred: the core does not need peft

        peft_config = getattr(model, "peft_config", None)
        if not isinstance(peft_config, Mapping) or adapter_name not in peft_config:
            raise AdapterCopyError(f"model has no peft adapter named {adapter_name!r}")
        config = dict(peft_config[adapter_name].to_dict())
        config["inference_mode"] = True
        state = get_peft_model_state_dict(model, adapter_name=adapter_name)
        return cls(config, state, bucket_bytes=bucket_bytes)

    # --- reading ---------------------------------------------------------------------------

    @property
    def config(self) -> dict[str, Any]:
        return json.loads(json.dumps(self._config))  # type: ignore[no-any-return]

    @property
    def tensors(self) -> Mapping[str, TensorData]:
        return self._tensors

    @property
    def manifest(self) -> Manifest:
        return self._manifest

    @property
    def digest(self) -> str:
        return self._manifest.digest

    @property
    def size_bytes(self) -> int:
        return self._manifest.total_bytes

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        return self._buckets

    def __repr__(self) -> str:
        return (
            f"AdapterCopy(digest={self.digest[:16]}, tensors={len(self._tensors)}, "
            f"bytes={self.size_bytes}, buckets={len(self._buckets)})"
        )


async def aiter_buckets(buckets: Iterable[Bucket]):  # type: ignore[no-untyped-def]
    """The async iterable ``Engine.transfer`` takes, over already planned buckets."""
    for bucket in buckets:
        yield bucket
