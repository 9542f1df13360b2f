"""The content-addressed artifact store: one immutable PEFT directory per adapter digest.

Layout: ``<root>/<digest>/adapter_config.json`` + ``adapter_model.safetensors``, which stock
SGLang, vLLM and peft all load by path. Rules, each one a lesson engines taught (docs/engines.md):

* written atomically (temp dir inside the root, fsync every file and the directory, rename),
  so an engine never reads half a directory;
* verified against the digest when read, so a corrupted file is refused, never served;
* never overwritten: putting a digest that exists verifies the existing copy and reuses it;
* filled from tensors in memory (:meth:`ArtifactStore.put`) or from a weights file received
  whole beside it (:meth:`ArtifactStore.adopt`: an adapter uploaded to ``serve``), which is
  checked against its digest in bounded memory before it counts (:mod:`engines.weights_file`);
* deleted only on request (vLLM re-reads adapters from disk whenever its cache misses, and
  SGLang reloads an unloaded name from its path: a directory must outlive every reference).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import msgspec
import numpy as np
import safetensors

from engines.manifest import (
    Manifest,
    ManifestError,
    TensorData,
    TensorInfo,
    build_manifest,
    compute_digest,
    tensor_checksum,
    tensor_hasher,
)
from engines.weights_file import CHUNK_BYTES, file_manifest, read_layout

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

_CODE_TO_SAFETENSORS = {
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
_REQUIRED_CONFIG = ("r", "lora_alpha", "target_modules")


class ArtifactError(ValueError):
    """An adapter directory that cannot be used. ``code`` matches the engine error codes."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def serialize_safetensors(tensors: Mapping[str, TensorData]) -> bytes:
    """The safetensors file bytes for owned tensors (any dtype, bfloat16 included)."""
    keep_alive = []
    specs = {}
    for name, t in tensors.items():
        buf = np.frombuffer(t.data, dtype=np.uint8) if t.data else np.zeros(1, np.uint8)
        keep_alive.append(buf)  # the serializer reads raw pointers: keep buffers referenced
        specs[name] = safetensors.TensorSpec(
            dtype=_CODE_TO_SAFETENSORS[t.dtype],
            shape=list(t.shape),
            data_ptr=int(buf.ctypes.data),
            data_len=len(t.data),
        )
    blob = safetensors.serialize(specs, None)
    del keep_alive
    return bytes(blob)


def deserialize_safetensors(blob: bytes) -> dict[str, TensorData]:
    """Parse safetensors bytes; a truncated or corrupt file is an ``INVALID_ADAPTER``."""
    try:
        entries = safetensors.deserialize(blob)
        return {
            name: TensorData(info["dtype"], tuple(info["shape"]), bytes(info["data"]))
            for name, info in entries
        }
    except (safetensors.SafetensorError, ManifestError, KeyError, ValueError) as exc:
        raise ArtifactError("INVALID_ADAPTER", f"unreadable safetensors: {exc}") from exc


class Shaped(Protocol):
    """What :func:`validate_adapter` reads of a tensor: its shape (tensors in memory, a weights
    file's spans and an engine's declared shapes all have one)."""

    @property
    def shape(self) -> tuple[int, ...]: ...


