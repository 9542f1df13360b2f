"""A weights file described, checked and adopted by the artifact store without loading it
(``engines/weights_file.py``, ``describe_adapter_dir``, ``ArtifactStore.adopt``/``ensure``): the
digest is the one the loaded tensors give, whatever the file's tensor order or metadata; every
layout the safetensors library refuses is refused; bytes that do not hash to the digest they
were sent as are never stored."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest

from engines.artifacts import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    ArtifactError,
    ArtifactStore,
    describe_adapter_dir,
    read_adapter_dir,
    serialize_safetensors,
)
from engines.local.tinymodel import make_adapter
from engines.manifest import TensorData, build_manifest


def write_dir(root: Path, config: dict[str, Any], weights: bytes, name: str = "a") -> Path:
    out = root / name
    out.mkdir()
    (out / CONFIG_FILE).write_text(json.dumps(config))
    (out / WEIGHTS_FILE).write_bytes(weights)
    return out


def raw_file(header: dict[str, Any], data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def test_the_streamed_digest_is_the_digest_of_the_loaded_tensors(tmp_path: Path) -> None:
    """Written by the store's serializer, and by hand with tensors in reverse data order,
    ``__metadata__``, header padding and a bfloat16 tensor: the same digest as loading it."""
    config, tensors = make_adapter(3)
    plain = write_dir(tmp_path, config, serialize_safetensors(tensors))
    loaded_config, loaded = read_adapter_dir(plain)
    assert describe_adapter_dir(plain).digest == build_manifest(loaded_config, loaded).digest

    a = TensorData("BF16", (8, 128), bytes(range(256)) * 8)
    b = TensorData("F32", (128, 8), b"\x01\x02\x03\x04" * 1024)
    names = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": a,
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": b,
    }
    (name_a, name_b) = names
    header: dict[str, Any] = {
        "__metadata__": {"format": "pt"},
        name_b: {"dtype": "F32", "shape": [128, 8], "data_offsets": [0, b.nbytes]},
        name_a: {
            "dtype": "BF16",
            "shape": [8, 128],
            "data_offsets": [b.nbytes, b.nbytes + a.nbytes],
        },
    }
    text = json.dumps(header).encode() + b"    "
    blob = struct.pack("<Q", len(text)) + text + b.data + a.data
    by_hand = write_dir(tmp_path, config, blob, "by-hand")
    described = describe_adapter_dir(by_hand)
    loaded_config, loaded = read_adapter_dir(by_hand)
    assert described.digest == build_manifest(loaded_config, loaded).digest
    assert described.weights_bytes == len(blob)


A = "x.q_proj.lora_A.weight"  # rank 1: shape [1, n]
B = "x.q_proj.lora_B.weight"  # shape [n, 1]


@pytest.mark.parametrize(
    ("why", "header", "data"),
    [
        ("starts at 4", {A: {"dtype": "F32", "shape": [1, 1], "data_offsets": [4, 8]}}, 8),
        (
            "starts at 4, not at 8",
            {
                A: {"dtype": "F32", "shape": [1, 2], "data_offsets": [0, 8]},
                B: {"dtype": "F32", "shape": [2, 1], "data_offsets": [4, 12]},
            },
            12,
        ),
        ("the tensors cover", {A: {"dtype": "F32", "shape": [1, 1], "data_offsets": [0, 4]}}, 8),
        ("the file holds", {A: {"dtype": "F32", "shape": [1, 4], "data_offsets": [0, 16]}}, 8),
        ("needs 12 bytes", {A: {"dtype": "F32", "shape": [1, 3], "data_offsets": [0, 8]}}, 8),
        ("dtype 'F8_E4M3'", {A: {"dtype": "F8_E4M3", "shape": [1, 4], "data_offsets": [0, 4]}}, 4),
        ("at least one tensor", {}, 0),
    ],
)
def test_a_layout_the_library_refuses_is_refused(
    tmp_path: Path, why: str, header: dict[str, Any], data: int
) -> None:
    """Each is refused ``INVALID_ADAPTER`` for its layout (the message says which), before
    anything is hashed: gaps, overlaps, bytes past the tensors, a short file, sizes that are
    not the shape's, a dtype the store cannot carry, no tensor."""
    config = {"r": 1, "lora_alpha": 2, "target_modules": ["q_proj"]}
    bad = write_dir(tmp_path, config, raw_file(header, b"\x00" * data))
    with pytest.raises(ArtifactError) as refused:
        describe_adapter_dir(bad)
    assert refused.value.code == "INVALID_ADAPTER"
    assert why in refused.value.message


def test_a_header_longer_than_the_file_or_the_allowance_is_refused(tmp_path: Path) -> None:
    config = {"r": 1, "lora_alpha": 2, "target_modules": ["q_proj"]}
    lying = write_dir(tmp_path, config, struct.pack("<Q", 2**40) + b"{}", "lying")
    with pytest.raises(ArtifactError, match="header"):
        describe_adapter_dir(lying)


def test_adoption_stores_the_bytes_only_under_the_digest_they_hash_to(tmp_path: Path) -> None:
    """A file sent as another digest is refused ``DIGEST_MISMATCH`` naming both digests and
    nothing is stored; the right one is moved into the store and reads back verified."""
    config, tensors = make_adapter(5)
    source = write_dir(tmp_path, config, serialize_safetensors(tensors))
    described = describe_adapter_dir(source)
    store = ArtifactStore(tmp_path / "store")
    received = store.root / "received.part"
    shutil.copy(source / WEIGHTS_FILE, received)
    claimed = "0" * 64
    with pytest.raises(ArtifactError) as refused:
        store.adopt(config, received, claimed)
    assert refused.value.code == "DIGEST_MISMATCH"
    assert claimed in refused.value.message and described.digest in refused.value.message
    assert store.digests() == []

    path = store.adopt(config, received, described.digest)
    assert not received.exists() and path == store.path_for(described.digest)
    manifest, _ = store.open(described.digest)
    assert manifest.digest == described.digest == store.verify(described.digest).digest


def test_ensure_reuses_a_stored_directory_without_reading_the_tensors(tmp_path: Path) -> None:
    config, tensors = make_adapter(6)
    manifest = build_manifest(config, tensors)
    store = ArtifactStore(tmp_path / "store")

    def never() -> dict[str, TensorData]:
        raise AssertionError("the tensors of a stored digest were read")

    assert store.ensure(manifest, lambda: tensors) == store.path_for(manifest.digest)
    assert store.ensure(manifest, never) == store.path_for(manifest.digest)
    weights = store.weights_path(manifest.digest)
    damaged = bytearray(weights.read_bytes())
    damaged[-1] ^= 0xFF
    weights.write_bytes(bytes(damaged))
    with pytest.raises(ArtifactError) as refused:
        store.ensure(manifest, never)
    assert refused.value.code == "DIGEST_MISMATCH"
