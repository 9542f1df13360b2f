"""Engine adapters (local, SGLang, vLLM), adapter artifacts and the engine contract, with
their public face (``from engines import SGLangEngine, SamplingParams, ...``).

Imports nothing from the ledger: an engine does not know it is being managed.

``_FACE`` below is the one map from each public name to the module that defines it. Names are
imported on first use: ``import engines`` loads nothing, the HTTP adapters never load torch,
and only ``LocalEngine`` (the bundled engine, the ``engine`` extra) imports the model stack.
``tests/test_faces.py`` checks that every name resolves and that the import stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_FACE = {
    # the contract every engine implements
    "AmbiguousReply": "engines.contract",
    "CleanRefusal": "engines.contract",
    "Engine": "engines.contract",
    "EngineError": "engines.contract",
    "ErrorCode": "engines.contract",
    "Generation": "engines.contract",
    "SamplingParams": "engines.contract",
    # engines over HTTP (no torch): stock SGLang, vLLM's OpenAI server, the local engine's
    # process (``loraledger engine``)
    "LocalHTTPEngine": "engines.local.client",
    "SGLangEngine": "engines.sglang",
    "VLLMEngine": "engines.vllm",
    # without a shared filesystem: SGLang's tensor route (torch only when it sends), and the
    # engine-host agent beside a path-loading engine (over HTTP, or hosted in one process)
    "SGLangTensorEngine": "engines.sglang_tensors",
    "AgentEngine": "engines.agent",
    "HostedAgentEngine": "engines.agent",
    # the bundled local engine, in process (needs the engine extra: torch, transformers, peft)
    "LocalEngine": "engines.local.engine",
    "ServingLimits": "engines.local.admission",
    # adapter artifacts: immutable PEFT directories that path-loading engines read
    "ArtifactStore": "engines.artifacts",
    "read_adapter_dir": "engines.artifacts",
    # the local engine's tiny base model and seeded adapters for it (examples, tests)
    "ensure_tiny_model": "engines.local.tinymodel",
    "make_adapter": "engines.local.tinymodel",
}

__all__ = sorted(_FACE)


def __getattr__(name: str) -> Any:
    module = _FACE.get(name)
    if module is None:
        raise AttributeError(f"module 'engines' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolved once; later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
