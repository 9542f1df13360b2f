"""Token-level scheduling of the model: one worker at a time, requests interleaved, abortable.

Every piece of model work (a prefill, one decode step, installing or freeing an adapter) goes
through :meth:`Scheduler.run_model`: a worker thread behind a capacity limiter of one. So

* the event loop never runs torch code (it stays responsive while generating);
* the model, its peft adapters and the prefix cache see one caller at a time (no lock inside);
* requests take turns per token (the limiter is FIFO), so a long request does not starve others;
* cancellation -- an abort, a caller that went away, an engine stop -- takes effect between
  tokens. A step already handed to a thread always finishes first (``run_sync`` is not
  abandoned), so a request never releases its adapter while a step still computes with it.

Requests are decoded one sequence per forward (correctness first; no cross-request batching).
"""

from __future__ import annotations

import functools
import math
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import torch

from engines.contract import AmbiguousReply, CleanRefusal, ErrorCode, SamplingParams
from engines.local.model import DecodeState, ModelRunner
from engines.local.sampling import pick_token

T = TypeVar("T")
# Called on the event loop after each decoded token: (sample index, token id). It must not
# block; the OpenAI face feeds a stream with it.
OnToken = Callable[[int, int], None]


@dataclass
class Sample:
    """One sequence being decoded: tokens so far, and why it stopped (None = still going)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None
    text: str | None = None  # set by a stop string (truncated), else after decoding


@dataclass
class Decoded:
    request_id: str
    samples: list[Sample]
    cached_tokens: int


def check_params(params: SamplingParams, *, max_n: int) -> None:
    """Refuse (BAD_REQUEST) what the sampler cannot use: NaN passes every ``<`` test and then
    fails inside torch as an internal error, and an ``n`` in the thousands holds the model
    worker for every other request (n=30000 stalled a small one for 28 s)."""
    problems = []
    if not 1 <= params.n <= max_n:
        problems.append(f"n={params.n} must be in [1, {max_n}]")
    if params.max_tokens < 0:
        problems.append(f"max_tokens={params.max_tokens} must be >= 0")
    if not (math.isfinite(params.temperature) and params.temperature >= 0):
        problems.append(f"temperature={params.temperature} must be a finite number >= 0")
    if not (math.isfinite(params.top_p) and 0 < params.top_p <= 1):
        problems.append(f"top_p={params.top_p} must be in (0, 1]")
    if params.seed is not None and not 0 <= params.seed < 2**63:
        problems.append(f"seed={params.seed} must be in [0, 2^63)")
    if problems:
        raise CleanRefusal(ErrorCode.BAD_REQUEST, "; ".join(problems))


class Scheduler:
    def __init__(self, runner: ModelRunner, engine_id: str) -> None:
        self.runner = runner
        self.engine_id = engine_id
        self._limiter = anyio.CapacityLimiter(1)
        self._requests: dict[str, anyio.CancelScope] = {}
        self._gate: anyio.Event | None = None  # None = not paused
        self._running = 0
        self._closed = False

    async def run_model(self, fn: Callable[..., T], *args: Any) -> T:
        return await anyio.to_thread.run_sync(functools.partial(fn, *args), limiter=self._limiter)

    # --- control -----------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return self._running

    @property
    def paused(self) -> bool:
        return self._gate is not None

    def pause(self) -> None:
        """Freeze every request between tokens (SGLang ``in_place``); it keeps its adapter."""
        if self._gate is None:
            self._gate = anyio.Event()

    def resume(self) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.set()

    def abort(self, request_id: str) -> bool:
        """End one request at its next token boundary (its answer says ``abort``)."""
        scope = self._requests.get(request_id)
        if scope is None:
            return False
        scope.cancel()
        return True

    def abort_all(self) -> int:
        scopes = list(self._requests.values())
        for scope in scopes:
            scope.cancel()
        return len(scopes)

    def close(self) -> None:
        """Every request still running ends with ENGINE_STOPPED at its next token; one that
        reaches :meth:`decode` afterwards (it was still tokenizing) is refused there.

        The pause gate is opened too: a stopped engine has nothing left to resume it, and a
        request parked on it must wake to see the stop rather than wait forever."""
        self._closed = True
        self.abort_all()
        self.resume()

    # --- decoding ----------------------------------------------------------------------------

    async def decode(
        self,
        tokens: tuple[int, ...],
        adapter_id: str | None,
        params: SamplingParams,
        request_id: str | None,
        namespace: str,
        on_token: OnToken | None = None,
    ) -> Decoded:
        """Prefill once, then decode ``params.n`` samples. The caller's one lease covers every
        ``n > 1`` child: they run in a task group inside this call, so none outlives it."""
        rid = request_id or uuid.uuid4().hex
        # Checked before registering, with no await in between: a request that took its lease
        # before the stop but got here after it (its prompt was still being tokenized) was not
        # among those :meth:`close` aborted, and nothing else would ever end it.
        if self._closed:
            raise AmbiguousReply(ErrorCode.ENGINE_STOPPED, f"engine {self.engine_id} stopped")
        if rid in self._requests:
            raise CleanRefusal(ErrorCode.BAD_REQUEST, f"request id {rid} is already in flight")
        samples = [Sample() for _ in range(params.n)]
        cached = 0
        scope = anyio.CancelScope()
        self._requests[rid] = scope
        self._running += 1
        try:
            with scope:
                state, cached = await self.run_model(
                    self.runner.prefill, adapter_id, namespace, tokens
                )
                if params.n == 1:
                    await self._decode(state, adapter_id, params, 0, samples[0], on_token)
                else:
                    async with anyio.create_task_group() as tg:
                        for i in range(params.n):
                            tg.start_soon(
                                self._child, state, adapter_id, params, i, samples[i], on_token
                            )
        finally:
            self._running -= 1
            self._requests.pop(rid, None)
        if self._closed:
            raise AmbiguousReply(ErrorCode.ENGINE_STOPPED, f"engine {self.engine_id} stopped")
        for sample in samples:
            if sample.finish is None:  # only an abort ends a sample without a reason
                sample.finish = "abort"
        await self.run_model(_detokenize, self.runner, samples)
        return Decoded(rid, samples, cached)

    async def _child(
        self,
        state: DecodeState,
        adapter_id: str | None,
        params: SamplingParams,
        index: int,
        sample: Sample,
        on_token: OnToken | None,
    ) -> None:
        own = await self.run_model(self.runner.fork, state)
        await self._decode(own, adapter_id, params, index, sample, on_token)

    async def _decode(
        self,
        state: DecodeState,
        adapter_id: str | None,
        params: SamplingParams,
        index: int,
        sample: Sample,
        on_token: OnToken | None = None,
    ) -> None:
        generator: torch.Generator | None = None
        if params.temperature > 0:
            seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(6))
            generator = torch.Generator().manual_seed(seed + index)
        step = functools.partial(_step, self.runner, state, adapter_id, params, generator, sample)
        while sample.finish is None:
            if self._gate is not None:
                await self._gate.wait()
            if self._closed:
                return
            before = len(sample.tokens)
            await self.run_model(step)
            if on_token is not None and len(sample.tokens) > before:
                on_token(index, sample.tokens[-1])


def _detokenize(runner: ModelRunner, samples: list[Sample]) -> None:
    for sample in samples:
        if sample.text is None:
            sample.text = runner.decode(sample.tokens)


def _step(
    runner: ModelRunner,
    state: DecodeState,
    adapter_id: str | None,
    params: SamplingParams,
    generator: torch.Generator | None,
    sample: Sample,
) -> None:
    """One token (worker thread): pick it, decide whether the sample is done, else feed it."""
    if params.max_tokens <= len(sample.tokens):
        sample.finish = "length"
        return
    token, logprob = pick_token(
        state.logits, temperature=params.temperature, top_p=params.top_p, generator=generator
    )
    sample.tokens.append(token)
    sample.logprobs.append(logprob)
    if not params.ignore_eos and token == runner.eos_token_id:
        sample.finish = "stop"
        return
    if params.stop:
        text = runner.decode(sample.tokens)
        hits = [i for i in (text.find(s) for s in params.stop if s) if i >= 0]
        if hits:
            sample.text = text[: min(hits)]
            sample.finish = "stop"
            return
    if len(sample.tokens) >= params.max_tokens:
        sample.finish = "length"
        return
    runner.advance(state, adapter_id, token)
