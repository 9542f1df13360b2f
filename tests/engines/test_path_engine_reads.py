"""An engine that loads adapters by path (SGLang, vLLM) is sent a path only after the
publisher re-hashed the directory there, in the publisher's own process, once per engine of
the fleet: that check reads the weights streamed, one chunk in memory whatever the adapter's
size. Before: it read the file whole and parsed it into tensors (a 96 MiB adapter held about
twice its size per engine checked). No server is needed: the check runs before any request."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

from engines.artifacts import WEIGHTS_FILE, ArtifactStore, describe_adapter_dir
from engines.contract import Candidate, CleanRefusal, ErrorCode
from engines.manifest import Manifest
from engines.sglang import SGLangEngine
from engines.vllm import VLLMEngine
from engines.weights_file import CHUNK_BYTES
from tests.engines.contract import lora_name_for
from tests.engines.test_artifact_copy import sparse_adapter

MiB = 1024 * 1024


def at_path(manifest: Manifest, path: Path) -> Candidate:
    """Version 1 of ``manifest``, its artifact said to be the directory ``path``."""
    return Candidate(
        lora_name=lora_name_for(manifest, 1),
        digest=manifest.digest,
        attempt=1,
        manifest=manifest,
        artifact_path=str(path),
    )


@pytest.mark.parametrize("kind", [SGLangEngine, VLLMEngine])
def test_the_artifact_check_reads_a_large_adapter_one_chunk_at_a_time(
    tmp_path: Path, kind: type[SGLangEngine] | type[VLLMEngine]
) -> None:
    store = ArtifactStore(tmp_path / "store")
    stored = store.copy_dir(sparse_adapter(tmp_path, 96 * MiB))
    path = store.path_for(stored.digest)
    candidate = at_path(stored, path)
    engine = kind("http://127.0.0.1:9", "e0")
    tracemalloc.start()
    try:
        checked, config = engine._read_artifact(candidate)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert checked == str(path) and config == describe_adapter_dir(path).config
    assert peak < 3 * CHUNK_BYTES, peak


def test_an_artifact_with_other_bytes_is_still_refused(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "store")
    first = store.copy_dir(sparse_adapter(tmp_path, 4 * MiB))
    other_root = tmp_path / "other"
    other_root.mkdir()
    other = sparse_adapter(other_root, 4 * MiB)
    with open(other / WEIGHTS_FILE, "r+b") as f:  # the same layout, one byte of a tensor changed
        f.seek(-1, 2)
        f.write(b"\x01")
    candidate = at_path(first, other)
    with pytest.raises(CleanRefusal) as refused:
        SGLangEngine("http://127.0.0.1:9", "e0")._read_artifact(candidate)
    assert refused.value.code == ErrorCode.DIGEST_MISMATCH, refused.value
