"""A safetensors weights file used without loading it: its layout (the header, checked), its
manifest computed in bounded memory, single tensors read by offset.

Why: an adapter's bytes can reach ``serve`` as the weights file itself, streamed from a trainer
on another host, and ``serve`` must check the digest before the bytes count as the adapter,
then feed engines from the stored file, without ever holding the whole adapter in memory (64
MiB is a small adapter; the store admits 8 GiB). The digest is
:func:`engines.manifest.compute_digest` over the tensors the file holds, so it is the one
``read_adapter_dir`` + ``build_manifest`` give for the same directory, whatever the file's
tensor order or header padding.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (every tensor's
dtype, shape and ``data_offsets`` into the data section, optionally ``__metadata__``), then the
data section. :func:`read_layout` refuses what the ``safetensors`` library would refuse (gaps,
overlaps, a data section longer or shorter than the tensors, sizes that disagree with shapes)
plus what the artifact store cannot carry (a dtype outside :data:`engines.manifest.DTYPE_SIZES`),
each as a :class:`~engines.manifest.ManifestError` naming the problem.

Every function takes an open binary file (the caller opens it: a regular file, never a
symlink or a FIFO, see ``engines.artifacts.open_regular``) and reads at explicit offsets, so
memory stays at :data:`CHUNK_BYTES` per call (one tensor for :func:`read_tensor`).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from typing import Any

import msgspec

from engines.manifest import (
    DTYPE_SIZES,
    Manifest,
    ManifestError,
    TensorData,
    TensorInfo,
    canonical_config,
    compute_digest,
    tensor_hasher,
)

CHUNK_BYTES = 1024 * 1024  # what one read holds while a file is hashed or sent
_LENGTH = struct.Struct("<Q")


class TensorSpan(msgspec.Struct, frozen=True):
    """Where one tensor's bytes are in the file: ``start`` is an absolute file offset."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    nbytes: int


class WeightsLayout(msgspec.Struct, frozen=True):
    """A checked header: the file's size and every tensor's span, sorted by name."""

    size: int
    spans: tuple[TensorSpan, ...]

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.spans)

    def span(self, name: str) -> TensorSpan:
        for s in self.spans:
            if s.name == name:
                return s
        raise KeyError(name)


def read_exactly(fd: int, offset: int, n: int) -> bytes:
    """``n`` bytes at ``offset``; a file that ends first is a ``ManifestError``."""
    parts, done = [], 0
    while done < n:
        part = os.pread(fd, n - done, offset + done)
        if not part:
            raise ManifestError(f"the file ends at {offset + done} bytes, before {offset + n}")
        parts.append(part)
        done += len(part)
    return b"".join(parts)


def read_layout(fd: int, *, max_header_bytes: int) -> WeightsLayout:
    """The checked layout of the safetensors file open at ``fd`` (see the module docstring)."""
    size = os.fstat(fd).st_size
    if size < _LENGTH.size:
        raise ManifestError(f"{size} bytes is not a safetensors file")
    (header_len,) = _LENGTH.unpack(read_exactly(fd, 0, _LENGTH.size))
    if header_len > max_header_bytes or _LENGTH.size + header_len > size:
        raise ManifestError(
            f"header of {header_len} bytes (file of {size}, at most {max_header_bytes})"
        )
    raw = read_exactly(fd, _LENGTH.size, header_len)
    if not raw.startswith(b"{"):
        raise ManifestError("the header is not a JSON object")
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ManifestError(f"the header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ManifestError("the header is not a JSON object")
    data_start = _LENGTH.size + header_len
    entries = _entries(header)
    spans, end = [], 0
    for name, dtype, shape, begin, stop in sorted(entries, key=lambda e: (e[3], e[4])):
        if begin != end:
            raise ManifestError(f"tensor {name!r} starts at {begin}, not at {end}: gap or overlap")
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        if stop - begin != nbytes:
            raise ManifestError(f"tensor {name!r}: {dtype}{list(shape)} needs {nbytes} bytes")
        spans.append(TensorSpan(name, dtype, shape, data_start + begin, nbytes))
        end = stop
    if data_start + end != size:
        raise ManifestError(f"the tensors cover {data_start + end} bytes, the file holds {size}")
    if not spans:
        raise ManifestError("an adapter needs at least one tensor")
    return WeightsLayout(size=size, spans=tuple(sorted(spans, key=lambda s: s.name)))


def _entries(header: Mapping[str, Any]) -> list[tuple[str, str, tuple[int, ...], int, int]]:
    """Every tensor entry as (name, dtype, shape, begin, end), each field checked."""
    out: list[tuple[str, str, tuple[int, ...], int, int]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise ManifestError("__metadata__ must map strings to strings")
            continue
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise ManifestError(f"tensor {name!r}: needs exactly dtype, shape and data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPE_SIZES:
            raise ManifestError(f"tensor {name!r}: dtype {dtype!r} (one of {sorted(DTYPE_SIZES)})")
        if not isinstance(shape, list) or not all(_count(d) for d in shape):
            raise ManifestError(f"tensor {name!r}: shape {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_count(o) for o in offsets)
            or offsets[0] > offsets[1]
        ):
            raise ManifestError(f"tensor {name!r}: data_offsets {offsets!r}")
        out.append((name, dtype, tuple(shape), offsets[0], offsets[1]))
    return out


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def file_manifest(config: Mapping[str, Any], fd: int, layout: WeightsLayout) -> Manifest:
    """The manifest (and digest) of ``config`` with the tensors of the file at ``fd``, each
    hashed in chunks of :data:`CHUNK_BYTES`, in file order."""
    checksums: dict[str, str] = {}
    for span in sorted(layout.spans, key=lambda s: s.start):
        h = tensor_hasher(span.dtype, span.shape)
        for offset in range(span.start, span.start + span.nbytes, CHUNK_BYTES):
            h.update(read_exactly(fd, offset, min(CHUNK_BYTES, span.start + span.nbytes - offset)))
        checksums[span.name] = h.hexdigest()
    infos = tuple(
        TensorInfo(
            name=s.name, dtype=s.dtype, shape=s.shape, nbytes=s.nbytes, sha256=checksums[s.name]
        )
        for s in layout.spans
    )
    canonical = json.loads(canonical_config(config))
    return Manifest(config=canonical, tensors=infos, digest=compute_digest(canonical, infos))


def read_tensor(fd: int, span: TensorSpan) -> TensorData:
    """One tensor's bytes, read at its span."""
    return TensorData(span.dtype, span.shape, read_exactly(fd, span.start, span.nbytes))
