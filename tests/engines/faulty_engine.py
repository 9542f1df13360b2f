"""Fault injection around a REAL engine: :class:`FaultyEngine`.

``FaultyEngine`` is not a stand-in or a mock. It wraps any :class:`~engines.contract.Engine`
(the in-process :class:`~engines.local.engine.LocalEngine`, an HTTP adapter, a vLLM server) and
forwards every call to it; on the calls you choose it injects what networks and processes really
do to a control plane, so the engine's own state (what it holds, its fences, its refcounts)
reacts for real:

========================  ===================================================================
fault                     what happens
========================  ===================================================================
:class:`Drop`             the call reaches the engine and runs to completion; the caller gets
                          ``AmbiguousReply(CONNECTION_LOST)`` (a lost reply)
:class:`Delay`            the call is held ``seconds`` before it is sent (``after=False``) or
                          before its reply is returned (``after=True``)
:class:`ServerError`      an ambiguous 5xx-style ``AmbiguousReply(SERVER_ERROR)`` *before*
                          sending: the engine never saw the call, the caller cannot know that
:class:`Refuse`           a ``CleanRefusal`` with a chosen code, the engine never saw the call
:class:`Restart`          the engine restarts (a new incarnation that holds nothing) before the
                          call is sent, or after it ran and before its reply is returned
:class:`Duplicate`        the same call is delivered twice (in line, or ``delay`` seconds later
                          in the background: a late duplicate); the caller gets the first reply
:class:`Swallow`          the engine answers success but never acted (prepare/transfer/load/
                          unload): the "adapter silently never applied" class of bugs
========================  ===================================================================

Faults are scheduled per method and per call number (deterministic, :meth:`FaultyEngine.inject`)
or drawn from per-method rates with a seeded generator (:class:`FaultyEngine` ``seed``/``rates``),
so a run is reproducible from its seed. Every call is recorded in :attr:`FaultyEngine.calls`
(method, call number, fault, outcome, deliveries) -- a test can also assert that *no* call
happened. The deterministic simulation (``tests/fault/sim_world.py``) injects its engine
faults through this wrapper.

Restarts need an engine that can be restarted from any task: wrap an
:class:`engines.testing.RestartableEngine` and pass its ``restart`` as the hook.

Test code: the shipped package only carries the restartable host (the demo restarts an engine).
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import anyio
import anyio.abc
import msgspec

from engines.contract import (
    AmbiguousReply,
    Bucket,
    Candidate,
    CleanRefusal,
    Engine,
    EngineCapabilities,
    EngineError,
    ErrorCode,
    Generation,
    Inventory,
    Receipt,
    SamplingParams,
    UnloadReceipt,
    ends_requests,
)

T = TypeVar("T")

METHODS = ("incarnation", "inventory", "prepare", "transfer", "load", "unload", "generate")
_SWALLOWABLE = frozenset({"prepare", "transfer", "load", "unload"})


# --- faults -----------------------------------------------------------------------------------


class Fault(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Base of the injectable faults."""


class Drop(Fault, frozen=True):
    """Delivered and executed; the reply is lost (``AmbiguousReply(CONNECTION_LOST)``)."""


class Delay(Fault, frozen=True):
    """Hold the call ``seconds`` before sending it, or (``after``) before returning its reply."""

    seconds: float
    after: bool = False


class ServerError(Fault, frozen=True):
    """A 5xx-style ambiguous answer before the call was sent (the engine never saw it)."""

    status: int = 503


class Refuse(Fault, frozen=True):
    """A clean refusal before the call was sent (the engine never saw it)."""

    code: str = ErrorCode.BAD_REQUEST
    message: str = "injected refusal"


class Restart(Fault, frozen=True):
    """Restart the engine before the call is sent, or (``after``) after it ran and before its
    reply is returned (the reply then names the old incarnation)."""

    after: bool = False


class Duplicate(Fault, frozen=True):
    """Deliver the call twice; the caller gets the first delivery's reply. With ``delay`` the
    second delivery arrives that many seconds later, in the background (a late duplicate)."""

    delay: float = 0.0


class Swallow(Fault, frozen=True):
    """Answer success without delivering the call: the engine never acted."""


class CallRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One call seen by the wrapper. ``outcome`` is ``"ok"`` or the error code the caller got;
    ``deliveries`` is how many times the engine actually received it (0, 1 or 2)."""

    method: str
    n: int
    fault: str | None
    outcome: str
    deliveries: int


class DuplicateRecord(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of a second delivery (the caller never sees it)."""

    method: str
    n: int
    outcome: str


# --- the wrapper ------------------------------------------------------------------------------


