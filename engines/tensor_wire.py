"""SGLang's tensor route, ``POST /load_lora_adapter_from_tensors`` (SGLang >= 0.5.17): the wire.

Shared by the client (:class:`engines.sglang.SGLangEngine` with ``load_via="tensors"``) and the
local engine's SGLang face (:mod:`engines.local.server`), so the two cannot drift. The request
(SGLang's ``LoadLoRAAdapterFromTensorsReqInput``, JSON over HTTP):

=========================  =======================================================================
field                      meaning
=========================  =======================================================================
``lora_name``              the name to register
``config_dict``            the PEFT ``adapter_config.json`` content
``serialized_named_tensors``  one base64 string **per tensor-parallel rank** (TP size from
                           ``/server_info``), each a pickle of ``{tensor name: CPU tensor}``
``expected_checksums``     ``{tensor name: sha256 of the tensor's raw contiguous bytes}``, every
                           tensor listed exactly once (a missing or extra name fails the load)
``load_format``            ``null`` (SGLang also has ``"flattened_bucket"``; see below)
``pinned``                 SGLang's pin flag (the ledger never pins)
=========================  =======================================================================

**By value only.** SGLang decodes with its ``MultiprocessingSerializer``, which also accepts
torch's ``ForkingPickler`` handles (a shared-memory file descriptor or name, a CUDA IPC
handle). Those work only on one host, and only while the producer keeps the tensor alive: a
producer that exits (or a payload that crosses hosts) leaves the engine reading an unlinked
segment. :func:`encode_tensors` therefore pickles plainly (a tensor's storage travels as its
bytes), and :func:`decode_tensors` is an allowlist unpickler that refuses every other global,
handle-based reductions included, so a face that accepts a payload proves it was by value.

The ``"flattened_bucket"`` format packs every tensor into one uint8 tensor plus SGLang's own
metadata classes, which only an ``import sglang`` can unpickle; neither side here produces or
accepts it (the face answers 400), and the per-tensor format costs the same bytes on the wire.

Torch is imported lazily: only a process that uses this route needs it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import pickle
import warnings
from collections.abc import Mapping
from typing import Any, Protocol

import msgspec

from engines.manifest import ManifestError, TensorData, tensor_from_array

ROUTE = "/load_lora_adapter_from_tensors"
TENSOR_ROOT = "__tensor__"  # what /v1/models lists as the root of a tensor-loaded adapter
FIRST_VERSION = (0, 5, 17)  # the per-rank list of payloads (SGLang PR #32580)

_TORCH_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


class PayloadError(ValueError):
    """A payload that is not a by-value pickle of named CPU tensors, or fails its checksums."""


class TensorLoadRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    lora_name: str
    config_dict: dict[str, Any]
    serialized_named_tensors: list[str]
    expected_checksums: dict[str, str] | None = None
    load_format: str | None = None
    pinned: bool = False
    added_tokens_config: dict[str, int] | None = None


def raw_sha256(tensor: TensorData) -> str:
    """SGLang's checksum: sha256 of the raw contiguous bytes (no dtype or shape)."""
    return hashlib.sha256(tensor.data).hexdigest()


def checksums(tensors: Mapping[str, TensorData]) -> dict[str, str]:
    return {name: raw_sha256(t) for name, t in sorted(tensors.items())}


def encode_tensors(tensors: Mapping[str, TensorData]) -> bytes:
    """``{name: CPU tensor}`` pickled by value (storages as bytes, never handles)."""
    out = io.BytesIO()
    _pickle_tensors(tensors, out)
    return out.getvalue()


def _pickle_tensors(tensors: Mapping[str, TensorData], out: _Writable) -> None:
    """Pickle ``{name: CPU tensor}`` by value into ``out`` as it goes: the tensors are views of
    the owned bytes (read only, never copied), and the pickler hands every storage's bytes to
    ``out`` one tensor at a time, so nothing holds the whole pickle unless ``out`` does."""
    import torch

    named = {}
    for name, t in sorted(tensors.items()):
        dtype = getattr(torch, _TORCH_DTYPES[t.dtype])
        if t.data:
            with warnings.catch_warnings():  # read only: the tensor is pickled, never written
                warnings.filterwarnings("ignore", message=".*not writable.*")
                flat = torch.frombuffer(t.data, dtype=torch.uint8)
            value = flat.view(dtype).reshape(t.shape)
        else:
            value = torch.empty(t.shape, dtype=dtype)
        named[name] = value
    pickle.Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(named)


def encode_request_payloads(tensors: Mapping[str, TensorData], tp_size: int) -> list[str]:
    """One base64 payload per TP rank (every rank gets the whole adapter; SGLang shards it)."""
    blob = base64.b64encode(encode_tensors(tensors)).decode("ascii")
    return [blob] * tp_size


class _Writable(Protocol):
    def write(self, data: Any, /) -> int: ...


_B64_SLICE = 3 * 256 * 1024  # base64 encodes 3 bytes at a time: slices a multiple of 3


class _Base64Writer:
    """A file that base64-encodes what is written to it into ``out`` as it arrives (keeping
    the 0-2 bytes that do not yet make a group of 3), so a pickle streams into a JSON string
    without ever existing whole in plain form."""

    def __init__(self, out: io.BytesIO) -> None:
        self._out = out
        self._rest = b""

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = view.nbytes
        if self._rest:
            head = self._rest + bytes(view[: 3 - len(self._rest)])
            view = view[3 - len(self._rest) :]
            if len(head) < 3:
                self._rest = head
                return size
            self._out.write(binascii.b2a_base64(head, newline=False))
        whole = len(view) - len(view) % 3
        for start in range(0, whole, _B64_SLICE):
            self._out.write(
                binascii.b2a_base64(view[start : min(start + _B64_SLICE, whole)], newline=False)
            )
        self._rest = bytes(view[whole:])
        return size

    def close(self) -> None:
        if self._rest:
            self._out.write(binascii.b2a_base64(self._rest, newline=False))
            self._rest = b""


