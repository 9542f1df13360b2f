"""AdapterCopy: an owned, frozen copy (later training steps cannot change it), THE digest,
and bucket planning."""

from __future__ import annotations

import enum

import numpy as np
import pytest
import torch

from engines.local.tinymodel import adapter_config, make_adapter
from engines.manifest import TensorData, build_manifest, tensor_from_array
from publisher.drivers.adapter_copy import (
    AdapterCopy,
    AdapterCopyError,
    normalize_config,
    plan_buckets,
)


def numpy_state(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": rng.standard_normal(
            (8, 128)
        ).astype(np.float32),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": rng.standard_normal(
            (128, 8)
        ).astype(np.float32),
    }


def test_training_steps_after_the_snapshot_cannot_change_it() -> None:
    state = numpy_state()
    config = adapter_config()
    before = build_manifest(config, {k: tensor_from_array(v) for k, v in state.items()}).digest
    snap = AdapterCopy.from_state_dict(state, config)
    bytes_before = {k: bytes(t.data) for k, t in snap.tensors.items()}  # copies, not views
    # the optimizer steps: in place, on every tensor, and the config is edited too
    for array in state.values():
        array += 1.0
    config["r"] = 16
    config["target_modules"].append("k_proj")
    after = build_manifest(adapter_config(), {k: tensor_from_array(v) for k, v in state.items()})
    assert after.digest != before  # the source really changed
    assert snap.digest == before
    assert {k: bytes(t.data) for k, t in snap.tensors.items()} == bytes_before
    assert snap.config == adapter_config()
    # what would be sent still hashes to the digest (no view of the trainer's memory)
    assert build_manifest(snap.config, dict(snap.tensors)).digest == before
    assert all(type(t.data) is bytes for t in snap.tensors.values())


def test_torch_tensors_bfloat16_included_are_copied() -> None:
    a = torch.randn(8, 128, dtype=torch.bfloat16)
    b = torch.randn(128, 8)
    names = ("m.lora_A.weight", "m.lora_B.weight")
    snap = AdapterCopy.from_state_dict(dict(zip(names, (a, b), strict=True)), {"r": 8})
    digest = snap.digest
    assert snap.tensors[names[0]].dtype == "BF16"
    with torch.no_grad():
        a.mul_(3)
        b.zero_()
    assert snap.digest == digest
    rebuilt = build_manifest(snap.config, dict(snap.tensors))
    assert rebuilt.digest == digest  # the manifest describes exactly the bytes it holds
    assert snap.manifest.digest == digest


def test_the_snapshot_is_immutable() -> None:
    snap = AdapterCopy.from_state_dict(numpy_state(), adapter_config())
    with pytest.raises(AttributeError):
        snap._manifest = None  # type: ignore[assignment]
    with pytest.raises(TypeError):
        snap.tensors["x"] = snap.tensors[next(iter(snap.tensors))]  # type: ignore[index]
    copy = snap.config
    copy["r"] = 99
    assert snap.config["r"] == 8


def test_tensor_data_with_writable_buffers_is_owned_again() -> None:
    raw = bytearray(np.ones((8, 128), np.float32).tobytes())
    td = TensorData("F32", (8, 128), raw)  # type: ignore[arg-type]
    snap = AdapterCopy.from_state_dict({"m.lora_A.weight": td}, {"r": 8})
    digest = snap.digest
    raw[:4] = b"\x00\x00\x80\x7f"
    assert snap.digest == digest
    assert type(snap.tensors["m.lora_A.weight"].data) is bytes
    assert build_manifest(snap.config, dict(snap.tensors)).digest == digest


def test_digest_is_the_manifest_digest_and_bucketing_never_changes_it() -> None:
    config, tensors = make_adapter(3)
    expected = build_manifest(config, tensors).digest
    for bucket_bytes in (1, 4096, 10_000, 64 * 1024 * 1024):
        snap = AdapterCopy.from_state_dict(tensors, config, bucket_bytes=bucket_bytes)
        assert snap.digest == expected
        sent = {bt.name: bt.tensor for b in snap.buckets for bt in b.tensors}
        assert sent == dict(tensors)
        assert build_manifest(config, sent).digest == expected


def test_buckets_never_split_a_tensor_and_big_tensors_go_alone() -> None:
    def t(n: int) -> TensorData:
        return TensorData("U8", (n,), bytes(n))

    tensors = {"a": t(40), "b": t(30), "c": t(250), "d": t(10), "e": t(60), "f": t(100)}
    buckets = plan_buckets(tensors, 100)
    layout = [[(bt.name, bt.tensor.nbytes) for bt in b.tensors] for b in buckets]
    assert layout == [
        [("a", 40), ("b", 30)],
        [("c", 250)],  # larger than a bucket: its own bucket
        [("d", 10), ("e", 60)],
        [("f", 100)],
    ]
    assert [b.index for b in buckets] == [0, 1, 2, 3]
    for b in buckets:
        size = sum(bt.tensor.nbytes for bt in b.tensors)
        assert size <= 100 or len(b.tensors) == 1
    with pytest.raises(AdapterCopyError):
        plan_buckets(tensors, 0)


def test_default_bucket_is_64_mib() -> None:
    snap = AdapterCopy.from_state_dict(numpy_state(), adapter_config())
    assert len(snap.buckets) == 1
    big = {f"t{i}": TensorData("U8", (40 << 20,), bytes(40 << 20)) for i in range(3)}
    assert len(plan_buckets(big)) == 3  # 2 x 40 MiB would exceed 64 MiB


class Kind(enum.StrEnum):
    LORA = "LORA"


def test_config_is_normalised_to_json_or_refused() -> None:
    got = normalize_config({"peft_type": Kind.LORA, "target_modules": {"v", "q"}, "x": (1, 2)})
    assert got == {"peft_type": "LORA", "target_modules": ["q", "v"], "x": [1, 2]}
    with pytest.raises(AdapterCopyError, match=r"config\.obj"):
        normalize_config({"obj": object()})
    with pytest.raises(AdapterCopyError):
        normalize_config({"bad": float("nan")})
    with pytest.raises(AdapterCopyError):
        normalize_config({1: "x"})  # type: ignore[dict-item]
    with pytest.raises(AdapterCopyError):
        AdapterCopy.from_state_dict({}, {"r": 8})
    with pytest.raises(AdapterCopyError):
        AdapterCopy.from_state_dict({"x": object()}, {"r": 8})


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
def test_from_peft_model_copies_the_adapter_and_its_config() -> None:
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from engines.local.tinymodel import ensure_tiny_model

    base = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(), dtype=torch.float32)
    model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj", "q_proj"], lora_dropout=0.0)
    )
    snap = AdapterCopy.from_peft_model(model)
    state = get_peft_model_state_dict(model)
    assert set(snap.tensors) == set(state)
    assert snap.config["target_modules"] == ["q_proj", "v_proj"]
    assert snap.config["peft_type"] == "LORA" and snap.config["inference_mode"] is True
    digest = snap.digest
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(1.0)
    assert snap.digest == digest
    assert AdapterCopy.from_peft_model(model).digest != digest
    with pytest.raises(AdapterCopyError):
        AdapterCopy.from_peft_model(model, adapter_name="nope")
