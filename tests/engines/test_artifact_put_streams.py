"""Tensors in memory reach the artifact store in one pass (:meth:`ArtifactStore.put`): each
tensor is hashed as it is written, the directory is renamed into place only once the digest of
what was written matches the manifest, and nothing but one chunk is allocated on the way.

Before, ``put`` hashed every tensor, then serialized the whole safetensors file in memory (the
adapter held twice: the library's buffer and a ``bytes`` copy of it), then wrote it: three
passes over the bytes and twice the adapter in memory, on the control plane for every
publication and on every agent host."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import msgspec
import pytest
import safetensors

from engines.artifacts import WEIGHTS_FILE, ArtifactError, ArtifactStore, read_adapter_dir
from engines.local.tinymodel import make_adapter
from engines.manifest import TensorData, build_manifest

MiB = 1024 * 1024
TARGETS = ("k_proj", "o_proj", "q_proj", "v_proj")


def _tampered(tensors: dict[str, TensorData]) -> dict[str, TensorData]:
    name = sorted(tensors)[-1]
    t = tensors[name]
    flipped = bytes([t.data[0] ^ 0xFF]) + t.data[1:]
    return {**tensors, name: msgspec.structs.replace(t, data=flipped)}


def _entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_put_writes_a_file_every_reader_takes_and_verifies_it(tmp_path: Path) -> None:
    config, tensors = make_adapter(3, targets=TARGETS)
    manifest = build_manifest(config, tensors)
    store = ArtifactStore(tmp_path / "store")
    path = store.put(manifest, tensors)
    assert store.verify(manifest.digest).digest == manifest.digest
    read_config, read_tensors = read_adapter_dir(path)
    assert read_config == manifest.config
    assert read_tensors == tensors
    with safetensors.safe_open(str(path / WEIGHTS_FILE), framework="numpy") as f:
        assert sorted(f.keys()) == sorted(tensors)
    assert (path / WEIGHTS_FILE).stat().st_size % 8 == 0  # header padded as the library pads


def test_put_holds_one_chunk_not_the_adapter(tmp_path: Path) -> None:
    config, tensors = make_adapter(4, r=1024, targets=TARGETS)
    manifest = build_manifest(config, tensors)
    size = manifest.total_bytes
    assert size >= 8 * MiB
    store = ArtifactStore(tmp_path / "store")
    tracemalloc.start()
    try:
        store.put(manifest, tensors)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < size // 4, (
        f"put allocated {peak / MiB:.1f} MiB for a {size / MiB:.1f} MiB adapter"
    )


@pytest.mark.parametrize("stored_before", [False, True])
def test_bytes_that_are_not_the_manifests_are_refused_and_leave_nothing(
    tmp_path: Path, stored_before: bool
) -> None:
    config, tensors = make_adapter(5, targets=TARGETS)
    manifest = build_manifest(config, tensors)
    store = ArtifactStore(tmp_path / "store")
    if stored_before:
        store.put(manifest, tensors)
    before = _entries(store.root)
    with pytest.raises(ArtifactError) as refused:
        store.put(manifest, _tampered(tensors))
    assert refused.value.code == "DIGEST_MISMATCH"
    assert _entries(store.root) == before  # no directory, no temp dir left behind
    if stored_before:
        assert store.verify(manifest.digest).digest == manifest.digest


def test_a_staged_directory_takes_only_the_manifests_bytes_and_all_of_them(
    tmp_path: Path,
) -> None:
    """Tensor by tensor (:meth:`ArtifactStore.begin`, what the engine-host agent stages into):
    bytes that are not the manifest's are refused before they touch the file, and a directory
    missing a tensor is never installed; either way nothing is left behind."""
    config, tensors = make_adapter(6, targets=TARGETS)
    manifest = build_manifest(config, tensors)
    store = ArtifactStore(tmp_path / "store")
    names = sorted(tensors)
    staged = store.begin(manifest)
    bad = _tampered(tensors)[names[-1]]
    with pytest.raises(ArtifactError) as refused:
        staged.check(names[-1], bad)
    assert refused.value.code == "DIGEST_MISMATCH"
    with pytest.raises(ArtifactError):  # a checksum that is not the manifest's is not written
        staged.write(names[-1], bad, "0" * 64)
    for name in names[:-1]:
        staged.write(name, tensors[name], staged.check(name, tensors[name]))
    assert staged.missing() == [names[-1]]
    with pytest.raises(ArtifactError) as incomplete:
        staged.commit()
    assert incomplete.value.code == "INVALID_ADAPTER"
    assert _entries(store.root) == []

    staged = store.begin(manifest)
    for name in names:
        staged.write(name, tensors[name], staged.check(name, tensors[name]))
    path = staged.commit()
    assert _entries(store.root) == [manifest.digest]
    assert read_adapter_dir(path)[1] == tensors