def encode_request_body(
    lora_name: str, config: Mapping[str, Any], tensors: Mapping[str, TensorData], tp_size: int
) -> bytes:
    """The whole JSON body of one tensor load (:class:`TensorLoadRequest`: every rank's payload,
    the checksums, ``pinned`` false), built in one pass and in one buffer: the pickle streams
    through base64 straight into the body, and the other ranks' payloads are copied from the
    first one in slices. Memory: the body (4/3 of the adapter per rank) plus one tensor's
    storage bytes while it is pickled; before, a body held the adapter as a copy, a pickle, its
    base64, a ``str`` of it and the JSON, and each engine built its own."""
    out = io.BytesIO()
    out.write(b'{"lora_name":' + _encoder.encode(lora_name))
    out.write(b',"config_dict":' + _encoder.encode(config))
    out.write(b',"serialized_named_tensors":["')
    start = out.tell()
    encoder = _Base64Writer(out)
    _pickle_tensors(tensors, encoder)
    encoder.close()
    end = out.tell()
    for _ in range(tp_size - 1):
        out.write(b'","')
        for offset in range(start, end, _B64_SLICE):
            with out.getbuffer() as view:  # released before the next write may grow the buffer
                piece = bytes(view[offset : min(offset + _B64_SLICE, end)])
            out.write(piece)
    out.write(b'"],"expected_checksums":' + _encoder.encode(checksums(tensors)))
    out.write(b',"pinned":false}')
    return out.getvalue()  # no copy: the buffer becomes the bytes


_encoder = msgspec.json.Encoder()


class _ByValueUnpickler(pickle.Unpickler):
    """Only what a plain pickle of CPU tensors needs; the inner storage bytes are read with
    torch's own weights-only loader, never a full unpickler."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return torch._utils._rebuild_tensor_v2
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _storage_from_bytes
        if (module, name) == ("collections", "OrderedDict"):
            import collections

            return collections.OrderedDict
        if module.startswith("torch.multiprocessing") or "rebuild" in name:
            raise PayloadError(
                f"{module}.{name}: a handle-based payload (shared memory, file descriptor or "
                "CUDA IPC); only by-value tensors are accepted"
            )
        raise PayloadError(f"{module}.{name} is not allowed in a tensor payload")


def _storage_from_bytes(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=True)


def decode_tensors(blob: bytes) -> dict[str, TensorData]:
    """The named tensors of one rank's payload, refused unless it is a by-value pickle of a
    ``{name: tensor}`` mapping (or a list of ``(name, tensor)`` pairs)."""
    import torch

    try:
        value = _ByValueUnpickler(io.BytesIO(blob)).load()
    except PayloadError:
        raise
    except Exception as exc:  # any unpickling failure of untrusted bytes
        raise PayloadError(f"undecodable tensor payload: {exc!r}") from None
    pairs = list(value.items()) if isinstance(value, Mapping) else value
    if not isinstance(pairs, list):
        raise PayloadError(f"payload is a {type(value).__name__}, not named tensors")
    out: dict[str, TensorData] = {}
    for item in pairs:
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise PayloadError("payload entries must be (name, tensor) pairs")
        name, tensor = item
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise PayloadError(f"payload entry {name!r} is not a named tensor")
        if tensor.device.type != "cpu":
            raise PayloadError(f"{name}: a {tensor.device.type} tensor; only CPU tensors travel")
        if name in out:
            raise PayloadError(f"tensor {name!r} appears twice")
        try:
            out[name] = tensor_from_array(tensor)
        except ManifestError as exc:
            raise PayloadError(f"{name}: {exc}") from None
    if not out:
        raise PayloadError("the payload holds no tensors")
    return out


def decode_request(request: TensorLoadRequest, tp_size: int) -> dict[str, TensorData]:
    """Every rank's payload decoded and checked as SGLang's TP workers do: one per rank, each
    by value, identical tensors, and the checksums (when given) naming exactly those tensors."""
    payloads = request.serialized_named_tensors
    if len(payloads) != tp_size:
        raise PayloadError(f"{len(payloads)} serialized_named_tensors for TP size {tp_size}")
    ranks = []
    for rank, text in enumerate(payloads):
        try:
            blob = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise PayloadError(f"rank {rank}: not base64: {exc}") from None
        ranks.append(decode_tensors(blob))
    tensors = ranks[0]
    if any(other != tensors for other in ranks[1:]):
        raise PayloadError("the ranks' payloads differ")
    expected = request.expected_checksums
    if expected is not None:
        missing = sorted(set(tensors) - set(expected))
        extra = sorted(set(expected) - set(tensors))
        if missing or extra:
            raise PayloadError(
                f"expected_checksums must list every tensor: missing {missing[:3]}, "
                f"extra {extra[:3]}"
            )
        bad = sorted(n for n, t in tensors.items() if raw_sha256(t) != expected[n])
        if bad:
            raise PayloadError(f"checksum mismatch for {len(bad)} tensor(s), e.g. {bad[0]}")
    return tensors
