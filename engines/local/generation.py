"""Generation on the local engine: a request takes its lease, decodes token by token, gives it back.

* **Per-request references** (:mod:`engines.local.refs`): a request takes its lease before
  dispatch and gives it back exactly once, in a ``finally`` -- normal finish, failure before
  dispatch, abort, caller cancellation or disconnect, ``n>1`` children sharing one lease. A name
  not held is refused with the reason the name table gives (reclaimed, not loaded, never
  loaded), or reloaded implicitly when it is an ordinary one (:mod:`engines.local.sglang_path`).
* **Model work** goes through :mod:`engines.local.scheduler`: requests interleave token by token,
  abort and cancellation take effect between tokens, and a step already running always completes
  before its lease can be released (no computation uses a freed adapter).
* **Prefix cache** keyed by the engine-local adapter id (:mod:`engines.local.prefix_cache`), and
  namespaced by ``cache_salt`` / ``extra_key``.
* **Generation control** as SGLang's: pause in place, continue, abort one request or all.
* **A confirmed end** (:meth:`GenerationPath.abort_request`, the contract's
  :class:`~engines.contract.EndsRequests`): abort a request by id and answer once it ended and
  gave its adapter back; an id aborted before its request arrived is refused when it does
  (a caller that gave up on a request must be able to count on it never running).
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio

from engines.contract import (
    Choice,
    CleanRefusal,
    EngineError,
    ErrorCode,
    Generation,
    SamplingParams,
)
from engines.local.model import ModelRunner
from engines.local.name_table import Resident
from engines.local.refs import Lease
from engines.local.scheduler import OnToken, Scheduler, check_params
from engines.local.sglang_path import SGLangPath

# Ids of requests aborted before they arrived, kept to refuse them when they do.
ABORTED_IDS_KEPT = 4096


class GenerationPath(SGLangPath):
    """Generating, and controlling generations in flight (module docstring). It builds on
    :class:`~engines.local.sglang_path.SGLangPath` because a request naming an unloaded ordinary
    name reloads it implicitly, as stock SGLang does."""

    @property
    def in_flight(self) -> int:
        return 0 if self._scheduler is None else self._scheduler.in_flight

    @property
    def eos_token_id(self) -> int | None:
        return self._require_runner().eos_token_id

    @property
    def max_length(self) -> int:
        return self._require_runner().max_length

    async def flush_cache(self) -> None:
        """Drop every prefix-cache entry (through the model worker, which owns the cache)."""
        runner = self._require_runner()
        await self._require_scheduler().run_model(runner.prefix_cache.clear)

    # --- generation control ------------------------------------------------------------------

    def pause_generation(self) -> None:
        """Freeze every in-flight request in place between tokens (SGLang ``in_place``)."""
        self._require_scheduler().pause()

    def continue_generation(self) -> None:
        self._require_scheduler().resume()

    @property
    def paused(self) -> bool:
        return self._scheduler is not None and self._scheduler.paused

    def abort(self, request_id: str) -> bool:
        """Stop one request at its next token; it answers with finish_reason ``abort``."""
        return self._require_scheduler().abort(request_id)

    def abort_all(self) -> int:
        return self._require_scheduler().abort_all()

    async def abort_request(self, request_id: str, lora_name: str | None = None) -> bool:
        """Abort ``request_id`` and return True once it no longer runs here: at once when it
        is not running (it ended, or has not arrived: it is then refused when it does), else
        when it ended at its next token boundary and released its adapter lease. Works on a
        stopped engine too (its requests end at their next token)."""
        ended = self._live.get(request_id)
        if ended is None:
            self._aborted[request_id] = None
            while len(self._aborted) > ABORTED_IDS_KEPT:
                del self._aborted[next(iter(self._aborted))]
            return True
        self._aborted[request_id] = None  # still tokenizing: refused before it decodes
        if self._scheduler is not None:
            self._scheduler.abort(request_id)
        await ended.wait()
        return True

    # --- generation ----------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | Sequence[int],
        lora_name: str | None,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        extra_key: str | None = None,
        on_token: OnToken | None = None,
    ) -> Generation:
        """Generate once. ``cache_salt``/``extra_key`` namespace the prefix cache (SGLang's
        fields); they never select or reveal another adapter's cache entries. ``on_token``
        (local only: the HTTP server's streaming) hears each token as it is decoded."""
        runner = self._require_runner()
        scheduler = self._require_scheduler()
        if request_id is not None and request_id in self._aborted:
            raise self._tag(
                CleanRefusal(
                    ErrorCode.BAD_REQUEST, f"request {request_id} was aborted before it started"
                )
            )
        if request_id is not None:
            if request_id in self._live:
                raise self._tag(
                    CleanRefusal(
                        ErrorCode.BAD_REQUEST, f"request id {request_id} is already in flight"
                    )
                )
            self._live[request_id] = anyio.Event()
        try:
            return await self._generate(
                runner,
                scheduler,
                prompt,
                lora_name,
                params,
                request_id,
                cache_salt,
                extra_key,
                on_token,
            )
        finally:  # after the lease went back: the end abort_request waits for
            if request_id is not None:
                self._live.pop(request_id).set()

    async def _generate(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        prompt: str | Sequence[int],
        lora_name: str | None,
        params: SamplingParams,
        request_id: str | None,
        cache_salt: str | None,
        extra_key: str | None,
        on_token: OnToken | None,
    ) -> Generation:
        try:
            check_params(params, max_n=self.limits.max_n)
            resident, lease = await self._acquire(lora_name)
        except EngineError as exc:
            raise self._tag(exc) from None
        try:  # from here on, every exit releases the lease exactly once
            tokens = await self._tokens(runner, scheduler, prompt, params)
            if request_id is not None and request_id in self._aborted:  # no await until decode
                raise CleanRefusal(ErrorCode.BAD_REQUEST, f"request {request_id} was aborted")
            decoded = await scheduler.decode(
                tokens,
                resident.adapter_id if resident is not None else None,
                params,
                request_id,
                f"{cache_salt or ''}\x00{extra_key or ''}",
                on_token,
            )
        except EngineError as exc:
            raise self._tag(exc) from None
        finally:
            if lease is not None:
                lease.release()
        choices = tuple(
            Choice(
                index=i,
                token_ids=tuple(s.tokens),
                text=s.text or "",
                logprobs=tuple(s.logprobs) if params.logprobs else None,
                finish_reason=s.finish or "abort",
            )
            for i, s in enumerate(decoded.samples)
        )
        first = choices[0]
        return Generation(
            engine_id=self.engine_id,
            incarnation=self._incarnation,
            lora_name=resident.lora_name if resident is not None else None,
            token_ids=first.token_ids,
            text=first.text,
            logprobs=first.logprobs,
            finish_reason=first.finish_reason,
            prompt_tokens=len(tokens),
            cached_tokens=decoded.cached_tokens,
            request_id=decoded.request_id,
            choices=choices if params.n > 1 else (),
        )

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids``, decoded on the model worker (the tokenizer is not safe
        to use from two threads at once)."""
        runner = self._require_runner()
        return await self._require_scheduler().run_model(runner.decode, list(token_ids))

    async def _acquire(self, name: str | None) -> tuple[Resident | None, Lease | None]:
        if name is None:
            return None, None
        got = self._names.acquire(name)
        if got is None:
            refusal = self._names.refusal_for_absent(name)
            if refusal is not None:
                raise refusal
            if not self.implicit_reload:
                raise CleanRefusal(ErrorCode.NOT_LOADED, f"LoRA adapter {name} is not loaded")
            await self._implicit_reload(name)
            got = self._names.acquire(name)  # no await since the reload registered it
            if got is None:
                raise CleanRefusal(ErrorCode.NOT_LOADED, f"LoRA adapter {name} is not loaded")
        return got

    async def _tokens(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        prompt: str | Sequence[int],
        params: SamplingParams,
    ) -> tuple[int, ...]:
        if isinstance(prompt, str):
            # on the model worker: a fast tokenizer must not be used by two threads at once
            tokens = tuple(await scheduler.run_model(runner.encode, prompt))
        else:
            tokens = tuple(prompt)
            bad = [
                t
                for t in tokens
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < runner.vocab_size
            ]
            if bad:
                raise CleanRefusal(
                    ErrorCode.BAD_REQUEST,
                    f"token ids {bad[:5]} are outside the vocabulary [0, {runner.vocab_size})",
                )
        if not tokens:
            raise CleanRefusal(ErrorCode.BAD_REQUEST, "empty prompt")
        cost = params.n * (len(tokens) + params.max_tokens)
        if cost > self.limits.max_request_tokens:
            raise CleanRefusal(
                ErrorCode.BAD_REQUEST,
                f"n ({params.n}) x (prompt ({len(tokens)}) + max_tokens ({params.max_tokens})) "
                f"= {cost} tokens exceeds the per-request limit {self.limits.max_request_tokens}",
            )
        if len(tokens) + params.max_tokens > runner.max_length:
            raise CleanRefusal(
                ErrorCode.BAD_REQUEST,
                f"prompt ({len(tokens)}) + max_tokens ({params.max_tokens}) exceeds the "
                f"context length {runner.max_length}",
            )
        return tokens