def validate_adapter(config: Mapping[str, Any], tensors: Mapping[str, Shaped]) -> None:
    """Refuse what no engine could serve: missing config keys, tensors that do not match the
    declared rank or target modules, non-LoRA keys."""
    missing = [k for k in _REQUIRED_CONFIG if k not in config]
    if missing:
        raise ArtifactError("INVALID_ADAPTER", f"adapter_config.json lacks {missing}")
    rank = config["r"]
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise ArtifactError("INVALID_ADAPTER", f"rank r={rank!r} must be a positive int")
    targets = config["target_modules"]
    if isinstance(targets, str):
        targets = [targets]
    if not tensors:
        raise ArtifactError("INVALID_ADAPTER", "adapter has no tensors")
    for name, t in tensors.items():
        if ".lora_A." not in name and ".lora_B." not in name:
            raise ArtifactError("INVALID_ADAPTER", f"tensor {name!r} is not a LoRA A/B weight")
        module = name.split(".lora_")[0].rsplit(".", 1)[-1]
        if "all-linear" not in targets and module not in targets:
            raise ArtifactError(
                "INVALID_ADAPTER", f"tensor {name!r} targets {module!r}, not in {targets}"
            )
        if len(t.shape) != 2:
            raise ArtifactError("INVALID_ADAPTER", f"tensor {name!r} has shape {t.shape}")
        rank_dim = t.shape[0] if ".lora_A." in name else t.shape[1]
        if rank_dim != rank:
            raise ArtifactError(
                "INVALID_ADAPTER", f"tensor {name!r} has rank {rank_dim}, config says r={rank}"
            )


MAX_CONFIG_BYTES = 1024 * 1024  # an adapter_config.json is a few hundred bytes
MAX_WEIGHTS_BYTES = 8 * 1024**3  # the default bound when no manifest declares the size
# A safetensors file is an 8-byte length, a JSON header, then exactly the tensor bytes; the
# header names every tensor with dtype, shape and offsets: allow generously for it.
HEADER_ALLOWANCE = 8 + 1024 * 1024


def read_bounded(path: Path, limit: int) -> bytes:
    """The bytes of ``path`` if it is a regular file (not a symlink, FIFO, device or directory)
    of at most ``limit`` bytes; otherwise ``INVALID_ADAPTER`` naming why.

    Why each refusal: a file symlink to ``/dev/zero`` grew the engine to 6.7 GB (and SIGTERM
    could not stop the read); a FIFO blocked the reading thread, and with it every later
    load; a file symlink pointing outside the artifact root was read (the root confines
    directories, a symlinked file escaped it). ``O_NOFOLLOW`` refuses the symlink, ``O_NONBLOCK``
    makes opening a FIFO return at once so ``fstat`` can refuse it, and the read stops at the
    size ``fstat`` reported (plus one byte, to notice a file that grew)."""
    fd = open_regular(path)
    try:
        info = os.fstat(fd)
        if info.st_size > limit:
            raise ArtifactError(
                "INVALID_ADAPTER", f"{path} holds {info.st_size} bytes, more than {limit}"
            )
        chunks, left = [], info.st_size + 1
        while left > 0:
            chunk = os.read(fd, min(left, 16 * 1024 * 1024))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) != info.st_size:
            raise ArtifactError("INVALID_ADAPTER", f"{path} changed size while it was read")
        return data
    finally:
        os.close(fd)


def open_at_most(path: Path, limit: int) -> tuple[int, int]:
    """:func:`open_regular`, refusing a file of more than ``limit`` bytes (``INVALID_ADAPTER``):
    the descriptor and the file's size. The caller closes it."""
    fd = open_regular(path)
    size = os.fstat(fd).st_size
    if size > limit:
        os.close(fd)
        raise ArtifactError("INVALID_ADAPTER", f"{path} holds {size} bytes, more than {limit}")
    return fd, size


def _copy_regular(source: Path, target: Path, limit: int) -> None:
    """Copy ``source`` to a new file ``target`` (fsynced) one chunk at a time, with the checks
    of :func:`read_bounded`: a regular file of at most ``limit`` bytes that does not change
    size while it is copied."""
    fd, size = open_at_most(source, limit)
    try:
        copied, left = 0, size + 1
        with open(target, "xb") as out:
            while left > 0:
                chunk = os.read(fd, min(left, CHUNK_BYTES))
                if not chunk:
                    break
                out.write(chunk)
                copied += len(chunk)
                left -= len(chunk)
            out.flush()
            os.fsync(out.fileno())
        if copied != size:
            raise ArtifactError("INVALID_ADAPTER", f"{source} changed size while it was read")
    finally:
        os.close(fd)


