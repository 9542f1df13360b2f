"""TrainerClient: the training loop's one call per sync, with a state dict or a peft model; the
published adapter generates exactly what the trainer's own peft model generates."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from engines.contract import SamplingParams
from engines.local.tinymodel import ensure_tiny_model, make_adapter
from evlog.events import PublicationSkipped, VersionPublished
from publisher.drivers.publication import PublicationOutcome
from publisher.drivers.trainer import ErrorKind, PublicationError, TrainerClient, to_builtins
from tests.publisher.plane_kit import PEFT_WARNINGS, local_engines, names, open_plane
from tests.support.log import events, of_type

pytestmark = [pytest.mark.anyio, PEFT_WARNINGS]

PROMPT_IDS = [12, 200, 7, 45, 301, 99]
STEPS = 10


def trainer_model(seed: int):  # type: ignore[no-untyped-def]
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(), dtype=torch.float32)
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj"],
        lora_dropout=0.0,
        init_lora_weights=False,  # non-zero B, so the adapter changes the outputs
    )
    return get_peft_model(base, config).eval()


def greedy(model) -> list[int]:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([PROMPT_IDS]),
            max_new_tokens=STEPS,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[0, len(PROMPT_IDS) :].tolist()  # type: ignore[no-any-return]


async def test_publish_a_peft_model_serves_what_the_trainer_trained(tmp_path: Path) -> None:
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    model = trainer_model(3)
    async with local_engines(2) as engines, open_plane(engines, tmp_path) as plane:
        trainer = TrainerClient(plane)
        first = await trainer.publish(model, step=1)
        expected = greedy(model)
        for e in engines:
            g = await e.generate(PROMPT_IDS, first.lora_name, params)
            assert list(g.token_ids) == expected
        # the next training step changes the weights; the published version does not change
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(-1.0)
        assert greedy(model) != expected
        g = await engines[0].generate(PROMPT_IDS, first.lora_name, params)
        assert list(g.token_ids) == expected
        second = await trainer.publish(model, step=2)
        assert second.status == "PUBLISHED" and second.digest != first.digest
        g = await engines[1].generate(PROMPT_IDS, second.lora_name, params)
        assert list(g.token_ids) == greedy(model)


async def test_state_dict_publication_returns_plain_data(tmp_path: Path) -> None:
    config, tensors = make_adapter(9)
    arrays = {k: torch.frombuffer(bytearray(t.data), dtype=torch.float32).reshape(t.shape)
              for k, t in tensors.items()}  # fmt: skip
    async with local_engines(2) as engines, open_plane(engines, tmp_path, capacity=1) as plane:
        trainer = TrainerClient(plane)
        out = await trainer.publish(arrays, config=config, step=1)
        data = to_builtins(out)
        assert data["status"] == "PUBLISHED" and data["version_id"] == 1
        assert set(out.ready_latency()) == {"e0", "e1"}
        assert msgspec.convert(data, PublicationOutcome) == out
        for e in engines:
            assert out.lora_name in await names(e)
        assert trainer.status().default == 1
        # capacity 1 and v1 bound: the next step is SKIPPED, never an error
        await plane.ledger.register_owner("w", ttl_s=600)
        await plane.ledger.bind("s", "w")
        skipped = await trainer.publish(arrays, config={**config, "lora_alpha": 32}, step=2)
        assert skipped.status == "SKIPPED"
        assert of_type(await events(plane.ledger), PublicationSkipped)[0].version_id == 2
        with pytest.raises(TypeError, match="config"):
            await trainer.publish(arrays, step=3)


async def test_the_same_step_with_other_weights_is_a_fatal_conflict(tmp_path: Path) -> None:
    c1, t1 = make_adapter(1)
    _, t2 = make_adapter(2)
    async with local_engines(2) as engines, open_plane(engines, tmp_path) as plane:
        trainer = TrainerClient(plane)
        await trainer.publish(t1, config=c1, step=5)
        with pytest.raises(PublicationError) as info:
            await trainer.publish(t2, config=c1, step=5)
        assert info.value.code == "VERSION_CONFLICT" and info.value.kind == ErrorKind.FATAL
        with pytest.raises(PublicationError) as bad:
            await trainer.publish(t1, config=c1, step=0)
        assert bad.value.code == "INVALID_VERSION"


async def test_a_step_below_the_default_is_refused_unless_an_explicit_rollback(
    tmp_path: Path,
) -> None:
    """Regression: step 5 after step 12 committed and silently rolled the policy back."""
    config, tensors = make_adapter(1)
    _, older = make_adapter(2)
    async with local_engines(2) as engines, open_plane(engines, tmp_path, capacity=3) as plane:
        trainer = TrainerClient(plane)
        await trainer.publish(tensors, config=config, step=12)
        with pytest.raises(PublicationError) as info:
            await trainer.publish(older, config=config, step=5)
        assert info.value.code == "VERSION_REGRESSION" and info.value.kind == ErrorKind.FATAL
        refused = of_type(await events(plane.ledger), PublicationSkipped)
        assert [(e.version_id, e.code) for e in refused] == [(5, "VERSION_REGRESSION")]
        assert trainer.status().default == 12
        out = await trainer.publish(older, config=config, step=5, allow_rollback=True)
        assert out.status == "PUBLISHED" and out.retired == 12
        assert trainer.status().default == 5
        commits = of_type(await events(plane.ledger), VersionPublished)
        assert [(e.version_id, e.rollback) for e in commits] == [(12, False), (5, True)]
