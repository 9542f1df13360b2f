"""A tiny causal LM and LoRA adapters built locally and deterministically (never a hub download).

The same base model directory serves the local engine, the real vLLM integration test and the
transformers+peft reference that computes golden outputs, so all three agree token for token in
float32. Building takes a few seconds and is cached on disk (atomic: temp dir, then rename).

Adapters are produced as :class:`~engines.manifest.TensorData` with peft's key layout, from a
seeded numpy generator, so tests and the demo can make as many distinct versions as they like
without torch on the trainer side. The same construction shapes adapters for any decoder base
model (:class:`ModelShapes`, read from its ``config.json``): ``loraledger check-engine`` builds its
throwaway adapters for a live engine's model with it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
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
# The attention projections of a decoder layer (the Llama/Qwen/Mistral family layout).
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")

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


@dataclass(frozen=True)
class ModelShapes:
    """What a LoRA on the attention projections of a decoder needs from its base model: the
    layer count and each projection's (in, out) features (the Llama/Qwen/Mistral family layout
    PEFT and the engines use)."""

    layers: int
    hidden: int
    q_out: int
    kv_out: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShapes:
        """From a base model's ``config.json``; ValueError when it lacks a decoder's shape
        fields."""
        text = config.get("text_config")
        if isinstance(text, Mapping) and "hidden_size" not in config:
            config = text  # multimodal wrappers keep the language model's config inside
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            kv_heads = int(config.get("num_key_value_heads") or heads)
            head_dim = int(config.get("head_dim") or hidden // heads)
            layers = int(config["num_hidden_layers"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"base model config lacks a decoder's shape fields: {exc!r}") from None
        return cls(layers=layers, hidden=hidden, q_out=heads * head_dim, kv_out=kv_heads * head_dim)

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in, out) of one attention projection."""
        return {
            "q_proj": (self.hidden, self.q_out),
            "k_proj": (self.hidden, self.kv_out),
            "v_proj": (self.hidden, self.kv_out),
            "o_proj": (self.q_out, self.hidden),
        }[module]


# The tiny model's: as many key/value heads as query heads, so every projection is square.
TINY_SHAPES = ModelShapes(layers=LAYERS, hidden=HIDDEN, q_out=HIDDEN, kv_out=HIDDEN)


def adapter_config(
    *,
    r: int = 8,
    alpha: int = 16,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    base_model: str = SERVED_NAME,
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
        "base_model_name_or_path": base_model,
    }


def make_adapter(
    seed: int,
    *,
    r: int = 8,
    alpha: int = 16,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    b_scale: float = 2.0,
    shapes: ModelShapes = TINY_SHAPES,
    base_model: str = SERVED_NAME,
) -> tuple[dict[str, Any], dict[str, TensorData]]:
    """A random LoRA adapter (float32) on the attention projections ``targets`` of a model of
    ``shapes`` (the tiny model unless told): ``(config, {peft key: tensor})``.

    ``b_scale`` is large enough that greedy outputs clearly differ between seeds (peft's own
    init makes B zero, which would make every version identical to the base).
    """
    rng = np.random.default_rng(seed)
    tensors: dict[str, TensorData] = {}
    for layer in range(shapes.layers):
        for module in sorted(targets):
            n_in, n_out = shapes.module_shape(module)
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = rng.standard_normal((r, n_in)) / np.sqrt(n_in)
            b = rng.standard_normal((n_out, r)) * b_scale
            a, b = a.astype(np.float32), b.astype(np.float32)
            tensors[f"{prefix}.lora_A.weight"] = tensor_from_array(a)
            tensors[f"{prefix}.lora_B.weight"] = tensor_from_array(b)
    config = adapter_config(r=r, alpha=alpha, targets=targets, base_model=base_model)
    return config, tensors