class FaultyEngine:
    """Fault injection around a real engine (see the module docstring).

    ``restart`` is the hook a :class:`Restart` fault calls (e.g.
    :meth:`engines.testing.RestartableEngine.restart`);
    without it, ``Restart`` is refused at :meth:`inject`. ``seed`` + ``rates`` draw faults for
    calls that have none scheduled: ``rates={"load": [(0.2, Drop()), (0.1, Delay(seconds=1))]}``
    (probabilities per call, summing to at most 1). Late duplicates (``Duplicate(delay>0)``) run
    in the wrapper's task group: use ``async with FaultyEngine(...)`` for them.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        restart: Callable[[], Awaitable[None]] | None = None,
        seed: int | None = None,
        rates: Mapping[str, Sequence[tuple[float, Fault]]] | None = None,
    ) -> None:
        self._engine = engine
        self._restart = restart
        self._rng = random.Random(seed)
        self._rates = {m: list(r) for m, r in (rates or {}).items()}
        for method, table in self._rates.items():
            self._check(method, *(f for _, f in table))
            if sum(p for p, _ in table) > 1.0 + 1e-9:
                raise ValueError(f"fault rates for {method} sum above 1")
        self._scheduled: dict[tuple[str, int], Fault] = {}
        self._counts: dict[str, int] = dict.fromkeys(METHODS, 0)
        self.calls: list[CallRecord] = []
        self.duplicates: list[DuplicateRecord] = []
        self._tg: anyio.abc.TaskGroup | None = None

    async def __aenter__(self) -> FaultyEngine:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        tg, self._tg = self._tg, None
        if tg is not None:
            await tg.__aexit__(None, None, None)

    # --- identity -------------------------------------------------------------------------

    @property
    def inner(self) -> Engine:
        return self._engine

    @property
    def engine_id(self) -> str:
        return self._engine.engine_id

    @property
    def kind(self) -> str:
        return self._engine.kind

    @property
    def transport(self) -> Any:
        return self._engine.transport

    @property
    def capabilities(self) -> EngineCapabilities:
        """The wrapped engine's: every call, ``extra_body`` included, is forwarded to it."""
        return self._engine.capabilities

    # --- scheduling -----------------------------------------------------------------------

    def _check(self, method: str, *faults: Fault) -> None:
        if method not in METHODS:
            raise ValueError(f"unknown engine method {method!r} (one of {METHODS})")
        for fault in faults:
            if isinstance(fault, Restart) and self._restart is None:
                raise ValueError("a Restart fault needs the restart hook")
            if isinstance(fault, Swallow) and method not in _SWALLOWABLE:
                raise ValueError(f"Swallow applies to {sorted(_SWALLOWABLE)}, not {method}")

    def inject(self, method: str, fault: Fault, *, call: int | None = None, times: int = 1) -> None:
        """Schedule ``fault`` on call number ``call`` of ``method`` (1-based, counted over the
        wrapper's life; default: the next call) and on the ``times - 1`` calls after it."""
        self._check(method, fault)
        first = self._counts[method] + 1 if call is None else call
        for n in range(first, first + times):
            self._scheduled[(method, n)] = fault

    def clear(self) -> None:
        """Drop every scheduled fault (seeded rates stay)."""
        self._scheduled.clear()

    def count(self, method: str | None = None) -> int:
        """Calls seen so far, of ``method`` or of every method."""
        if method is None:
            return sum(self._counts.values())
        return self._counts[method]

    def _next(self, method: str) -> tuple[int, Fault | None]:
        self._counts[method] += 1
        n = self._counts[method]
        fault = self._scheduled.pop((method, n), None)
        if fault is None and method in self._rates:
            draw = self._rng.random()
            for p, candidate in self._rates[method]:
                if draw < p:
                    fault = candidate
                    break
                draw -= p
        return n, fault

    # --- the injection core ---------------------------------------------------------------

    async def _run(
        self,
        method: str,
        deliver: Callable[[], Awaitable[T]],
        swallow: Callable[[], Awaitable[T]] | None = None,
    ) -> T:
        n, fault = self._next(method)
        label = None if fault is None else type(fault).__name__
        deliveries = 0

        def record(outcome: str) -> None:
            self.calls.append(
                CallRecord(method=method, n=n, fault=label, outcome=outcome, deliveries=deliveries)
            )

        try:
            if isinstance(fault, ServerError):
                raise AmbiguousReply(
                    ErrorCode.SERVER_ERROR,
                    f"injected HTTP {fault.status} on {method}",
                    engine_id=self.engine_id,
                    status=fault.status,
                )
            if isinstance(fault, Refuse):
                raise CleanRefusal(fault.code, fault.message, engine_id=self.engine_id, status=400)
            if isinstance(fault, Swallow):
                assert swallow is not None
                result = await swallow()
                record("ok")
                return result
            if isinstance(fault, Delay) and not fault.after:
                await anyio.sleep(fault.seconds)
            if isinstance(fault, Restart) and not fault.after:
                assert self._restart is not None
                await self._restart()
            deliveries = 1
            result = await deliver()
            if isinstance(fault, Duplicate):
                if fault.delay > 0:
                    if self._tg is None:
                        raise RuntimeError("a late Duplicate needs `async with FaultyEngine(...)`")
                    self._tg.start_soon(self._late_duplicate, method, n, deliver, fault.delay)
                else:
                    deliveries = 2
                    self.duplicates.append(await self._deliver_again(method, n, deliver))
            if isinstance(fault, Restart) and fault.after:
                assert self._restart is not None
                await self._restart()
            if isinstance(fault, Delay) and fault.after:
                await anyio.sleep(fault.seconds)
            if isinstance(fault, Drop):
                raise AmbiguousReply(
                    ErrorCode.CONNECTION_LOST,
                    f"injected: the reply to {method} was lost",
                    engine_id=self.engine_id,
                )
        except EngineError as exc:
            record(exc.code)
            raise
        except BaseException as exc:
            record(type(exc).__name__)
            raise
        record("ok")
        return result

    async def _deliver_again(
        self, method: str, n: int, deliver: Callable[[], Awaitable[Any]]
    ) -> DuplicateRecord:
        try:
            await deliver()
        except EngineError as exc:
            return DuplicateRecord(method=method, n=n, outcome=exc.code)
        return DuplicateRecord(method=method, n=n, outcome="ok")

    async def _late_duplicate(
        self, method: str, n: int, deliver: Callable[[], Awaitable[Any]], delay: float
    ) -> None:
        await anyio.sleep(delay)
        self.duplicates.append(await self._deliver_again(method, n, deliver))

    # --- the contract -----------------------------------------------------------------------

    async def incarnation(self) -> str:
        return await self._run("incarnation", self._engine.incarnation)

    async def inventory(self) -> Inventory:
        return await self._run("inventory", self._engine.inventory)

    async def prepare(self, candidate: Candidate) -> Receipt:
        async def fake() -> Receipt:
            return await self._fake_receipt(candidate, "prepared")

        return await self._run("prepare", lambda: self._engine.prepare(candidate), fake)

    async def transfer(self, candidate: Candidate, buckets: AsyncIterable[Bucket]) -> None:
        # Buckets are materialised so a duplicated delivery can send them again.
        items = [bucket async for bucket in buckets]

        async def deliver() -> None:
            await self._engine.transfer(candidate, _aiter(items))

        async def fake() -> None:
            return None

        await self._run("transfer", deliver, fake)

    async def load(self, candidate: Candidate) -> Receipt:
        async def fake() -> Receipt:
            return await self._fake_receipt(candidate, "ready")

        return await self._run("load", lambda: self._engine.load(candidate), fake)

    async def unload(self, lora_name: str, *, attempt: int | None = None) -> UnloadReceipt:
        async def fake() -> UnloadReceipt:
            return UnloadReceipt(
                engine_id=self.engine_id,
                incarnation=await self._engine.incarnation(),
                lora_name=lora_name,
                was_loaded=True,
            )

        return await self._run(
            "unload", lambda: self._engine.unload(lora_name, attempt=attempt), fake
        )

    async def generate(
        self,
        prompt: str | Sequence[int],
        lora_name: str | None,
        params: SamplingParams,
        **kwargs: Any,
    ) -> Generation:
        return await self._run(
            "generate", lambda: self._engine.generate(prompt, lora_name, params, **kwargs)
        )

    async def abort_request(self, request_id: str, lora_name: str | None) -> bool:
        """Forwarded as it is (no faults): the wrapped engine's word on a request's end."""
        ender = ends_requests(self._engine)
        return False if ender is None else await ender.abort_request(request_id, lora_name)

    async def aclose(self) -> None:
        await self._engine.aclose()

    async def _fake_receipt(self, candidate: Candidate, phase: Any) -> Receipt:
        return Receipt(
            engine_id=self.engine_id,
            incarnation=await self._engine.incarnation(),
            lora_name=candidate.lora_name,
            digest=candidate.digest,
            attempt=candidate.attempt,
            phase=phase,
        )


async def _aiter(items: list[Bucket]) -> AsyncIterator[Bucket]:
    for item in items:
        yield item
