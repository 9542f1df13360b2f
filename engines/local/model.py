"""The model worker: one tiny causal LM, several peft LoRA adapters, token-at-a-time decoding.

Everything here is synchronous torch code. The engine calls it from a worker thread and
serialises every call through one capacity limiter, so this class never sees two callers at
once and needs no lock of its own. Work is cut into small calls (prefill, one decode step) so the
engine can interleave requests and honour cancellation between tokens.

Adapters are registered in peft under their engine-local id (fresh per load), never under their
name; a request selects its adapter per forward with peft's ``adapter_names=`` (``"__base__"``
for the base model), so no global "active adapter" state exists to race on. The peft wrapper is
created with the first adapter and unwrapped when the last one goes (peft cannot hold zero
adapters), which restores the exact base modules.
"""

from __future__ import annotations

import copy
import functools
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from engines.local.admission import AdapterPlan
from engines.local.prefix_cache import BASE_KEY, PrefixCache
from engines.manifest import TensorData

# peft calls a transformers method deprecated in 5.x on every adapter injection; the warning is
# about peft's code, not ours, and would repeat for every load.
warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*", category=FutureWarning)

_TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_template_lock = threading.Lock()


class DecodeState:
    """One sequence's KV cache and the logits that choose its next token."""

    __slots__ = ("cache", "length", "logits")

    def __init__(self, cache: Any, logits: torch.Tensor, length: int) -> None:
        self.cache = cache
        self.logits = logits
        self.length = length


