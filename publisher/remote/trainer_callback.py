"""Publishing from a ``transformers.Trainer``: :class:`PublishCallback` publishes the PEFT
adapter being trained, every ``every_n_steps`` optimizer steps and/or at every checkpoint
save, through :class:`~publisher.remote.trainer.HttpTrainerClient`, with the global step as the
version id::

    callback = PublishCallback(url, token=token, every_n_steps=50)
    Trainer(model=peft_model, args=args, train_dataset=data, callbacks=[callback]).train()

This module imports ``transformers`` (the ``engine`` extra); the ``publisher`` face names the
class lazily, so ``import publisher`` still loads no torch.

What happens to each publication (every one is logged under ``loraledger.trainer_callback``
and kept, in order, as a :class:`PublishReport` in :attr:`PublishCallback.reports`):

* **published** (``PUBLISHED``, ``NO_OP``, ``SKIPPED``: the ledger's outcome, capacity full
  after the first commit included) -- training goes on;
* **a retryable failure** (the ledger unreachable past ``retry_for_s``, a 503, a capacity stall,
  a corrupted upload) -- a warning; training goes on and the next publishing step tries anew
  with its own version. A ledger outage never crashes a training run;
* **a fatal refusal** (``INVALID_ADAPTER``, ``VERSION_REGRESSION``, ``VERSION_CONFLICT``, an
  ambiguous engine reply, ...) -- an error; with ``stop_on_fatal`` (the default) training stops
  at the end of that step, as an early-stopping callback stops it (the Trainer ends normally and
  saves as configured), because every later step of a run whose publications the ledger refuses
  trains a policy no rollout will see. ``stop_on_fatal=False`` reports and goes on.

Resuming: at the start of training the callback reads the ledger's status. When the run starts
at a step lower than a version the ledger already knows (a run resumed from an older checkpoint,
or a new run against an old ledger), its publications would roll the policy back: the callback
refuses to start (:class:`RollbackNotDeclared`, before any step is trained) unless
``allow_rollback=True`` says the rollback is meant, and then passes it with every publication.
Steps whose version ids the ledger already holds are not sent again (an earlier life of the run
published them; the ledger keeps the first bytes of an id). A ledger unreachable at the start
is only a warning: the publications decide then.

A publication runs inside the step (the Trainer waits for it): the version is on the engines,
or refused, before the next step trains -- what an on-policy loop wants. Only the main process
(``state.is_world_process_zero``) publishes.
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import msgspec
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from engines.artifacts import ArtifactError
from evlog.errors import InvalidInput, LoraLedgerError
from publisher.core.errors import Code
from publisher.drivers.publication import ErrorKind, PublicationError
from publisher.logs import get_logger
from publisher.remote.http import LedgerUnreachable
from publisher.remote.trainer import HttpTrainerClient

__all__ = ["PublishCallback", "PublishReport", "RollbackNotDeclared"]

log = get_logger("loraledger.trainer_callback")

T = TypeVar("T")


class PublishReport(msgspec.Struct, frozen=True, kw_only=True):
    """One publication the callback tried: ``status`` is the ledger's outcome (``PUBLISHED``,
    ``NO_OP``, ``SKIPPED``) or ``FAILED``; a failure's ``kind`` is ``RETRYABLE`` or
    ``FATAL`` and ``code`` / ``message`` say why."""

    step: int
    status: str
    kind: str | None = None
    code: str | None = None
    message: str = ""


class RollbackNotDeclared(InvalidInput):
    """The run would publish versions lower than one the ledger knows, and ``allow_rollback``
    was not passed: raised from ``on_train_begin``, before any step is trained. Code
    ``VERSION_REGRESSION``, the ledger's, which each of those publications would meet."""


def _run_async(work: Callable[[], Awaitable[T]]) -> T:
    """Run ``work`` to the end on an event loop of its own, in a thread of its own, so the
    Trainer's synchronous loop can call it whether or not its own thread runs a loop."""
    results: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        async def main() -> None:
            results.append(await work())

        try:
            anyio.run(main)
        except BaseException as exc:  # handed to the caller's thread below
            errors.append(exc)

    # daemon: a trainer interrupted (Ctrl-C) mid-publication exits; serve finishes or fails the
    # publication on its own, and a new one is asked under a new request id
    thread = threading.Thread(target=run, name="loraledger-publish", daemon=True)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return results[0]


