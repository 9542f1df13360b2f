"""The OpenAI face: pinning for any stack that speaks OpenAI HTTP (docs/openai.md).

:class:`OpenAIGateway` answers one parsed request (:class:`~publisher.openai.request.Ask`) over
one :class:`~publisher.sessions.RolloutWorker` (the owner of every session it binds: shared
binds, lease, in-flight tally) and its :class:`~publisher.gateway.Gateway`. The rules are the
Python path's, reused, not restated:

* **Session**: the first generation binds it exactly as ``SessionBinder`` does (one shared
  bind, durable before anything is sent); with no session id the request is a one-turn
  session: bound, served, released.
* **model**: :mod:`publisher.openai.admission` (checked before the bind, and after it as one of
  the executor's per-attempt rules: the pin, after the lease and the staleness bound).
* **Dispatch**: :meth:`Gateway.dispatch <publisher.gateway.dispatch.Gateway.dispatch>`, the
  executor every face uses: the lease and the staleness are checked before each attempt (a
  retry on another holder included), what provably did not run may try the next holder once,
  anything ambiguous is ``502 AMBIGUOUS_DISPATCH`` and never resent, engine trouble is reported
  through the gateway's one hook. An attempt is one :meth:`Relay.forward
  <publisher.openai.relay.Relay.forward>`.
* **Provenance**: one row per request that reached an engine, aborted streams included
  (``finish_reason`` ``client_abort``, ``engine_error``, ``ambiguous``), written before the
  error reply, as is the in-flight count's decrement: a client that saw the 502 can rely on
  both.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import anyio
import httpx
import msgspec
from starlette.types import Receive, Send

from engines.contract import AmbiguousReply, CleanRefusal
from evlog.errors import LoraLedgerError
from projections.staleness import staleness
from publisher.core.errors import Code
from publisher.core.outcomes import Bound
from publisher.gateway import Attempt, DispatchCode, DispatchError, Gateway
from publisher.gateway.provenance import Usage
from publisher.logs import get_logger
from publisher.openai.admission import Admission
from publisher.openai.errors import OpenAICode, OpenAIError, Tracked, refusal_reply, send_error
from publisher.openai.relay import EngineRoute, Relay, UsageReader
from publisher.openai.request import Ask
from publisher.sessions import RolloutWorker, SessionBinder

log = get_logger("loraledger.openai")

# The largest request body the routes accept (413 BODY_TOO_LARGE beyond; --max-body-mb). A
# multimodal rollout sends its images inline as base64 data URLs (a 1080p screenshot is 2-5 MB
# so), several per turn in a computer-use episode, and engines set no cap of their own; the
# gateway buffers the body to parse it, so the cap also bounds what one request holds here.
MAX_BODY_BYTES = 64 * 1024 * 1024
# The longest the gateway waits for an engine's next bytes (502 AMBIGUOUS_DISPATCH past it;
# --upstream-timeout-s). Engines send nothing of a non-streaming reply before the generation
# ends, so there it bounds the whole request, queueing included; a stream: its first event,
# then each gap. An hour: long-reasoning rollouts on a busy engine outlast 10 minutes, and a
# client that gives up earlier disconnects, which aborts the request at once (docs/openai.md).
UPSTREAM_TIMEOUT_S = 3600.0


class OpenAIOptions(msgspec.Struct, frozen=True, kw_only=True):
    alias: str = "policy"  # the model name meaning "my session's version"
    token: str | None = None  # bearer token of the generation routes (None: they are refused)
    engine_token: str | None = None  # sent to engines as their --api-key
    upstream_timeout_s: float = UPSTREAM_TIMEOUT_S  # an engine's longest silence: see there
    connect_timeout_s: float = 5.0
    max_body_bytes: int = MAX_BODY_BYTES


class OpenAIGateway:
    """The OpenAI face over one rollout worker and its gateway (whose ``view`` of the ledger it
    reads). ``engines`` maps engine id to its OpenAI endpoint; an engine of the fleet without
    one is never routed to by this face. Its HTTP routes: :mod:`publisher.openai.routes`."""

    def __init__(
        self,
        worker: RolloutWorker,
        engines: Mapping[str, EngineRoute],
        options: OpenAIOptions | None = None,
        *,
        client: httpx.AsyncClient | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.worker = worker
        self.gateway: Gateway = worker.gateway
        self.view = self.gateway.view
        self.engines = dict(engines)
        self.options = options or OpenAIOptions()
        self.admission = Admission(self.view, self.options.alias)
        self.relay = Relay(
            engine_token=self.options.engine_token,
            upstream_timeout_s=self.options.upstream_timeout_s,
            connect_timeout_s=self.options.connect_timeout_s,
            client=client,
        )
        self.clock = clock
        self.requests = 0  # requests answered (any outcome)

    async def aclose(self) -> None:
        await self.relay.aclose()

    async def serve(self, ask: Ask, receive: Receive, send: Send) -> None:
        """Answer one parsed request on the ASGI ``send``; a client disconnect (``receive``)
        cancels the work, which closes the upstream connection (the engine aborts)."""
        self.requests += 1
        send = Tracked(send, ask.request_id)
        binder: SessionBinder | None = None
        try:
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                refusal = await self.admission.before_bind(ask)
                if refusal is not None:
                    # Nothing bound, nothing to release: no binder even exists (a one-turn
                    # session's release would write a tombstone for a session never bound).
                    await send_error(send, *refusal)
                else:
                    binder = self.worker.session(ask.session)
                    await self._turn(ask, binder, send)
                tg.cancel_scope.cancel()
        finally:
            if ask.one_turn and binder is not None:
                with anyio.CancelScope(shield=True):
                    await self.release_quietly(binder)

    async def release_quietly(self, binder: SessionBinder) -> None:
        try:
            await binder.close()
        except LoraLedgerError as exc:
            log.warning("openai.release_failed", session=binder.session_id, code=exc.code)

    async def _turn(self, ask: Ask, binder: SessionBinder, send: Send) -> None:
        try:
            async with binder.turn() as bound:
                await self._generate(ask, bound, binder.next_turn(), send)
        except LoraLedgerError as exc:
            await send_error(send, exc.code, exc.message)
            if exc.code == Code.SESSION_CLOSED and not ask.one_turn:
                # released in the ledger: this process forgets its cached binding too
                with anyio.CancelScope(shield=True):
                    await self.release_quietly(binder)

    async def _generate(self, ask: Ask, bound: Bound, turn: int, send: Send) -> None:
        """One generation through the gateway's executor; each attempt relays one engine's
        reply and writes its row."""
        turn_label = None if ask.one_turn else turn
        refused: tuple[Attempt, CleanRefusal] | None = None  # the last refusal, for its row

        async def attempt(a: Attempt) -> None:
            nonlocal refused
            route = self.engines.get(a.engine_id)
            if route is None:  # nothing sent; not about the engine, so not reported
                raise CleanRefusal(
                    OpenAICode.ENGINE_NOT_HTTP,
                    f"engine {a.engine_id} has no OpenAI endpoint in this gateway",
                    engine_id=a.engine_id,
                    dispatched=False,
                )
            usage = UsageReader()
            outcome = "ambiguous"  # what the row says unless the attempt says otherwise
            try:
                outcome = await self.relay.forward(
                    ask, bound, route, a, staleness(bound.revision, a.head_revision), usage, send
                )
            except CleanRefusal as refusal:
                # Nothing reached the client; a row is written only if it becomes the answer.
                outcome = ""
                refused = (a, refusal)
                raise
            except AmbiguousReply as exc:
                if not exc.dispatched:
                    outcome = ""  # never sent: no row
                raise
            except anyio.get_cancelled_exc_class():
                outcome = "client_abort"
                raise
            finally:
                if outcome:
                    with anyio.CancelScope(shield=True):
                        await self.gateway.record(
                            bound,
                            a,
                            usage.usage(outcome),
                            turn=turn_label,
                            request_id=ask.request_id,
                        )

        def pinned(bound: Bound) -> None:
            """The pin of ``model``, re-checked with the executor's per-attempt rules."""
            refusal = self.admission.after_bind(ask, bound)
            if refusal is not None:
                raise OpenAIError(*refusal)

        try:
            await self.gateway.dispatch(
                bound,
                attempt,
                request_id=ask.request_id,
                engine_request_id=ask.engine_request_id,
                owner=self.worker,
                check=pinned,
            )
        except DispatchError as exc:
            if exc.code == DispatchCode.NO_ROUTE:
                gone = self.admission.binding_gone(bound)
                if gone is not None:
                    raise gone from None  # _turn answers it and drops the binder
            elif (
                exc.code == DispatchCode.GENERATION_FAILED
                and refused is not None
                and refused[0].engine_id == exc.details.get("engine")
            ):
                # The engine's refusal is the answer, with the engine's own status and code.
                with anyio.CancelScope(shield=True):
                    await self.gateway.record(
                        bound,
                        refused[0],
                        Usage(finish_reason="engine_error"),
                        turn=turn_label,
                        request_id=ask.request_id,
                    )
                await send_error(send, *refusal_reply(refused[1]))
                return
            await send_error(send, exc.code, exc.message)
