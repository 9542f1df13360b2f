"""Adapter content identity: tensors as owned bytes, the per-tensor manifest and THE digest.

The digest (docs/identities.md) is defined in exactly one function, :func:`compute_digest`, used
by the trainer side (the adapter copy), the artifact store (verify on read) and every engine that
receives staged bytes (recompute before load). It covers the canonical config JSON and, for each
tensor name in sorted order, the name and SHA-256(dtype, shape, contiguous bytes). How the bytes
are bucketed for transfer never changes it; any byte or config change does.

Tensors travel as :class:`TensorData` (safetensors dtype code, shape, raw little-endian bytes),
so this module needs neither torch nor a GPU; :func:`tensor_from_array` converts numpy arrays and
torch tensors (including bfloat16) at the edge.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

# safetensors dtype codes -> bytes per element
DTYPE_SIZES: dict[str, int] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}

_NUMPY_TO_CODE = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}
_TORCH_TO_CODE = {**{f"torch.{k}": v for k, v in _NUMPY_TO_CODE.items()}, "torch.bfloat16": "BF16"}

_DIGEST_DOMAIN = b"loraledger-adapter-v1"
_packer = msgspec.msgpack.Encoder()


class ManifestError(ValueError):
    """Adapter content that cannot be described (bad dtype, shape/bytes mismatch, bad config)."""


class TensorData(msgspec.Struct, frozen=True):
    """One tensor as owned bytes. ``data`` is C-contiguous little-endian, len = prod(shape)*size."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self) -> None:
        size = DTYPE_SIZES.get(self.dtype)
        if size is None:
            raise ManifestError(f"unsupported dtype {self.dtype!r} (one of {sorted(DTYPE_SIZES)})")
        if any((not isinstance(d, int)) or d < 0 for d in self.shape):
            raise ManifestError(f"invalid shape {self.shape!r}")
        expected = math.prod(self.shape) * size
        if len(self.data) != expected:
            raise ManifestError(
                f"{self.dtype}{list(self.shape)} needs {expected} bytes, got {len(self.data)}"
            )

    @property
    def nbytes(self) -> int:
        return len(self.data)


class TensorInfo(msgspec.Struct, frozen=True):
    """Manifest entry: what a tensor is, and the checksum an engine recomputes on receipt."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    sha256: str


class Manifest(msgspec.Struct, frozen=True):
    """Config + per-tensor entries (sorted by name) + digest. Small; travels with a candidate."""

    config: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    digest: str

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def tensor(self, name: str) -> TensorInfo:
        for info in self.tensors:
            if info.name == name:
                return info
        raise KeyError(name)


def canonical_config(config: Mapping[str, Any]) -> bytes:
    """Sorted-key compact JSON; refuses what JSON cannot carry exactly (NaN, non-str keys)."""
    try:
        return json.dumps(
            config, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        ).encode()
    except (TypeError, ValueError) as exc:
        raise ManifestError(f"adapter config is not canonical JSON: {exc}") from exc


def tensor_hasher(dtype: str, shape: Iterable[int]) -> hashlib._Hash:
    """The running SHA-256 of one tensor, (dtype, shape) already in: feed it the contiguous
    bytes, in order and in as many pieces as you like (a file streamed in chunks)."""
    return hashlib.sha256(_packer.encode((dtype, list(shape))))


def tensor_checksum(dtype: str, shape: Iterable[int], data: bytes | memoryview) -> str:
    """SHA-256 over (dtype, shape) and the contiguous bytes."""
    h = tensor_hasher(dtype, shape)
    h.update(data)
    return h.hexdigest()


def compute_digest(config: Mapping[str, Any], tensors: Iterable[TensorInfo]) -> str:
    """THE adapter digest: 64 hex chars over the canonical config and the sorted tensor list."""
    entries = sorted((t.name, t.sha256) for t in tensors)
    names = [name for name, _ in entries]
    if len(set(names)) != len(names):
        raise ManifestError("duplicate tensor names")
    return hashlib.sha256(
        _packer.encode((_DIGEST_DOMAIN, canonical_config(config), entries))
    ).hexdigest()


def build_manifest(config: Mapping[str, Any], tensors: Mapping[str, TensorData]) -> Manifest:
    """Describe owned tensors; the digest is computed from the same bytes that will be sent."""
    if not tensors:
        raise ManifestError("an adapter needs at least one tensor")
    config_copy = json.loads(canonical_config(config))
    infos = tuple(
        TensorInfo(
            name=name,
            dtype=t.dtype,
            shape=tuple(t.shape),
            nbytes=t.nbytes,
            sha256=tensor_checksum(t.dtype, t.shape, t.data),
        )
        for name, t in sorted(tensors.items())
    )
    return Manifest(config=config_copy, tensors=infos, digest=compute_digest(config_copy, infos))


def tensor_from_array(array: Any) -> TensorData:
    """Copy a numpy array or a torch tensor (any device, bfloat16 included) into owned bytes."""
    type_name = f"{type(array).__module__}.{type(array).__name__}"
    if type_name.startswith("torch"):
        code = _TORCH_TO_CODE.get(str(array.dtype))
        if code is None:
            raise ManifestError(f"unsupported torch dtype {array.dtype}")
        import torch  # deferred: the core does not need torch

        flat = array.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        return TensorData(code, tuple(int(d) for d in array.shape), flat.numpy().tobytes())
    import numpy as np

    arr = np.asarray(array)
    code = _NUMPY_TO_CODE.get(str(arr.dtype))
    if code is None:
        raise ManifestError(f"unsupported numpy dtype {arr.dtype}")
    little = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
    return TensorData(
        code, tuple(int(d) for d in arr.shape), np.ascontiguousarray(little).tobytes()
    )