class PublishCallback(TrainerCallback):  # type: ignore[misc]  # transformers is read untyped
    """Publishes the trained PEFT adapter to ``loraledger serve`` at ``url`` (see the module
    docstring). ``every_n_steps``: publish when the global step is a multiple of it;
    ``on_save``: publish at every checkpoint save (both may be set; a step is published once).
    ``retry_for_s`` bounds how long one publication waits out an unreachable ledger."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None,
        every_n_steps: int | None = None,
        on_save: bool = False,
        allow_rollback: bool = False,
        stop_on_fatal: bool = True,
        retry_for_s: float = 60.0,
        publish_timeout_s: float = 3600.0,
    ) -> None:
        if every_n_steps is None and not on_save:
            raise ValueError("PublishCallback needs every_n_steps or on_save=True")
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be at least 1, not {every_n_steps}")
        self.url = url
        self.every_n_steps = every_n_steps
        self.publish_on_save = on_save
        self.allow_rollback = allow_rollback
        self.stop_on_fatal = stop_on_fatal
        self._client_options: dict[str, Any] = {
            "token": token,
            "retry_for_s": retry_for_s,
            "publish_timeout_s": publish_timeout_s,
        }
        self.reports: list[PublishReport] = []
        self._known: frozenset[int] = frozenset()  # version ids the ledger held at the start
        self._last_tried: int | None = None

    # --- the Trainer's events ----------------------------------------------------------------

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        model = kwargs.get("model")
        if model is not None and not hasattr(model, "peft_config"):
            raise TypeError(
                "PublishCallback publishes a PEFT adapter: wrap the model with peft.get_peft_model"
            )
        if not state.is_world_process_zero:
            return
        try:
            status = _run_async(self._with_client(lambda c: c.status()))
        except (LedgerUnreachable, LoraLedgerError) as exc:
            log.warning("trainer_callback.status_unreadable", url=self.url, error=str(exc)[:200])
            return
        self._known = frozenset(v.version_id for v in status.versions)
        latest = max(self._known, default=status.default)
        if latest is not None and state.global_step < latest and not self.allow_rollback:
            raise RollbackNotDeclared(
                Code.VERSION_REGRESSION,
                f"training starts at step {state.global_step} but the ledger already holds "
                f"version {latest}: its publications would roll the policy back. Pass "
                "allow_rollback=True to mean it, or resume from a checkpoint at or after "
                f"step {latest}",
                step=state.global_step,
                latest=latest,
            )

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        if self.every_n_steps is not None and state.global_step % self.every_n_steps == 0:
            self._publish(state, control, kwargs["model"])

    def on_save(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        if self.publish_on_save:
            self._publish(state, control, kwargs["model"])

    # --- inside -------------------------------------------------------------------------------

    def _with_client(
        self, call: Callable[[HttpTrainerClient], Awaitable[T]]
    ) -> Callable[[], Awaitable[T]]:
        """A fresh client per call: each call runs on an event loop of its own."""

        async def work() -> T:
            async with HttpTrainerClient(self.url, **self._client_options) as client:
                return await call(client)

        return work

    def _publish(self, state: TrainerState, control: TrainerControl, model: Any) -> None:
        step = state.global_step
        if not state.is_world_process_zero or step < 1 or step == self._last_tried:
            return
        self._last_tried = step
        if step in self._known:
            log.info("trainer_callback.already_published", step=step)
            return
        with tempfile.TemporaryDirectory(prefix=f"loraledger-step-{step}-") as tmp:
            adapter_dir = Path(tmp)
            model.save_pretrained(adapter_dir)
            try:
                outcome = _run_async(
                    self._with_client(
                        lambda c: c.publish(
                            adapter_dir, step=step, allow_rollback=self.allow_rollback
                        )
                    )
                )
            except PublicationError as exc:
                self._failed(control, step, exc.kind, exc.code, exc.message)
                return
            except ArtifactError as exc:  # the saved adapter is not one an engine can load
                self._failed(control, step, ErrorKind.FATAL, exc.code, exc.message)
                return
        self.reports.append(
            PublishReport(
                step=step, status=outcome.status, code=outcome.code, message=outcome.message
            )
        )
        log.info(
            "trainer_callback.published",
            step=step,
            status=outcome.status,
            digest=outcome.digest[:16],
            code=outcome.code,
        )

    def _failed(
        self, control: TrainerControl, step: int, kind: str, code: str, message: str
    ) -> None:
        self.reports.append(
            PublishReport(step=step, status="FAILED", kind=kind, code=code, message=message)
        )
        if kind == ErrorKind.RETRYABLE:
            log.warning("trainer_callback.retryable", step=step, code=code, message=message)
            return
        stopping = self.stop_on_fatal
        log.error("trainer_callback.fatal", step=step, code=code, message=message, stop=stopping)
        if stopping:
            control.should_training_stop = True
