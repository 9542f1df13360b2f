"""An adapter directory on this host is copied into the artifact store as it is read
(:meth:`ArtifactStore.copy_dir`, what ``POST /versions`` with ``adapter_dir`` does): memory holds
one chunk whatever the file's size, the digest is the one the directory's own description
gives, and a directory the store would refuse leaves nothing behind. The process-level bound
(``serve``'s peak memory over a publication) is ``tests/tools/test_bounded_request_work.py``."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest

from engines.artifacts import (
    WEIGHTS_FILE,
    ArtifactError,
    ArtifactStore,
    describe_adapter_dir,
    serialize_safetensors,
)
from engines.local.tinymodel import make_adapter
from engines.weights_file import CHUNK_BYTES

MiB = 1024 * 1024


def sparse_adapter(root: Path, size: int) -> Path:
    """A PEFT directory whose weights file is about ``size`` bytes of zeros, written sparse (a
    header, then a hole): rank chosen so the tiny model's four projections fill it."""
    modules = ("k_proj", "o_proj", "q_proj", "v_proj")
    config, small = make_adapter(0, r=1, targets=modules)
    widths = {name: t.shape[1] if ".lora_A." in name else t.shape[0] for name, t in small.items()}
    rank = size // (4 * sum(widths.values()))
    header: dict[str, object] = {}
    offset = 0
    for name in sorted(small):
        shape = [rank, widths[name]] if ".lora_A." in name else [widths[name], rank]
        end = offset + 4 * shape[0] * shape[1]
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, end]}
        offset = end
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    out = root / "sparse-adapter"
    out.mkdir()
    (out / "adapter_config.json").write_text(json.dumps({**config, "r": rank}))
    with open(out / "adapter_model.safetensors", "wb") as f:
        f.write(len(encoded).to_bytes(8, "little") + encoded)
        f.truncate(8 + len(encoded) + offset)
    return out


def adapter_dir(root: Path, seed: int) -> Path:
    config, tensors = make_adapter(seed)
    out = root / f"adapter-{seed}"
    out.mkdir()
    (out / "adapter_config.json").write_text(json.dumps(config))
    (out / WEIGHTS_FILE).write_bytes(serialize_safetensors(tensors))
    return out


def test_a_directory_is_stored_under_the_digest_its_description_gives(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "store")
    source = adapter_dir(tmp_path, 3)
    copied = store.copy_dir(source)
    assert copied.digest == describe_adapter_dir(source).digest
    assert store.verify(copied.digest) == copied
    assert store.copy_dir(source) == copied  # again: the stored copy is verified and kept
    assert [p.name for p in store.root.iterdir()] == [copied.digest]


def test_a_large_adapter_is_copied_one_chunk_at_a_time(tmp_path: Path) -> None:
    """A 96 MiB weights file: the Python allocations of the whole copy peak at a couple of
    chunks (the one written and the next read); reading the file whole, as before, is 96 MiB
    at once, and its tensors as much again."""
    store = ArtifactStore(tmp_path / "store")
    source = sparse_adapter(tmp_path, 96 * MiB)
    tracemalloc.start()
    try:
        copied = store.copy_dir(source)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (
        store.weights_path(copied.digest).stat().st_size == (source / WEIGHTS_FILE).stat().st_size
    )
    assert peak < 3 * CHUNK_BYTES, peak


def test_a_refused_directory_names_its_own_file_and_leaves_nothing(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "store")
    bad = adapter_dir(tmp_path, 4)
    (bad / WEIGHTS_FILE).write_bytes(b"not safetensors")
    with pytest.raises(ArtifactError) as refused:
        store.copy_dir(bad)
    assert refused.value.code == "INVALID_ADAPTER"
    assert (
        str(bad / WEIGHTS_FILE) in refused.value.message and ".copy-" not in refused.value.message
    )
    linked = adapter_dir(tmp_path, 5)
    (linked / WEIGHTS_FILE).unlink()
    (linked / WEIGHTS_FILE).symlink_to("/dev/zero")
    with pytest.raises(ArtifactError, match="regular file"):
        store.copy_dir(linked)
    assert list(store.root.iterdir()) == []
