"""A tiny causal LM and LoRA adapters built locally and deterministically (never a hub download).

The same base model directory serves the local engine, the real vLLM integration test and the
transformers+peft reference that computes golden outputs, so all three agree token for token in
float32. Building takes a few seconds and is cached on disk (atomic: temp dir, then rename).

Adapters are produced as :class:`~engines.manifest.TensorData` with peft's key layout, from a
seeded numpy generator, so tests and the demo can make as many distinct versions as they like
without torch on the trainer side.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from engines.manifest import TensorData, tensor_from_array

MODEL_TAG = "tiny-qwen2-v1"
HIDDEN = 128
LAYERS = 2
HEADS = 2
VOCAB = 512
INTERMEDIATE = 256
SERVED_NAME = "tiny"

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, this is a tiny model for integration tests",
    "adapters change the output of the base model",
    "a session keeps the version of its first generation",
] * 20


def default_cache_dir() -> Path:
    root = os.environ.get("LORALEDGER_CACHE") or Path.home() / ".cache" / "loraledger"
    return Path(root)


def ensure_tiny_model(cache_dir: Path | None = None) -> Path:
    """Return the directory of the tiny base model (HF format), building it once if needed."""
    root = cache_dir or default_cache_dir()
    target = root / MODEL_TAG
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_TAG}-", dir=root))
    try:
        _build_base(tmp)
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished first; its copy is byte-identical (deterministic build).
            if not (target / "config.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build_base(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        _CORPUS,
        trainers.BpeTrainer(
            vocab_size=320,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    hf_tok.save_pretrained(out)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=hf_tok.eos_token_id,
        eos_token_id=hf_tok.eos_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)


def adapter_config(
    *, r: int = 8, alpha: int = 16, targets: tuple[str, ...] = ("q_proj", "v_proj")
) -> dict[str, Any]:
    """A PEFT ``adapter_config.json`` that stock SGLang, vLLM and peft all accept."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": r,
        "lora_alpha": alpha,
        "target_modules": sorted(targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "base_model_name_or_path": SERVED_NAME,
    }


def make_adapter(
    seed: int,
    *,
    r: int = 8,
    alpha: int = 16,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    b_scale: float = 2.0,
    layers: int = LAYERS,
) -> tuple[dict[str, Any], dict[str, TensorData]]:
    """A random LoRA adapter for the tiny model: ``(config, {peft key: tensor})``.

    ``b_scale`` is large enough that greedy outputs clearly differ between seeds (peft's own
    init makes B zero, which would make every version identical to the base).
    """
    rng = np.random.default_rng(seed)
    tensors: dict[str, TensorData] = {}
    for layer in range(layers):
        for module in sorted(targets):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = rng.standard_normal((r, HIDDEN)) / np.sqrt(HIDDEN)
            b = rng.standard_normal((HIDDEN, r)) * b_scale
            a, b = a.astype(np.float32), b.astype(np.float32)
            tensors[f"{prefix}.lora_A.weight"] = tensor_from_array(a)
            tensors[f"{prefix}.lora_B.weight"] = tensor_from_array(b)
    return adapter_config(r=r, alpha=alpha, targets=targets), tensors