def open_regular(path: Path) -> int:
    """A read-only descriptor of ``path`` if it is a regular file, refusing a symlink, FIFO,
    device or directory as ``INVALID_ADAPTER`` (why: :func:`read_bounded`); a missing file is
    ``FileNotFoundError``. The caller closes it."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as exc:  # ELOOP: the last component is a symlink
        raise ArtifactError(
            "INVALID_ADAPTER", f"{path} is not a regular file inside the adapter dir: {exc}"
        ) from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ArtifactError("INVALID_ADAPTER", f"{path} is not a regular file")
    return fd


@contextlib.contextmanager
def _reading(root: Path) -> Iterator[None]:
    """A failure to read the adapter directory ``root`` as the ``INVALID_ADAPTER`` naming it."""
    try:
        yield
    except FileNotFoundError as exc:
        raise ArtifactError("INVALID_ADAPTER", f"{root} is not a PEFT adapter: {exc}") from exc
    except NotADirectoryError as exc:
        raise ArtifactError("INVALID_ADAPTER", f"{root} is not a directory: {exc}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ArtifactError("INVALID_ADAPTER", f"{root}/{CONFIG_FILE} is not JSON: {exc}") from exc


def _read_config(root: Path) -> dict[str, Any]:
    config = json.loads(read_bounded(root / CONFIG_FILE, MAX_CONFIG_BYTES))
    if not isinstance(config, dict):
        raise ArtifactError("INVALID_ADAPTER", f"{root}/{CONFIG_FILE} is not a JSON object")
    return config


def read_adapter_dir(
    path: str | os.PathLike[str], *, max_weights_bytes: int = MAX_WEIGHTS_BYTES
) -> tuple[dict[str, Any], dict[str, TensorData]]:
    """Read and validate any PEFT LoRA directory (config + safetensors). Only regular files
    are read (:func:`read_bounded`), the weights at most ``max_weights_bytes`` (a caller that
    knows the manifest passes its declared total plus :data:`HEADER_ALLOWANCE`)."""
    root = Path(path)
    with _reading(root):
        config = _read_config(root)
        blob = read_bounded(root / WEIGHTS_FILE, max_weights_bytes)
    tensors = deserialize_safetensors(blob)
    validate_adapter(config, tensors)
    return config, tensors


def weights_manifest(
    config: Mapping[str, Any], weights: Path, *, max_weights_bytes: int = MAX_WEIGHTS_BYTES
) -> Manifest:
    """The manifest of ``config`` with the weights file ``weights``, checked as
    :func:`read_adapter_dir` checks a directory (the same refusals, ``INVALID_ADAPTER``) but
    streamed: memory stays at one chunk (:mod:`engines.weights_file`) whatever the size."""
    fd, _ = open_at_most(weights, max_weights_bytes)
    try:
        layout = read_layout(fd, max_header_bytes=HEADER_ALLOWANCE)
        validate_adapter(config, {span.name: span for span in layout.spans})
        manifest = file_manifest(config, fd, layout)
    except ManifestError as exc:
        raise ArtifactError("INVALID_ADAPTER", f"{weights}: {exc}") from exc
    finally:
        os.close(fd)
    try:  # the library's own reading of the header, as every engine will read it (no data read)
        with safetensors.safe_open(str(weights), framework="numpy"):
            pass
    except (safetensors.SafetensorError, OSError) as exc:
        raise ArtifactError("INVALID_ADAPTER", f"unreadable safetensors: {exc}") from exc
    return manifest


class AdapterFiles(msgspec.Struct, frozen=True, kw_only=True):
    """A PEFT directory described without loading its weights: what an upload sends."""

    config: dict[str, Any]
    weights: str  # the weights file's path
    weights_bytes: int  # its size: what an upload sends
    manifest: Manifest

    @property
    def digest(self) -> str:
        return self.manifest.digest


def describe_adapter_dir(
    path: str | os.PathLike[str], *, max_weights_bytes: int = MAX_WEIGHTS_BYTES
) -> AdapterFiles:
    """Read ``path``'s config and stream its weights once to compute the manifest: the same
    checks and digest as :func:`read_adapter_dir` + ``build_manifest``, in bounded memory."""
    root = Path(path)
    weights = root / WEIGHTS_FILE
    with _reading(root):
        config = _read_config(root)
        manifest = weights_manifest(config, weights, max_weights_bytes=max_weights_bytes)
        size = weights.stat().st_size
    return AdapterFiles(config=config, weights=str(weights), weights_bytes=size, manifest=manifest)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def weights_header(
    tensors: Iterable[tuple[str, str, tuple[int, ...], int]],
) -> tuple[bytes, dict[str, int]]:
    """The first bytes of a safetensors file holding ``(name, dtype, shape, nbytes)`` in that
    order (the length, then the JSON header padded with spaces to 8 bytes, as the library
    writes it) and each tensor's offset in the data section that follows."""
    header: dict[str, Any] = {}
    offsets: dict[str, int] = {}
    offset = 0
    for name, dtype, shape, nbytes in tensors:
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offsets[name] = offset
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, offsets


