"""Adapter directories are read as what they claim to be: regular files inside the directory,
no larger than declared. Each test is named after the defect it pins; the crafted directories
live under pytest's tmp_path."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engines.artifacts import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    ArtifactError,
    ArtifactStore,
    read_adapter_dir,
)
from engines.contract import ErrorCode
from engines.local.engine import LocalEngine
from tests.engines.contract import candidate_for, expect_refusal


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(tmp_path / "artifacts")


@pytest.fixture
async def engine(store: ArtifactStore, anyio_backend: str) -> AsyncIterator[LocalEngine]:
    async with LocalEngine("af-0", artifact_root=store.root) as e:
        yield e


def crafted(store: ArtifactStore, seed: int, name: str) -> tuple[Path, Path]:
    """A copy of a valid adapter directory inside the root, and the valid original."""
    original = Path(candidate_for(store, seed).candidate.artifact_path or "")
    copy = store.root / name
    shutil.copytree(original, copy)
    return copy, original


@pytest.mark.anyio
async def test_a_file_symlink_to_dev_zero_was_read_without_end(
    engine: LocalEngine, store: ArtifactStore
) -> None:
    """Before: ``adapter_model.safetensors -> /dev/zero`` grew the engine to 6.7 GB and SIGTERM
    could not stop the read. Now a symlinked file is refused before it is opened for reading."""
    bad, _ = crafted(store, 1, "zero")
    (bad / WEIGHTS_FILE).unlink()
    (bad / WEIGHTS_FILE).symlink_to("/dev/zero")
    await expect_refusal(ErrorCode.INVALID_ADAPTER, engine.load_ordinary("z@v1", str(bad)))
    assert "z@v1" not in engine.loaded_adapters()


@pytest.mark.anyio
async def test_a_fifo_hung_every_later_load(engine: LocalEngine, store: ArtifactStore) -> None:
    """Before: an ``adapter_config.json`` that is a FIFO blocked the reading thread, and every
    later load waited behind it. Now it is refused at once and the next load succeeds."""
    bad, good = crafted(store, 2, "fifo")
    (bad / CONFIG_FILE).unlink()
    os.mkfifo(bad / CONFIG_FILE)
    await expect_refusal(ErrorCode.INVALID_ADAPTER, engine.load_ordinary("f@v1", str(bad)))
    await engine.load_ordinary("g@v1", str(good))
    assert "g@v1" in engine.loaded_adapters()


@pytest.mark.anyio
async def test_a_file_symlink_out_of_the_root_was_loaded(
    engine: LocalEngine, store: ArtifactStore, tmp_path: Path
) -> None:
    """Before: the artifact root confined the directory, but a file in it that was a symlink to
    a file outside the root was read and loaded. Now it is refused."""
    bad, good = crafted(store, 3, "escape")
    outside = tmp_path / "outside.safetensors"
    shutil.copy(good / WEIGHTS_FILE, outside)
    (bad / WEIGHTS_FILE).unlink()
    (bad / WEIGHTS_FILE).symlink_to(outside)
    await expect_refusal(ErrorCode.INVALID_ADAPTER, engine.load_ordinary("o@v1", str(bad)))
    assert "o@v1" not in engine.loaded_adapters()


def test_reads_were_not_bounded_by_the_declared_size(store: ArtifactStore) -> None:
    """Before: the weights file was read whatever its size. Now the read stops at the declared
    bound (the manifest's total for a candidate), and a directory is refused, not read."""
    p = candidate_for(store, 4)
    path = Path(p.candidate.artifact_path or "")
    declared = p.candidate.manifest.total_bytes
    with pytest.raises(ArtifactError) as info:
        read_adapter_dir(path, max_weights_bytes=declared // 2)
    assert info.value.code == "INVALID_ADAPTER" and "more than" in info.value.message
    _, tensors = read_adapter_dir(path, max_weights_bytes=declared + 4096)
    assert set(tensors) == {t.name for t in p.candidate.manifest.tensors}
    weird, _ = crafted(store, 5, "dir-as-file")
    (weird / CONFIG_FILE).unlink()
    (weird / CONFIG_FILE).mkdir()
    with pytest.raises(ArtifactError):
        read_adapter_dir(weird)
