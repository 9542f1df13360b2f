"""Engine adapters (local, SGLang, vLLM), adapter artifacts and the engine contract, with
their public face (``from engines import SGLangEngine, SamplingParams, ...``).

Imports nothing from the ledger: an engine does not know it is being managed. Every name is
imported here, except the bundled engine in process (``LocalEngine``, the ``engine`` extra:
torch, transformers, peft), which is imported on first use so that ``import engines`` and the
HTTP adapters never load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from engines.agent import AgentEngine, HostedAgentEngine
from engines.artifacts import ArtifactStore, read_adapter_dir
from engines.contract import (
    AmbiguousReply,
    CleanRefusal,
    Engine,
    EngineError,
    ErrorCode,
    Generation,
    SamplingParams,
)
from engines.local.admission import ServingLimits
from engines.local.client import LocalHTTPEngine
from engines.local.tinymodel import ensure_tiny_model, make_adapter
from engines.sglang import SGLangEngine
from engines.sglang_tensors import SGLangTensorEngine
from engines.vllm import VLLMEngine

if TYPE_CHECKING:
    from engines.local.engine import LocalEngine

_LAZY = {"LocalEngine": "engines.local.engine"}  # loads torch

__all__ = [
    "AgentEngine",
    "AmbiguousReply",
    "ArtifactStore",
    "CleanRefusal",
    "Engine",
    "EngineError",
    "ErrorCode",
    "Generation",
    "HostedAgentEngine",
    "LocalEngine",
    "LocalHTTPEngine",
    "SGLangEngine",
    "SGLangTensorEngine",
    "SamplingParams",
    "ServingLimits",
    "VLLMEngine",
    "ensure_tiny_model",
    "make_adapter",
    "read_adapter_dir",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'engines' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # resolved once; later lookups are plain attribute reads
    return value
