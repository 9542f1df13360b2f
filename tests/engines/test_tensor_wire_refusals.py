"""What the tensor wire refuses, and why it says so: an untrusted payload that is not a by-value
pickle of named CPU tensors, or a request whose ranks or checksums disagree, is a
:class:`PayloadError` naming the problem (the face answers it as a 400 or crashes as SGLang
does; either way the message is what an operator reads). Never another exception: a
``TypeError`` from inside the decoder would skip the face's handling of a bad payload.

And what the encoder must send: every tensor the manifest allows, the empty ones included."""

from __future__ import annotations

import base64
import collections
import io
import pickle
import warnings
from typing import Any

import pytest

from engines.local.tinymodel import make_adapter
from engines.manifest import TensorData
from engines.tensor_wire import (
    PayloadError,
    TensorLoadRequest,
    checksums,
    decode_request,
    decode_tensors,
    encode_request_payloads,
    encode_tensors,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class _StorageFromBytes:
    """Pickles as torch's by-value storage record, ``_load_from_bytes(data)``."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        import torch.storage

        return torch.storage._load_from_bytes, (self.data,)


class _TensorOf:
    """Pickles as the by-value tensor record, ``_rebuild_tensor_v2(storage, ...)``, of four
    elements."""

    def __init__(self, storage: _StorageFromBytes) -> None:
        self.storage = storage

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        import torch

        return torch._utils._rebuild_tensor_v2, (
            self.storage,
            0,
            (4,),
            (1,),
            False,
            collections.OrderedDict(),
        )


def _meta_tensor_payload() -> bytes:
    """A by-value payload whose storage says it lives on the ``meta`` device: what a sender's
    GPU tensor looks like to a host that can restore its device (here: the one device a CPU
    host can restore besides ``cpu``). Written in torch's legacy format, where the location
    is a plain pickled string."""
    import torch

    buffer = io.BytesIO()
    with warnings.catch_warnings():  # a TypedStorage is what the by-value format pickles
        warnings.simplefilter("ignore", UserWarning)
        tensor: Any = torch.arange(4, dtype=torch.float32)
        storage = tensor.storage()
    torch.save(storage, buffer, _use_new_zipfile_serialization=False)
    data = buffer.getvalue().replace(b"X\x03\x00\x00\x00cpu", b"X\x04\x00\x00\x00meta")
    return pickle.dumps({"w": _TensorOf(_StorageFromBytes(data))})


def _global(module: str, name: str) -> bytes:
    """A pickle that only names ``module.name`` (protocol 2's GLOBAL opcode)."""
    return b"\x80\x02c" + module.encode() + b"\n" + name.encode() + b"\n."


def _payloads() -> list[tuple[str, bytes, str]]:
    import torch

    one = torch.ones(2)
    return [
        ("not a mapping or list", pickle.dumps(5), "payload is a int, not named tensors"),
        ("an entry not a pair", pickle.dumps([5]), r"entries must be \(name, tensor\) pairs"),
        ("a name without a tensor", pickle.dumps({"w": 5}), "entry 'w' is not a named tensor"),
        ("a tensor without a name", pickle.dumps([(5, one)]), "entry 5 is not a named tensor"),
        ("a name twice", pickle.dumps([("w", one), ("w", one)]), "tensor 'w' appears twice"),
        (
            "a dtype the manifest cannot hold",
            pickle.dumps({"w": torch.zeros(2, dtype=torch.complex64)}),
            "w: unsupported torch dtype",
        ),
        ("no tensor", pickle.dumps({}), "the payload holds no tensors"),
        ("a tensor off the CPU", _meta_tensor_payload(), "w: a meta tensor; only CPU tensors"),
    ]


@pytest.mark.parametrize(("what", "blob", "why"), _payloads(), ids=lambda v: str(v)[:30])
def test_a_payload_that_is_not_named_cpu_tensors_is_refused_naming_why(
    what: str, blob: bytes, why: str
) -> None:
    with pytest.raises(PayloadError, match=why):
        decode_tensors(blob)


def test_a_list_of_name_tensor_pairs_is_read_as_a_mapping_is() -> None:
    """SGLang's serializer sends either form: ``{name: tensor}`` or ``[(name, tensor), ...]``."""
    import torch

    pairs = [("a", torch.ones(2)), ("b", torch.zeros(3, dtype=torch.int64))]
    assert decode_tensors(pickle.dumps(pairs)) == decode_tensors(pickle.dumps(dict(pairs)))


@pytest.mark.parametrize(
    ("module", "name"),
    [
        # torch.multiprocessing's reductions, whatever their name: shared-memory bookkeeping
        ("torch.multiprocessing.reductions", "StorageWeakRef"),
        # a rebuild function of torch's own other than the by-value tensor's
        ("torch._utils", "_rebuild_device_tensor_from_cpu_tensor"),
    ],
)
def test_every_handle_style_global_is_named_a_handle_payload(module: str, name: str) -> None:
    """An operator reading the refusal must learn that the sender used handles (a producer on
    the same host, tensors shared by file descriptor or CUDA IPC), not that it sent garbage."""
    with pytest.raises(PayloadError, match="a handle-based payload"):
        decode_tensors(_global(module, name))


@pytest.mark.parametrize("dtype", ["F16", "BF16", "I64", "I8", "BOOL"])
def test_an_empty_tensor_travels_with_its_dtype_and_shape(dtype: str) -> None:
    """A zero-element tensor has no bytes to view: it is sent as an empty tensor of its own
    dtype and shape, not dropped, reshaped or turned into float32."""
    _, tensors = make_adapter(1)
    empty = TensorData(dtype, (0, 3), b"")
    sent = {**tensors, "empty": empty}
    assert decode_tensors(encode_tensors(sent)) == sent


def _request(payloads: list[str], **fields: Any) -> TensorLoadRequest:
    return TensorLoadRequest(
        lora_name="a", config_dict={}, serialized_named_tensors=payloads, **fields
    )


def _requests() -> list[tuple[str, TensorLoadRequest, str]]:
    _, tensors = make_adapter(1)
    _, others = make_adapter(2)
    (blob,) = encode_request_payloads(tensors, 1)
    (other,) = encode_request_payloads(others, 1)
    sums = checksums(tensors)
    first = sorted(sums)[0]
    return [
        ("a payload per rank", _request([blob]), "1 serialized_named_tensors for TP size 2"),
        ("base64 with a stray character", _request([blob + "!", blob]), "rank 0: not base64"),
        ("ranks that differ", _request([blob, other]), "the ranks' payloads differ"),
        (
            "checksums not naming every tensor",
            _request([blob, blob], expected_checksums={**sums, "ghost": "0" * 64}),
            r"must list every tensor: missing \[\], extra \['ghost'\]",
        ),
        (
            "a checksum that does not match",
            _request([blob, blob], expected_checksums={**sums, first: "0" * 64}),
            f"checksum mismatch for 1 tensor\\(s\\), e.g. {first}",
        ),
    ]


@pytest.mark.parametrize(("what", "request_", "why"), _requests(), ids=lambda v: str(v)[:30])
def test_a_request_whose_ranks_or_checksums_disagree_is_refused_naming_why(
    what: str, request_: TensorLoadRequest, why: str
) -> None:
    """Checked as SGLang's TP workers do (here with TP size 2): one payload per rank, strict
    base64 (a lenient decoder would drop the stray character and read the rest), identical
    ranks, checksums naming exactly the tensors sent."""
    with pytest.raises(PayloadError, match=why):
        decode_request(request_, 2)


def test_a_request_read_as_base64_is_strict_about_its_alphabet() -> None:
    """A payload with a character outside base64's alphabet is refused, not silently
    shortened to the characters a lenient decoder keeps."""
    _, tensors = make_adapter(1)
    (blob,) = encode_request_payloads(tensors, 1)
    assert decode_request(_request([blob]), 1) == tensors
    with pytest.raises(PayloadError, match="not base64"):
        decode_request(_request(["\n" + blob]), 1)
    assert base64.b64decode("\n" + blob) == base64.b64decode(blob)  # what lenience would read


def test_checksums_name_every_tensor_by_the_sha256_of_its_raw_bytes() -> None:
    """SGLang's checksum: the raw contiguous bytes only, neither dtype nor shape."""
    import hashlib

    _, tensors = make_adapter(1)
    assert checksums(tensors) == {
        name: hashlib.sha256(t.data).hexdigest() for name, t in tensors.items()
    }