def write_weights_hashed(path: Path, tensors: Mapping[str, TensorData]) -> tuple[TensorInfo, ...]:
    """Write the safetensors file of ``tensors`` (name order, header padded to 8 bytes as the
    library pads it) to the new file ``path``, fsynced, hashing every tensor chunk by chunk as
    it is written: what was written, described (one pass over the bytes, no copy of them)."""
    names = sorted(tensors)
    head, _ = weights_header(
        (n, tensors[n].dtype, tuple(tensors[n].shape), tensors[n].nbytes) for n in names
    )
    infos = []
    with open(path, "xb") as f:
        f.write(head)
        for name in names:
            t = tensors[name]
            hasher = tensor_hasher(t.dtype, t.shape)
            view = memoryview(t.data)
            for start in range(0, len(view), CHUNK_BYTES):
                chunk = view[start : start + CHUNK_BYTES]
                hasher.update(chunk)
                f.write(chunk)
            infos.append(TensorInfo(name, t.dtype, tuple(t.shape), t.nbytes, hasher.hexdigest()))
        f.flush()
        os.fsync(f.fileno())
    return tuple(infos)


def _check_digest(manifest: Manifest, infos: tuple[TensorInfo, ...]) -> None:
    """``DIGEST_MISMATCH`` unless ``infos`` (the bytes at hand, hashed) give the manifest's
    digest."""
    digest = compute_digest(manifest.config, infos)
    if digest != manifest.digest:
        raise ArtifactError(
            "DIGEST_MISMATCH",
            f"tensors hash to {digest[:16]}, manifest says {manifest.digest[:16]}",
        )


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class ArtifactStore:
    """Immutable PEFT directories keyed by digest under one root (local disk or shared FS)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def path_for(self, digest: str) -> Path:
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ArtifactError("INVALID_ADAPTER", f"digest {digest!r} is not 64 lowercase hex")
        return self.root / digest

    def contains(self, digest: str) -> bool:
        return (self.path_for(digest) / WEIGHTS_FILE).exists()

    def digests(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and len(p.name) == 64)

    def resolve(self, path: str | os.PathLike[str]) -> Path:
        """Map an engine-supplied path to a directory of this store, refusing anything outside
        it (``..``, symlinks out, absolute paths elsewhere)."""
        candidate = Path(path)
        if not candidate.is_absolute():
            candidate = self.root / candidate
        try:
            resolved = candidate.resolve()
        except (ValueError, OSError) as exc:  # a NUL byte, a symlink loop: not a store path
            raise ArtifactError(
                "PATH_OUTSIDE_STORE", f"{path!r} is not a usable path: {exc}"
            ) from exc
        if resolved.parent != self.root:
            raise ArtifactError("PATH_OUTSIDE_STORE", f"{path} is not a directory of {self.root}")
        return resolved

    def put(self, manifest: Manifest, tensors: Mapping[str, TensorData]) -> Path:
        """Write the adapter once; an existing directory is verified and reused, never rewritten.

        The bytes must match the manifest: the digest is recomputed from ``tensors`` and must
        equal ``manifest.digest`` (a trainer-side bug must not publish something else). One
        pass: each tensor is hashed as it is written (:func:`write_weights_hashed`), and the
        directory is renamed into place only once the digest of what was written matches; a
        mismatch leaves nothing behind. (Hashing first, then serializing the whole file in
        memory, then writing it read the adapter three times and held it twice.)"""
        validate_adapter(manifest.config, tensors)
        target = self.path_for(manifest.digest)
        if target.exists():
            _check_digest(manifest, build_manifest(manifest.config, tensors).tensors)
            self.verify(manifest.digest)  # the existing copy
            return target

        def fill(tmp: Path) -> None:
            _check_digest(manifest, write_weights_hashed(tmp / WEIGHTS_FILE, tensors))

        return self._install(manifest, fill)

    def begin(self, manifest: Manifest) -> StagedWeights:
        """A directory of ``manifest`` being received tensor by tensor (an engine-host agent's
        buckets): a temp dir in the root whose weights file is laid out from the manifest, so
        each tensor is written once, at its place, as it arrives; nothing is held in memory.
        :meth:`StagedWeights.commit` fsyncs it once and renames it into place."""
        validate_adapter(manifest.config, {t.name: t for t in manifest.tensors})
        self.path_for(manifest.digest)  # a digest that names no directory is refused here
        tmp = Path(tempfile.mkdtemp(prefix=f".{manifest.digest[:16]}-", dir=self.root))
        try:
            return StagedWeights(self, manifest, tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def ensure(self, manifest: Manifest, tensors: Callable[[], Mapping[str, TensorData]]) -> Path:
        """The directory of ``manifest.digest``: an existing one is verified (streamed) and
        reused without calling ``tensors`` (bytes uploaded before, or a source whose bytes are
        elsewhere, are not fetched again); otherwise :meth:`put` of ``tensors()``."""
        if self.contains(manifest.digest):
            self.verify(manifest.digest)
            return self.path_for(manifest.digest)
        return self.put(manifest, tensors())

    def adopt(self, config: Mapping[str, Any], weights: Path, digest: str) -> Path:
        """Make the weights file ``weights`` (on this store's filesystem: it is moved, not
        copied) the directory of ``digest``, once its bytes hash to it (streamed): otherwise
        ``DIGEST_MISMATCH`` naming both digests, or ``INVALID_ADAPTER``, and nothing is
        stored. A digest already stored is verified and kept; ``weights`` is then removed."""
        target = self.path_for(digest)
        manifest = weights_manifest(config, weights)
        if manifest.digest != digest:
            raise ArtifactError(
                "DIGEST_MISMATCH",
                f"the bytes received hash to {manifest.digest}, not to the digest {digest} "
                "they were sent as",
            )
        if target.exists():
            self.verify(digest)
            weights.unlink()
            return target

        def fill(tmp: Path) -> None:
            with open(weights, "rb") as f:
                os.fsync(f.fileno())
            weights.rename(tmp / WEIGHTS_FILE)

        return self._install(manifest, fill)

    def copy_dir(
        self, path: str | os.PathLike[str], *, max_weights_bytes: int = MAX_WEIGHTS_BYTES
    ) -> Manifest:
        """Copy the PEFT directory ``path`` into the store and return its manifest (its digest
        names the stored directory; an existing one is verified and kept). Streamed: the
        weights file is copied chunk by chunk into a temp directory of the store, then checked
        and hashed from that copy (:func:`weights_manifest`) and moved into place, so memory
        holds one chunk whatever the size (reading the file whole, then its tensors, then a
        copy of them held a 512 MiB adapter three times over). Hashing the copy, not the
        source, makes the digest that of the bytes stored even if the directory changes while
        it is read (a trainer writing its next step there). The same refusals as
        :func:`read_adapter_dir` (``INVALID_ADAPTER``, naming ``path``'s files)."""
        root = Path(path)
        tmp = Path(tempfile.mkdtemp(prefix=".copy-", dir=self.root))
        copied = tmp / WEIGHTS_FILE
        try:
            with _reading(root):
                config = _read_config(root)
                _copy_regular(root / WEIGHTS_FILE, copied, max_weights_bytes)
            try:
                manifest = weights_manifest(config, copied, max_weights_bytes=max_weights_bytes)
            except ArtifactError as exc:  # name the caller's file, not the copy
                message = exc.message.replace(str(copied), str(root / WEIGHTS_FILE))
                raise ArtifactError(exc.code, message) from None
            if self.contains(manifest.digest):
                self.verify(manifest.digest)
            else:

                def fill(target: Path) -> None:
                    copied.rename(target / WEIGHTS_FILE)

                self._install(manifest, fill)
            return manifest
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _install(self, manifest: Manifest, fill: Callable[[Path], None]) -> Path:
        """Write a directory atomically: the config and what ``fill`` puts in a temp dir
        inside the root, fsynced, then renamed into place (a concurrent writer of the same
        digest may win: its copy is verified instead)."""
        tmp = Path(tempfile.mkdtemp(prefix=f".{manifest.digest[:16]}-", dir=self.root))
        try:
            fill(tmp)
            return self._finish(manifest, tmp)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def _finish(self, manifest: Manifest, tmp: Path) -> Path:
        """Add the config to the temp dir ``tmp`` (weights already written and fsynced), fsync
        the directory, rename it into place and fsync the root: one fsync per file and per
        directory, all at the end."""
        target = self.path_for(manifest.digest)
        _write_file(tmp / CONFIG_FILE, json.dumps(manifest.config, sort_keys=True).encode())
        _fsync_dir(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not target.exists():
                raise
            self.verify(manifest.digest)  # a concurrent writer won; same bytes by digest
        _fsync_dir(self.root)
        return target

    def weights_path(self, digest: str) -> Path:
        return self.path_for(digest) / WEIGHTS_FILE

    def verify(self, digest: str) -> Manifest:
        """The directory's manifest, recomputed from its files in bounded memory; it must hash
        to the directory's name (``DIGEST_MISMATCH`` otherwise)."""
        path = self.path_for(digest)
        with _reading(path):
            manifest = weights_manifest(_read_config(path), path / WEIGHTS_FILE)
        if manifest.digest != digest:
            raise ArtifactError(
                "DIGEST_MISMATCH", f"{digest[:16]} content hashes to {manifest.digest[:16]}"
            )
        return manifest

    def open(self, digest: str) -> tuple[Manifest, dict[str, TensorData]]:
        """Read and verify: the recomputed digest must equal the directory's name."""
        config, tensors = read_adapter_dir(self.path_for(digest))
        manifest = build_manifest(config, tensors)
        if manifest.digest != digest:
            raise ArtifactError(
                "DIGEST_MISMATCH", f"{digest[:16]} content hashes to {manifest.digest[:16]}"
            )
        return manifest, tensors

    def delete(self, digest: str) -> bool:
        """Remove a directory (only once no engine or request can reference it)."""
        target = self.path_for(digest)
        if not target.exists():
            return False
        trash = Path(tempfile.mkdtemp(prefix=".trash-", dir=self.root))
        target.rename(trash / digest)  # atomic disappearance, then the slow delete
        shutil.rmtree(trash, ignore_errors=True)
        return True


class StagedWeights:
    """One adapter directory being filled tensor by tensor (:meth:`ArtifactStore.begin`).

    The weights file is created at its full size with the header the manifest implies, and
    :meth:`write` puts one tensor's bytes at its offset, once they hash to the manifest's
    checksum (a tensor that does not is refused and never touches the file, so a stray or
    corrupt bucket cannot spoil bytes already accepted). :meth:`commit` needs every tensor,
    recomputes the digest from the checksums taken on the way (no re-read), fsyncs the file
    and the directory once, and renames the directory into place. :meth:`discard` removes
    it. Blocking methods: call them in a worker thread."""

    def __init__(self, store: ArtifactStore, manifest: Manifest, tmp: Path) -> None:
        self.store = store
        self.manifest = manifest
        self.tmp = tmp
        self._infos = {t.name: t for t in manifest.tensors}
        self._written: dict[str, str] = {}
        head, self._offsets = weights_header(
            (t.name, t.dtype, tuple(t.shape), t.nbytes)
            for t in sorted(manifest.tensors, key=lambda t: t.name)
        )
        self._data_start = len(head)
        with open(tmp / WEIGHTS_FILE, "xb") as f:
            f.write(head)
            f.truncate(self._data_start + sum(t.nbytes for t in manifest.tensors))

    @property
    def written(self) -> frozenset[str]:
        """The tensors written so far."""
        return frozenset(self._written)

    @property
    def written_bytes(self) -> int:
        return sum(self._infos[n].nbytes for n in self._written)

    def check(self, name: str, tensor: TensorData) -> str:
        """The checksum of ``tensor`` if it is the manifest's ``name`` (``INVALID_ADAPTER``
        for a name, dtype or shape it does not list, ``DIGEST_MISMATCH`` for other bytes)."""
        info = self._infos.get(name)
        if info is None:
            raise ArtifactError("INVALID_ADAPTER", f"{name!r} not in manifest")
        if (info.dtype, tuple(info.shape)) != (tensor.dtype, tuple(tensor.shape)):
            raise ArtifactError("INVALID_ADAPTER", f"{name!r}: wrong shape")
        checksum = tensor_checksum(tensor.dtype, tensor.shape, tensor.data)
        if checksum != info.sha256:
            raise ArtifactError("DIGEST_MISMATCH", f"{name!r}: bad bytes")
        return checksum

    def write(self, name: str, tensor: TensorData, checksum: str) -> None:
        """Write a tensor :meth:`check` accepted (``checksum`` its answer) at its offset."""
        if checksum != self._infos[name].sha256:
            raise ArtifactError("DIGEST_MISMATCH", f"{name!r}: bad bytes")
        fd = os.open(self.tmp / WEIGHTS_FILE, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            view = memoryview(tensor.data)
            position = self._data_start + self._offsets[name]
            while view:
                done = os.pwrite(fd, view[: CHUNK_BYTES * 16], position)
                view, position = view[done:], position + done
        finally:
            os.close(fd)
        self._written[name] = checksum

    def missing(self) -> list[str]:
        return sorted(set(self._infos) - set(self._written))

    def commit(self) -> Path:
        """Fsync the weights once, then install the directory (``INVALID_ADAPTER`` while a
        tensor is missing, ``DIGEST_MISMATCH`` if the checksums taken on the way do not give
        the digest). Committed or refused, the temp dir is gone afterwards."""
        try:
            missing = self.missing()
            if missing:
                raise ArtifactError(
                    "INVALID_ADAPTER",
                    f"{len(missing)} manifest tensors never arrived, e.g. {missing[:3]}",
                )
            infos = tuple(
                msgspec.structs.replace(self._infos[n], sha256=self._written[n])
                for n in self._written
            )
            _check_digest(self.manifest, infos)
            fd = os.open(self.tmp / WEIGHTS_FILE, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            return self.store._finish(self.manifest, self.tmp)
        finally:
            self.discard()

    def discard(self) -> None:
        """Remove the temp dir (nothing if :meth:`commit` renamed it into place)."""
        shutil.rmtree(self.tmp, ignore_errors=True)
