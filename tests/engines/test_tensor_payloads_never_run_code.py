"""An untrusted tensor payload never unpickles an arbitrary object: decoding it can build CPU
tensors from their bytes and nothing else, so a payload whose pickle would call some global
(here a marker that records that it ran) is refused before that global is ever called.

Two places read pickles: the payload itself (an allowlist unpickler) and each tensor's storage
bytes inside it, which torch's own loader reads; the second must be the weights-only loader,
which refuses globals, never torch's full unpickler (``weights_only=False``), which would call
the marker while reading them."""

from __future__ import annotations

import io
import pickle
from typing import Any

import pytest

from engines.local.tinymodel import make_adapter
from engines.tensor_wire import PayloadError, decode_tensors, encode_tensors

RAN: list[str] = []


def marker(where: str) -> str:
    """The global a hostile payload calls: it must never run."""
    RAN.append(where)
    return where


class _CallsMarker:
    """Pickles as a call of :func:`marker` (what a hostile payload is made of)."""

    def __init__(self, where: str) -> None:
        self.where = where

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return marker, (self.where,)


class _StorageFromBytes:
    """Pickles as torch's by-value storage record, ``torch.storage._load_from_bytes(data)``,
    with ``data`` of the sender's choosing: the call the payload allowlist lets through."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        import torch.storage

        return torch.storage._load_from_bytes, (self.data,)


@pytest.fixture(autouse=True)
def _nothing_ran_yet() -> None:
    RAN.clear()


def test_a_payload_calling_a_global_is_refused_without_calling_it() -> None:
    with pytest.raises(PayloadError, match="not allowed"):
        decode_tensors(pickle.dumps({"w": _CallsMarker("payload")}))
    assert RAN == []


@pytest.mark.parametrize("inner", ["torch.save", "plain pickle"])
def test_storage_bytes_calling_a_global_are_refused_without_calling_it(inner: str) -> None:
    """The storage bytes are read by torch's loader: a zip written by ``torch.save`` or a
    legacy-format plain pickle, each holding a call of the marker."""
    import torch

    if inner == "torch.save":
        buffer = io.BytesIO()
        torch.save(_CallsMarker("storage"), buffer)
        data = buffer.getvalue()
    else:
        data = pickle.dumps(_CallsMarker("storage"), protocol=2)  # torch.save's own
    with pytest.raises(PayloadError, match="undecodable"):
        decode_tensors(pickle.dumps({"w": _StorageFromBytes(data)}))
    assert RAN == []


def test_an_honest_payload_still_decodes() -> None:
    """The guard against the two above: the by-value tensors an encoder sends are read."""
    _, tensors = make_adapter(2)
    assert decode_tensors(encode_tensors(tensors)) == tensors
    assert RAN == []


def test_storage_bytes_are_read_weights_only_whatever_torch_defaults_to(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Torch's default for ``torch.load`` is not the decoder's to rely on: it was the full
    unpickler before torch 2.6, and ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` in the process's
    environment makes it so again. Only an explicit ``weights_only=True`` holds either way."""
    import torch

    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    buffer = io.BytesIO()
    torch.save(_CallsMarker("storage"), buffer)
    with pytest.raises(PayloadError, match="undecodable"):
        decode_tensors(pickle.dumps({"w": _StorageFromBytes(buffer.getvalue())}))
    assert RAN == []
