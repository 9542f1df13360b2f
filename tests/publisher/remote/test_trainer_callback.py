"""A ``transformers.Trainer`` publishes the PEFT adapter it trains through ``PublishCallback``:
the global step is the version id, a ledger outage never crashes the run, a fatal refusal stops
it at the end of the step, and a run that would roll the policy back must say so.

Real components: the Trainer trains a LoRA on the tiny model for a few CPU steps, against a
``loraledger serve`` process on loopback with an in-process local engine (``--engine
e0=local:``), stopped by its PID; the versions are read back from the ledger's log. Before this
callback a trainer built on ``transformers`` had to hand-write the publication.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

from engines.local.tinymodel import ensure_tiny_model
from evlog.events import VersionPublished
from publisher import PublishCallback
from publisher.core.errors import Code
from publisher.drivers.publication import ErrorKind
from publisher.remote import HttpTrainerClient
from publisher.remote.trainer_callback import PublishReport, RollbackNotDeclared, _run_async
from tests.publisher.remote.test_http_trainer import adapter, logged
from tests.publisher.rollout_kit import ENGINE_WARNINGS
from tests.tools.test_serve import _Process

pytestmark = [*ENGINE_WARNINGS]
TOKEN = "callback-token"


@contextmanager
def serving(home: Path) -> Iterator[str]:
    """``loraledger serve`` over one in-process local engine, its log in ``home``."""
    home.mkdir()
    (home / "token").write_text(TOKEN + "\n")
    args = ["serve", "--db", "ledger.db", "--port", "0", "--token-file", "token"]
    proc = _Process(home, "serve", *args, "--engine", "e0=local:", "--json", cwd=home)
    try:
        yield str(proc.ready()["url"])
    finally:
        assert proc.stop() == 0, proc.stderr()


def train(out: Path, steps: int, *callbacks: Any, save_steps: int | None = None) -> Trainer:
    """A LoRA on the tiny model, trained for ``steps`` CPU steps with ``callbacks``, saving a
    checkpoint every ``save_steps`` steps if told."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(ensure_tiny_model())
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(base, lora)
    ids = torch.randint(0, 300, (8, 16))
    rows = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        save_strategy="no" if save_steps is None else "steps",
        save_steps=save_steps or 500,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=list(callbacks))
    trainer.train()
    return trainer


class AnotherTrainer(TrainerCallback):  # type: ignore[misc]
    """A second trainer on the same ledger publishes ``version`` after step ``at_step``."""

    def __init__(self, url: str, adapter_dir: Path, *, version: int, at_step: int) -> None:
        self.url, self.adapter_dir, self.version = url, adapter_dir, version
        self.at_step = at_step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step != self.at_step:
            return

        async def publish() -> None:
            async with HttpTrainerClient(self.url, token=TOKEN) as client:
                await client.publish(self.adapter_dir, step=self.version)

        _run_async(publish)


async def published(home: Path) -> list[int]:
    return [
        e.version_id for e in await logged(home / "ledger.db") if isinstance(e, VersionPublished)
    ]


@pytest.mark.anyio
async def test_every_n_steps_publishes_the_step_and_a_fatal_refusal_stops_training(
    tmp_path: Path,
) -> None:
    """Every 2 steps, the trained adapter is published as version 2, then 4. Then another
    trainer publishes version 100 (after step 5): step 6 is refused ``VERSION_REGRESSION``
    (fatal), and training stops at the end of that step, without a crash, instead of training
    2 more steps no rollout would see."""
    home = tmp_path / "serve"
    with serving(home) as url:
        other = AnotherTrainer(url, adapter(tmp_path, 1), version=100, at_step=5)
        callback = PublishCallback(url, token=TOKEN, every_n_steps=2)
        run = train(tmp_path / "run", 8, other, callback)
        assert run.state.global_step == 6  # stopped after the refused publication
        assert [(r.step, r.status, r.code) for r in callback.reports] == [
            (2, "PUBLISHED", None),
            (4, "PUBLISHED", None),
            (6, "FAILED", Code.VERSION_REGRESSION),
        ]
        assert callback.reports[-1].kind == ErrorKind.FATAL
        assert await published(home) == [2, 4, 100]


@pytest.mark.anyio
async def test_a_run_below_the_ledgers_versions_must_declare_the_rollback(tmp_path: Path) -> None:
    """The first run publishes at its checkpoint saves (steps 2 and 3, the last one at the end
    of training). A new run (step 0) against a ledger that holds version 3 is refused before it
    trains (``RollbackNotDeclared``: nothing is published). With ``allow_rollback=True`` it
    publishes step 1 (a rollback, meant), does not send steps 2 and 3 again (an earlier life
    published them), then publishes step 4."""
    home = tmp_path / "serve"
    with serving(home) as url:
        on_save = PublishCallback(url, token=TOKEN, on_save=True)
        train(tmp_path / "run-1", 3, on_save, save_steps=2)
        assert [(r.step, r.status) for r in on_save.reports] == [(2, "PUBLISHED"), (3, "PUBLISHED")]
        with pytest.raises(RollbackNotDeclared) as refused:
            train(tmp_path / "run-2", 2, PublishCallback(url, token=TOKEN, every_n_steps=1))
        assert refused.value.details == {"step": 0, "latest": 3}
        assert await published(home) == [2, 3]
        meant = PublishCallback(url, token=TOKEN, every_n_steps=1, allow_rollback=True)
        assert train(tmp_path / "run-3", 4, meant).state.global_step == 4
        assert [(r.step, r.status) for r in meant.reports] == [(1, "PUBLISHED"), (4, "PUBLISHED")]
        assert await published(home) == [2, 3, 1, 4]


def test_an_unreachable_ledger_is_reported_and_training_goes_on(tmp_path: Path) -> None:
    """Nothing listens at the ledger's address: each publication is reported ``RETRYABLE``
    ``LEDGER_CLOSED`` once its retry window passes, and every step is trained."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed on leaving: nothing listens there
    callback = PublishCallback(
        f"http://127.0.0.1:{port}", token=TOKEN, every_n_steps=1, retry_for_s=0.5
    )
    assert train(tmp_path / "run", 2, callback).state.global_step == 2
    assert [(r.step, r.status, r.kind, r.code) for r in callback.reports] == [
        (1, "FAILED", ErrorKind.RETRYABLE, Code.LEDGER_CLOSED),
        (2, "FAILED", ErrorKind.RETRYABLE, Code.LEDGER_CLOSED),
    ]
    assert all(isinstance(r, PublishReport) for r in callback.reports)
