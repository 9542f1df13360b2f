"""The local reference engine: a tiny causal LM with peft adapters, behind the engine contract.

It is the engine the demo and most tests run, and the stand-in for a GPU SGLang server (through
:mod:`engines.local.server`), so it implements SGLang's LoRA semantics where they are safe and
loraledger's stricter ones where SGLang is not (docs/engines.md, SGLang).

:class:`LocalEngine` is the one public class. It is assembled from rooms, one concept each,
which share the engine's state, task group and lock order through their common base:

* :mod:`~engines.local.lifecycle` -- start and stop, engine-owned jobs (a cancelled caller never
  cancels a drain or leaves a half-installed adapter), the lock order;
* :mod:`~engines.local.residency` -- which adapters the model holds: reading, installing,
  freeing after the drain, the inventory;
* :mod:`~engines.local.managed_path` -- the ledger's ``prepare``/``transfer``/``load``/``unload``,
  fenced by attempt;
* :mod:`~engines.local.sglang_path` -- ordinary names with stock SGLang's semantics, including the
  hazardous implicit reload and the ``lora_update_lock`` an ordinary unload holds through its
  drain;
* :mod:`~engines.local.generation` -- per-request leases, token-level decoding, generation
  control.

What stands alone lives beside them: ``name_table`` (names, fences), ``refs``, ``scheduler``,
``prefix_cache``, ``admission``, ``model``.

Use it as ``async with LocalEngine(...) as engine:`` (the task group lives in that block).
"""

from __future__ import annotations

from engines.contract import EngineCapabilities
from engines.local.generation import GenerationPath
from engines.local.managed_path import ManagedPath


class LocalEngine(ManagedPath, GenerationPath):
    """In-process reference engine implementing :class:`engines.contract.Engine`.

    ``transport`` is what the ledger should use with it: ``"staged"`` (buckets through
    ``transfer``) or ``"artifact"`` (``load`` reads ``candidate.artifact_path``); both work
    either way. ``artifact_root``, when set, confines every path load to that directory.
    """

    kind = "local"
    # in process: no address, no extra body fields; it confirms a request's end (abort_request)
    capabilities = EngineCapabilities(confirms_end=True)