@functools.lru_cache(maxsize=4)
def _load_template(model_dir: str) -> tuple[Any, Any]:
    """Read the base model and tokenizer once per process; each engine deep-copies both (it
    injects its own adapters, and a fast tokenizer is not safe to share between the worker
    threads of two engines)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    # No "Loading weights" progress bar on the host's stderr (a service's log): the model is
    # read once per process, from a local directory. The setting is Hugging Face's, global:
    # put back as found.
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return model, tokenizer


def tensor_to_torch(t: TensorData) -> torch.Tensor:
    raw = torch.frombuffer(bytearray(t.data), dtype=torch.uint8) if t.data else None
    dtype = _TORCH_DTYPES[t.dtype]
    if raw is None:
        return torch.zeros(t.shape, dtype=torch.float32)
    return raw.view(dtype).reshape(t.shape).to(torch.float32)


class ModelRunner:
    def __init__(self, model_dir: Path, *, prefix_cache_entries: int = 64) -> None:
        with _template_lock:
            template, tokenizer = _load_template(str(model_dir))
            self._base = copy.deepcopy(template)
            tokenizer = copy.deepcopy(tokenizer)
        self._base.eval()
        self.tokenizer = tokenizer
        self.model_dir = Path(model_dir)
        self._peft: Any = None
        self.prefix_cache: PrefixCache[DecodeState] = PrefixCache(prefix_cache_entries)
        self.eos_token_id: int | None = tokenizer.eos_token_id
        self.vocab_size = int(self._base.config.vocab_size)
        self.max_length = int(getattr(self._base.config, "max_position_embeddings", 2048))

    # --- adapters ------------------------------------------------------------------------

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """``{module path: (in_features, out_features)}`` of the base model's linear layers."""
        return {
            name: (m.in_features, m.out_features)
            for name, m in self._base.named_modules()
            if isinstance(m, torch.nn.Linear) and name != "lm_head"
        }

    def adapters(self) -> list[str]:
        return [] if self._peft is None else list(self._peft.peft_config)

    def add_adapter(
        self, adapter_id: str, plan: AdapterPlan, tensors: Mapping[str, TensorData]
    ) -> None:
        """Inject and fill one adapter. On any failure the adapter is removed again, so a
        refused load leaves the model exactly as it was."""
        from peft import LoraConfig

        config = LoraConfig(
            r=plan.r,
            lora_alpha=plan.alpha,  # type: ignore[arg-type]  # peft says int; a float works
            use_rslora=plan.use_rslora,
            target_modules=list(plan.modules),
            lora_dropout=0.0,
            bias="none",
        )
        state = {name: tensor_to_torch(t) for name, t in tensors.items()}
        # low_cpu_mem_usage: the LoRA layers are created empty (meta) and the received tensors
        # are assigned, instead of peft's random init that the state dict then overwrites.
        # That init is most of an install's time (~0.6 s of ~0.65 s for a 64 MiB adapter) and
        # runs on the model worker, i.e. it stalls every generation on this engine. A key the
        # state dict lacks stays on meta and is caught as missing below. peft does it by
        # patching nn.Module.register_parameter process-wide for the duration, so installs of
        # the engines sharing this process take turns on the process lock.
        try:
            with _template_lock:
                self._inject(adapter_id, config, state)
            self._peft.eval()
        except BaseException:
            if self._peft is not None and adapter_id in self._peft.peft_config:
                self.remove_adapter(adapter_id)
            raise

    def _inject(self, adapter_id: str, config: Any, state: dict[str, torch.Tensor]) -> None:
        from peft import PeftModel, set_peft_model_state_dict

        if self._peft is None:
            self._peft = PeftModel(
                self._base, config, adapter_name=adapter_id, low_cpu_mem_usage=True
            )
        else:
            self._peft.add_adapter(adapter_id, config, low_cpu_mem_usage=True)
        # peft annotates this as ``namedtuple`` (the factory); it is torch's load_state_dict
        # result, (missing_keys, unexpected_keys).
        result: Any = set_peft_model_state_dict(
            self._peft, state, adapter_name=adapter_id, low_cpu_mem_usage=True
        )
        if result.unexpected_keys:
            raise ValueError(f"unexpected adapter keys {result.unexpected_keys[:4]}")
        missing = [k for k in result.missing_keys if f".{adapter_id}." in k]
        if missing:
            raise ValueError(f"adapter keys not filled: {missing[:4]}")

    def remove_adapter(self, adapter_id: str) -> None:
        """Free an adapter's weights and its prefix-cache entries."""
        self.prefix_cache.invalidate(adapter_id)
        if self._peft is None or adapter_id not in self._peft.peft_config:
            return
        remaining = [a for a in self._peft.peft_config if a != adapter_id]
        if not remaining:
            self._base = self._peft.unload()  # restores the original modules
            self._base.eval()
            self._peft = None
            return
        # peft keeps pointing at a deleted "active" adapter, and warns on every delete of the
        # active one (a line on the host's stderr per unload): make a live one active first;
        # any will do, since every forward names its adapter explicitly.
        self._peft.set_adapter(remaining[0])
        self._peft.delete_adapter(adapter_id)
        self._peft.eval()

    # --- text ------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def decode(self, token_ids: list[int] | tuple[int, ...]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    # --- decoding --------------------------------------------------------------------------

    def _forward(self, adapter_id: str | None, tokens: list[int], cache: Any) -> tuple[Any, Any]:
        ids = torch.tensor([tokens], dtype=torch.long)
        if self._peft is None:
            if adapter_id is not None:
                raise RuntimeError(f"adapter {adapter_id} is not resident")
            out = self._base(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        else:
            name = adapter_id if adapter_id is not None else "__base__"
            out = self._peft(
                input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1, adapter_names=[name]
            )
        return out.logits[0, -1].to(torch.float32), out.cache

    def prefill(
        self, adapter_id: str | None, namespace: str, tokens: tuple[int, ...]
    ) -> tuple[DecodeState, int]:
        """Run the prompt, reusing the longest cached prefix of the same adapter incarnation
        and namespace. Returns the state and how many prompt tokens came from the cache."""
        if not tokens:
            raise ValueError("empty prompt")
        key = adapter_id or BASE_KEY
        with torch.no_grad():
            hit = self.prefix_cache.lookup(key, namespace, tokens)
            cache: Any = None
            cached = 0
            if hit is not None:
                cache = copy.deepcopy(hit.state.cache)
                cached = hit.usable
                surplus = cache.get_seq_length() - cached
                if surplus > 0:
                    cache.crop(-surplus)
            logits, cache = self._forward(adapter_id, list(tokens[cached:]), cache)
            state = DecodeState(cache, logits, len(tokens))
            self.prefix_cache.store(key, namespace, tokens, self.fork(state))
        return state, cached

    def fork(self, state: DecodeState) -> DecodeState:
        with torch.no_grad():
            return DecodeState(copy.deepcopy(state.cache), state.logits.clone(), state.length)

    def advance(self, state: DecodeState, adapter_id: str | None, token: int) -> None:
        """Feed one generated token; ``state.logits`` then choose the next one."""
        with torch.no_grad():
            state.logits, state.cache = self._forward(adapter_id, [token], state.cache)
        state.length += 1
