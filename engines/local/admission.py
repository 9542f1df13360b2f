"""What the local engine agrees to serve: the adapter admission check.

A refusal must happen *before* anything is built, and must be clean and named, because the
publisher treats a clean refusal as "nothing was left behind, retry is safe". So every check that
can fail runs here, on names, dtypes and shapes alone (the manifest at ``prepare``, the received
tensors again at ``load``), against the limits the engine was started with -- the same role as
SGLang's ``--max-lora-rank`` / ``--lora-target-modules`` pool configuration.

The result, :class:`AdapterPlan`, is everything the model worker needs to build the peft
adapter; building it cannot fail for a reason this module could have seen.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from engines.artifacts import ArtifactError, validate_adapter
from engines.contract import CleanRefusal, ErrorCode
from engines.manifest import TensorData

FLOAT_DTYPES = frozenset({"F32", "F16", "BF16"})
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")
# Config switches that change the computation in ways this engine does not implement: accepting
# them silently would serve something other than what the trainer trained.
_UNSUPPORTED_TRUTHY = (
    "use_dora",
    "modules_to_save",
    "rank_pattern",
    "alpha_pattern",
    "layers_to_transform",
    "layers_pattern",
    "fan_in_fan_out",
    "lora_bias",
)


class ServingLimits(msgspec.Struct, frozen=True, kw_only=True):
    """Fixed at engine start, like SGLang's LoRA memory-pool flags. ``max_n`` caps the parallel
    samples of one request and ``max_request_tokens`` the tokens one request may make the
    model process (every sample's prompt plus its ``max_tokens``, summed over a batch): one
    request must not hold the model worker for everybody else."""

    max_lora_rank: int = 64
    max_n: int = 64
    max_request_tokens: int = 32768
    target_modules: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )


class TensorShape(msgspec.Struct, frozen=True):
    name: str
    dtype: str
    shape: tuple[int, ...]


class AdapterPlan(msgspec.Struct, frozen=True, kw_only=True):
    """A validated adapter: rank, scaling inputs and the model modules it modifies."""

    r: int
    alpha: float
    use_rslora: bool
    modules: tuple[str, ...]  # full module paths in the base model, sorted


def shapes_of(tensors: Mapping[str, TensorData]) -> list[TensorShape]:
    return [TensorShape(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]


def plan_adapter(
    config: Mapping[str, Any],
    tensors: Iterable[TensorShape],
    module_shapes: Mapping[str, tuple[int, int]],
    limits: ServingLimits,
) -> AdapterPlan:
    """Admit or refuse an adapter. ``module_shapes`` maps each linear module path of the base
    model to ``(in_features, out_features)``.

    Raises :class:`CleanRefusal` with ``INVALID_ADAPTER`` (bad config, config/tensor mismatch,
    unknown module, wrong shape or dtype) or ``RANK_UNSUPPORTED`` (rank above the limit)."""
    tensors = list(tensors)
    _check_config(config, limits)
    try:  # the generic PEFT rules shared with the artifact store (rank per tensor, targets)
        validate_adapter(config, {t.name: _Shaped(t) for t in tensors})
    except ArtifactError as exc:
        raise CleanRefusal(exc.code, exc.message) from exc
    r = int(config["r"])
    parts: dict[str, set[str]] = {}
    for t in tensors:
        m = _KEY.match(t.name)
        if m is None:
            raise CleanRefusal(
                ErrorCode.INVALID_ADAPTER, f"tensor {t.name!r} is not a peft LoRA key"
            )
        module, part = m.group("module"), m.group("part")
        if t.dtype not in FLOAT_DTYPES:
            raise CleanRefusal(
                ErrorCode.INVALID_ADAPTER, f"tensor {t.name!r} has dtype {t.dtype}, not a float"
            )
        io = module_shapes.get(module)
        if io is None:
            raise CleanRefusal(
                ErrorCode.INVALID_ADAPTER, f"tensor {t.name!r}: the base model has no {module}"
            )
        leaf = module.rsplit(".", 1)[-1]
        if leaf not in limits.target_modules:
            raise CleanRefusal(
                ErrorCode.INVALID_ADAPTER,
                f"tensor {t.name!r} targets {leaf!r}; this engine serves "
                f"{list(limits.target_modules)}",
            )
        in_f, out_f = io
        expected = (r, in_f) if part == "A" else (out_f, r)
        if tuple(t.shape) != expected:
            raise CleanRefusal(
                ErrorCode.INVALID_ADAPTER,
                f"tensor {t.name!r} has shape {list(t.shape)}, {module} needs {list(expected)}",
            )
        seen = parts.setdefault(module, set())
        if part in seen:
            raise CleanRefusal(ErrorCode.INVALID_ADAPTER, f"duplicate tensor {t.name!r}")
        seen.add(part)
    lonely = sorted(m for m, p in parts.items() if p != {"A", "B"})
    if lonely:
        raise CleanRefusal(
            ErrorCode.INVALID_ADAPTER, f"modules with only one of lora_A/lora_B: {lonely}"
        )
    return AdapterPlan(
        r=r,
        alpha=float(config["lora_alpha"]),
        use_rslora=bool(config.get("use_rslora", False)),
        modules=tuple(sorted(parts)),
    )


def _check_config(config: Mapping[str, Any], limits: ServingLimits) -> None:
    if not isinstance(config, Mapping):
        raise CleanRefusal(ErrorCode.INVALID_ADAPTER, "adapter config is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise CleanRefusal(ErrorCode.INVALID_ADAPTER, f"peft_type {peft_type!r} is not LORA")
    for key in _UNSUPPORTED_TRUTHY:
        if config.get(key):
            raise CleanRefusal(
                ErrorCode.INVALID_ADAPTER, f"adapter config sets {key}={config[key]!r}: unsupported"
            )
    if config.get("bias", "none") not in ("none", None):
        raise CleanRefusal(ErrorCode.INVALID_ADAPTER, f"bias={config['bias']!r} is unsupported")
    r = config.get("r")
    if isinstance(r, int) and not isinstance(r, bool) and r > limits.max_lora_rank:
        raise CleanRefusal(
            ErrorCode.RANK_UNSUPPORTED,
            f"LoRA rank {r} exceeds this engine's max_lora_rank {limits.max_lora_rank}",
        )
    alpha = config.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or alpha <= 0:
        raise CleanRefusal(ErrorCode.INVALID_ADAPTER, f"lora_alpha={alpha!r} must be > 0")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        if targets != "all-linear":
            raise CleanRefusal(
                ErrorCode.INVALID_ADAPTER,
                f"target_modules {targets!r}: only a list or 'all-linear' is supported",
            )
    elif isinstance(targets, list | tuple):
        outside = sorted(set(targets) - set(limits.target_modules))
        if outside:
            raise CleanRefusal(
                ErrorCode.INVALID_ADAPTER,
                f"target_modules {outside} not served (this engine serves "
                f"{list(limits.target_modules)})",
            )


class _Shaped:
    """Adapts a :class:`TensorShape` to what ``validate_adapter`` reads (``.shape``)."""

    __slots__ = ("dtype", "shape")

    def __init__(self, t: TensorShape) -> None:
        self.shape = t.shape
        self.dtype = t.dtype
