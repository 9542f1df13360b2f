"""The generation gateway: the one place a session's generation is sent to an engine.

Four rules, each one a user-visible guarantee (docs/sessions.md):

* **Route only to holders, sticky per session.** A generation for a version goes to a
  routable engine that holds it (``RoutingView.holders(lora_name)``), chosen by rendezvous
  hashing of the session id over those holders (:mod:`publisher.affinity`), so every turn of a
  session, from any gateway process, lands on the same engine and its prefix cache; it moves
  only when that engine stops holding the version or stops being routable. If none holds it
  the caller gets ``NO_ROUTE``. Sending an unloaded name to stock SGLang would
  silently reload it (docs/engines.md), so "not a holder" is never "try anyway".
* **At most once.** Once a request may have left this process, its outcome is the engine's
  to tell: a timeout or a lost reply (``AmbiguousReply`` with ``dispatched=True``, or any
  unexpected failure) becomes ``AMBIGUOUS_DISPATCH`` and nothing below the caller resends it
  (a resend could produce a second, different sample the trainer never sees). Only what
  provably did not run is tried on another holder of the same version, once per holder
  (:func:`try_elsewhere`): a request that never left (``dispatched=False``: connection
  refused, a Ray engine actor known dead), or a clean ``NOT_LOADED`` (the engine answered
  that it does not hold the name: a restarted, empty engine routing has not caught up with).
  Any other clean refusal is ``GENERATION_FAILED``: nothing was generated, the caller may
  retry at will; when no holder is left, the last clean refusal is that answer.
* **Count what is in flight.** Per (engine, version), incremented before dispatch and
  decremented in a ``finally`` (cancellation included). The reclaim driver asks
  :meth:`Gateway.inflight_evidence` before claiming a version, and rollout workers carry the
  counts of their own requests (a ``tally`` counted here) with every lease renewal, so a
  version is never unloaded under a running request. Route choice and increment happen
  synchronously at the start of :meth:`Gateway.generate` (no ``await`` in between): a caller
  that checked its lease just before calling cannot be overtaken by a reclaim decision.
* **Own the cache namespace.** The client's ``extra_key``/``cache_salt`` are dropped and the
  gateway's per-version salt (:func:`version_salt`, a hex digest of the version's name, safe
  for every engine) is sent instead, so two versions can never share prefix-cache entries
  (docs/engines.md) whatever the client asks.

**A failure that says something about the engine** (:func:`says_about_engine`: it could not
be reached, is gone, failed ambiguously, or refused because it lacks the adapter) is reported
through the gateway's one hook, ``on_engine_trouble(engine, error)``
(:meth:`Gateway.report_trouble`), by this gateway and by its OpenAI face alike, so whoever
keeps the fleet true looks at that engine now rather than at its next periodic pass. The
receiver reads the error: in process the reconciler's
:meth:`~publisher.reconciler.Reconciler.engine_trouble` (a missing adapter: that engine's
inventory is read at once, the loss recorded as ``AdapterLost`` and routed around within
moments; anything else: the engine is probed at once, and a failed probe counts towards its
suspension), on Ray ``RayLedger.engine_failed``, which forwards the error to the ledger actor's
reconciler. A refusal about the request itself (``BAD_REQUEST``) says nothing about the engine
and is not reported. The failure itself is answered to the caller as below and is not resent
here; a clean refusal's retry is routed by the updated ledger.

Every result carries its provenance (:class:`publisher.provenance.ProvenanceRow`): the version
that served it, the revision the session bound at, the head revision at dispatch and at
completion (staleness), the engine, the request id, and the adapter name the engine echoed (a
different one is logged and left visible in the row, ``attested`` False, never hidden).

Routing state is read through :class:`RoutingView` (``holders`` + ``default_revision``):
:class:`LedgerRouting` reads it from an in-process ledger, and
:class:`publisher.ray.routing.RemoteRouting` from the snapshots the Ray ledger actor sends with
its replies.
"""

from __future__ import annotations

import hashlib
import itertools
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import msgspec

from engines.contract import EngineError, ErrorCode, Generation, SamplingParams
from evlog.errors import (
    INVALID_INPUT,
    Ambiguous,
    InvalidInput,
    LoraLedgerError,
    Refused,
    Unavailable,
)
from evlog.events import InFlight
from projections.registry import RegistryState
from projections.staleness import staleness, too_stale
from publisher.affinity import least_loaded, rendezvous
from publisher.errors import Code, LedgerError
from publisher.fleet import Fleet
from publisher.logs import get_logger
from publisher.outcomes import Bound
from publisher.provenance import ProvenanceRecorder, ProvenanceRow

log = get_logger("loraledger.gateway")

# Client keys the gateway owns: the cache namespace, and what selects the adapter or request.
OWNED_KEYS = frozenset({"extra_key", "cache_salt", "lora_path", "lora_id", "rid", "model"})
DEFAULT_PARAMS = SamplingParams()
# Clean refusals meaning "this engine does not hold the adapter": a possible lost adapter.
MISSING_CODES = frozenset({ErrorCode.NOT_LOADED, ErrorCode.NAME_RECLAIMED})


class DispatchCode:
    """The gateway's codes: why a generation did not come back."""

    NO_ROUTE = "NO_ROUTE"  # no routable engine holds the session's version (or none reachable)
    AMBIGUOUS_DISPATCH = "AMBIGUOUS_DISPATCH"  # sent, outcome unknown: never resent for you
    GENERATION_FAILED = "GENERATION_FAILED"  # the engine refused cleanly (nothing generated)


class DispatchError(LoraLedgerError):
    """A generation that did not come back; ``DispatchError(code, ...)`` is the family class
    below, so a caller retries ``Refused``/``Unavailable`` at will and treats ``Ambiguous`` as
    a sample that may exist on the engine."""


class DispatchRefused(DispatchError, Refused, codes=[DispatchCode.GENERATION_FAILED]):
    """The engine refused cleanly: nothing was generated."""


class DispatchUnavailable(DispatchError, Unavailable, codes=[DispatchCode.NO_ROUTE]):
    """No routable engine holds the version, or none that does could be reached: nothing
    was sent."""


class DispatchAmbiguous(DispatchError, Ambiguous, codes=[DispatchCode.AMBIGUOUS_DISPATCH]):
    """The request may have reached an engine and its outcome is unknown: it was not resent."""


# Clean refusals that say the engine does not hold the name (not that the request is bad):
# another holder may serve it. NAME_RECLAIMED is left out on purpose: an engine that unloaded a
# version a session is still bound to is a premature reclaim, which must surface, not be hidden.
HOLDER_REFUSALS = frozenset({ErrorCode.NOT_LOADED})


def try_elsewhere(exc: EngineError) -> bool:
    """Whether a generation that failed with ``exc`` may go to another holder: only when it
    provably did not run -- never sent (``dispatched`` False), or refused cleanly by an
    engine that does not hold the name. An ambiguous failure (sent, outcome unknown) never
    qualifies, whatever its code."""
    if not exc.dispatched:
        return True
    return exc.clean and exc.code in HOLDER_REFUSALS


def says_about_engine(exc: EngineError) -> bool:
    """Whether a failed generation is evidence about the engine rather than about the request:
    every failure that is not a clean refusal (unreachable, gone, timed out, lost reply, 5xx:
    the engine may be down or restarted, only a probe can tell), and the clean refusals that say
    it lacks the adapter (:data:`MISSING_CODES`: it may have lost a committed version). Any
    other clean refusal (``BAD_REQUEST``, an invalid name) proves the engine answered and holds
    what it should: nothing to look at. The former is reported through the gateway's
    ``on_engine_trouble`` hook."""
    return not exc.clean or exc.code in MISSING_CODES


def lacks_adapter(exc: EngineError) -> bool:
    """Whether ``exc`` is the engine's own clean answer that it does not hold the adapter asked
    for: the receiver of ``on_engine_trouble`` reads its inventory, not just its health (a
    probe alone cannot see a lost adapter)."""
    return exc.clean and exc.code in MISSING_CODES


class RoutingView(Protocol):
    """The read-only routing state the gateway needs."""

    def holders(self, lora_name: str) -> tuple[str, ...]:
        """Routable engines that hold ``lora_name``."""
        ...

    @property
    def default_revision(self) -> int: ...

    @property
    def max_staleness(self) -> int | None:
        """The deployment's bound on a session's staleness (None: unbounded)."""
        ...


class LedgerRouting:
    """A :class:`RoutingView` over an in-process ledger. It reads ``ledger.state`` on every
    call because the ledger may replace its state object (rebuilt from the log after a failed
    append): holding on to one state object would route from a stale projection."""

    def __init__(self, ledger: Any) -> None:
        self._ledger = ledger

    def holders(self, lora_name: str) -> tuple[str, ...]:
        state: RegistryState = self._ledger.state
        return state.holders(lora_name)

    @property
    def default_revision(self) -> int:
        state: RegistryState = self._ledger.state
        return state.default_revision

    @property
    def max_staleness(self) -> int | None:
        state: RegistryState = self._ledger.state
        return state.max_staleness


class Served(msgspec.Struct, frozen=True, kw_only=True):
    """A completed generation and where it came from."""

    generation: Generation
    provenance: ProvenanceRow

    @property
    def version_id(self) -> int:
        return self.provenance.version_id

    @property
    def lora_name(self) -> str:
        return self.provenance.lora_name

    @property
    def engine(self) -> str:
        return self.provenance.engine

    @property
    def staleness(self) -> int:
        return self.provenance.staleness


class InFlightCounter:
    """Requests in flight per (engine, version_id): incremented before dispatch, decremented
    in a ``finally``. The gateway keeps one for everything it sends; a rollout worker passes
    its own (``tally``) so its lease renewals report exactly its requests, even when several
    workers share one gateway."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, int], int] = {}

    def enter(self, key: tuple[str, int]) -> None:
        self._counts[key] = self._counts.get(key, 0) + 1

    def exit(self, key: tuple[str, int]) -> None:
        left = self._counts[key] - 1
        if left:
            self._counts[key] = left
        else:
            del self._counts[key]

    def get(self, engine: str, version_id: int) -> int:
        return self._counts.get((engine, version_id), 0)

    def counts(self) -> dict[tuple[str, int], int]:
        """The non-zero counts (a copy)."""
        return dict(self._counts)

    def __bool__(self) -> bool:
        return bool(self._counts)


def version_salt(bound: Bound) -> str:
    """The prefix-cache namespace of one version: 128 bits of SHA-256 over its immutable name,
    in lowercase hex.

    The name is unique per deployment, version id and digest, so no two versions ever share an
    entry, while every session and every gateway process serving one version share its entries.
    Not the name itself: the salt goes to every engine and each one restricts it (vLLM refuses
    a ``cache_salt`` containing ``@``, which every name has, or longer than 128 characters, with
    a 400 on every generation); 32 hex characters are accepted everywhere."""
    return hashlib.sha256(bound.lora_name.encode()).hexdigest()[:32]


class Gateway:
    """Sends generations for bound sessions. One per process (or per rollout worker); safe to
    call from many tasks at once.

    ``gateway_id`` names this reporter in in-flight evidence and provenance; ``clock`` stamps
    evidence and rows (pass the ledger's clock to keep one time base).

    ``on_engine_trouble(engine, error)`` hears every failed generation that says something
    about its engine (:func:`says_about_engine`), from :meth:`generate` and from the OpenAI face
    (:meth:`report_trouble`). One hook, not one per kind of trouble, so that a deployment wires
    one receiver and that receiver hears everything (two hooks let callers wire one and silently
    drop the other kind): in process ``plane.reconciler.engine_trouble``, on Ray
    ``RayLedger.engine_failed``. It is called synchronously, inside the failing dispatch, and
    must not block or await: a receiver only schedules work (the reconciler's loop, a Ray
    call), so a report never delays the caller's answer or another holder's try."""

    def __init__(
        self,
        fleet: Fleet,
        routing: RoutingView,
        *,
        gateway_id: str = "gateway",
        recorder: ProvenanceRecorder | None = None,
        clock: Callable[[], float] = time.time,
        on_engine_trouble: Callable[[str, EngineError], None] | None = None,
    ) -> None:
        self.fleet = fleet
        self.on_engine_trouble = on_engine_trouble
        self.routing = routing
        self.gateway_id = gateway_id
        self.recorder = recorder
        self._clock = clock
        self._inflight = InFlightCounter()
        self._load: dict[str, int] = {}  # engine -> requests in flight, all versions
        self._seen: dict[int, set[str]] = {}  # version -> engines it was ever sent to
        self._rr = itertools.count()  # round-robin start among equally loaded holders
        self._ids = itertools.count(1)
        self._prefix = uuid.uuid4().hex[:12]
        self.dispatched = 0  # engine calls made (a call refused as never sent included)

    # --- in-flight evidence ------------------------------------------------------------------

    def inflight_counts(self) -> dict[tuple[str, int], int]:
        """Non-zero counts per (engine, version_id) of everything this gateway sent."""
        return self._inflight.counts()

    def inflight(self, engine: str, version_id: int) -> int:
        return self._inflight.get(engine, version_id)

    def inflight_evidence(self, version_id: int) -> list[InFlight]:
        """One entry per engine of the fleet (and any engine this version was ever sent to),
        zero counts included, so a claim records what it relied on for every engine."""
        engines = set(self.fleet.ids()) | self._seen.get(version_id, set())
        now = self._clock()
        if not engines:
            return [InFlight(reporter=self.gateway_id, engine="*", count=0, at=now)]
        return [
            InFlight(
                reporter=self.gateway_id,
                engine=engine,
                count=self._inflight.get(engine, version_id),
                at=now,
            )
            for engine in sorted(engines)
        ]

    # --- staleness ---------------------------------------------------------------------------

    def staleness(self, bound: Bound) -> int:
        """How many versions were published since ``bound``'s session bound, as of now: what
        the next generation's provenance will say (docs/sessions.md#staleness). A framework
        with its own off-policy rule reads it before each turn."""
        return staleness(bound.revision, self.routing.default_revision)

    def check_staleness(self, bound: Bound) -> int:
        """The session's staleness, or ``SESSION_TOO_STALE`` when it exceeds the deployment's
        ``max_staleness``: the turn must not be dispatched (the caller records the release,
        :class:`publisher.sessions.SessionBinder` does)."""
        head = self.routing.default_revision
        limit = self.routing.max_staleness
        if too_stale(bound.revision, head, limit):
            behind = staleness(bound.revision, head)
            raise LedgerError(
                Code.SESSION_TOO_STALE,
                f"session {bound.session} is bound to version {bound.version_id}, {behind} "
                f"versions behind the default (max_staleness {limit}): drop or restart the "
                "episode under a new session id",
                session=bound.session,
                version_id=bound.version_id,
                staleness=behind,
                max_staleness=limit,
            )
        return staleness(bound.revision, head)

    # --- generation --------------------------------------------------------------------------

    async def generate(
        self,
        bound: Bound,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        turn: int | None = None,
        request_id: str | None = None,
        extra_body: Mapping[str, Any] | None = None,
        tally: InFlightCounter | None = None,
    ) -> Served:
        """Generate once for the session of ``bound`` on a holder of its version. ``tally``
        (a rollout worker's counter) is counted exactly like the gateway's own.

        Raises ``DispatchError``: ``NO_ROUTE`` (no routable holder, or none reachable),
        ``AMBIGUOUS_DISPATCH`` (sent, outcome unknown: never resent), ``GENERATION_FAILED``
        (a clean refusal: nothing generated); ``InvalidInput`` (extra body fields for an
        engine that takes none: its ``capabilities.extra_body`` is False); ``LedgerError``
        ``SESSION_TOO_STALE`` (the session is beyond the deployment's ``max_staleness``:
        nothing dispatched)."""
        params = DEFAULT_PARAMS if params is None else params
        rid = request_id or f"{self.gateway_id}-{self._prefix}-{next(self._ids)}"
        extra = _client_fields(extra_body)
        tried: list[str] = []
        unreachable: list[str] = []
        refused: tuple[EngineError, str] | None = None  # the last clean refusal, and by whom
        while True:
            # Before every try, not only the first: a try on another holder may start after
            # new versions were published during the failed one, and what is served must be
            # within the bound when it is dispatched.
            self.check_staleness(bound)
            # No await between choosing and counting (see the module docstring).
            engine_id = self.admit(bound, tried, tally)
            if engine_id is None:
                if refused is not None:
                    raise self._failure(refused[0], bound, refused[1], rid) from refused[0]
                raise DispatchError(
                    DispatchCode.NO_ROUTE,
                    f"no routable engine holds {bound.lora_name}"
                    + (f" (unreachable: {', '.join(unreachable)})" if unreachable else ""),
                    lora_name=bound.lora_name,
                    version_id=bound.version_id,
                    unreachable=unreachable,
                )
            tried.append(engine_id)
            engine = self.fleet[engine_id]
            kwargs: dict[str, Any] = {"request_id": rid, "cache_salt": version_salt(bound)}
            if extra:
                if not engine.capabilities.extra_body:
                    self.finish(engine_id, bound.version_id, tally)
                    self.dispatched -= 1  # refused here: nothing was sent
                    raise InvalidInput(
                        INVALID_INPUT,
                        f"engine {engine_id} takes no extra body fields ({sorted(extra)})",
                    )
                kwargs["extra_body"] = extra
            head = self.routing.default_revision
            started = self._clock()
            key = (engine_id, bound.version_id)
            try:
                generation = await engine.generate(prompt, bound.lora_name, params, **kwargs)
            except EngineError as exc:
                # Reported whether or not another holder takes the request: the engine may
                # be down or have lost a committed version, and that is checked now.
                self.report_trouble(engine_id, exc)
                if try_elsewhere(exc):
                    # Provably did not run: another holder may take it (once per holder).
                    if exc.dispatched:
                        refused = (exc, engine_id)
                    else:
                        unreachable.append(engine_id)
                    log.warning(
                        "gateway.tried_elsewhere",
                        engine=engine_id,
                        request_id=rid,
                        code=exc.code,
                        dispatched=exc.dispatched,
                    )
                    continue
                raise self._failure(exc, bound, engine_id, rid) from exc
            except Exception as exc:
                # Unknown failure after the call started: it may have been sent.
                raise self._ambiguous(bound, engine_id, rid, repr(exc)) from exc
            finally:
                self.finish(*key, tally)
            row = self._row(bound, generation, engine_id, rid, turn, head, started)
            if not row.attested:
                # Recorded, never hidden: the trainer must not take this sample as on-policy.
                log.error(
                    "gateway.served_other_adapter",
                    engine=engine_id,
                    request_id=rid,
                    bound=bound.lora_name,
                    served=generation.lora_name,
                )
            if self.recorder is not None:
                await self.recorder.record(row)
            return Served(generation=generation, provenance=row)

    # --- internals -----------------------------------------------------------------------------

    # --- dispatch accounting, shared with the OpenAI face ------------------------------------

    def choose(self, bound: Bound, tried: Sequence[str] = (), *, sticky: bool = True) -> str | None:
        """The engine for the next try of ``bound``'s request: a routable holder of its
        version in this fleet, not tried yet; by rendezvous hashing of the session id
        (``sticky``), else the least loaded (round-robin among equals)."""
        holders = [e for e in self.routing.holders(bound.lora_name) if e in self.fleet]
        if sticky:
            return rendezvous(bound.session, holders, load=self._load, exclude=tried)
        return least_loaded(holders, load=self._load, exclude=tried, start=next(self._rr))

    def admit(
        self,
        bound: Bound,
        tried: Sequence[str] = (),
        tally: InFlightCounter | None = None,
        *,
        sticky: bool = True,
    ) -> str | None:
        """Choose the engine and count the request in flight on it, synchronously (no await
        between the two, and none between a caller's lease check and this call). Every
        engine returned must be given back to :meth:`finish` exactly once."""
        engine_id = self.choose(bound, tried, sticky=sticky)
        if engine_id is None:
            return None
        key = (engine_id, bound.version_id)
        self._inflight.enter(key)
        if tally is not None:
            tally.enter(key)
        self._load[engine_id] = self._load.get(engine_id, 0) + 1
        self._seen.setdefault(bound.version_id, set()).add(engine_id)
        self.dispatched += 1
        return engine_id

    def finish(self, engine_id: str, version_id: int, tally: InFlightCounter | None = None) -> None:
        """The request admitted on ``engine_id`` ended (completion, error, cancellation)."""
        key = (engine_id, version_id)
        self._inflight.exit(key)
        if tally is not None:
            tally.exit(key)
        self._load[engine_id] -= 1

    def report_trouble(self, engine_id: str, error: EngineError) -> None:
        """A generation sent to ``engine_id`` failed with ``error``: tell ``on_engine_trouble``
        when the failure says something about the engine (:func:`says_about_engine`), so its
        receiver looks at that engine now; a refusal about the request is not reported. Both
        faces call it for every engine failure, so the filter lives here, once."""
        if not says_about_engine(error):
            return
        if lacks_adapter(error):
            log.warning(
                "gateway.adapter_missing", engine=engine_id, code=error.code, msg=error.message
            )
        if self.on_engine_trouble is not None:
            self.on_engine_trouble(engine_id, error)

    def _failure(self, exc: EngineError, bound: Bound, engine_id: str, rid: str) -> DispatchError:
        if exc.clean:
            log.warning(
                "gateway.refused", engine=engine_id, request_id=rid, code=exc.code, msg=exc.message
            )
            return DispatchError(
                DispatchCode.GENERATION_FAILED,
                f"engine {engine_id} refused the generation cleanly: {exc.code}: {exc.message}",
                engine=engine_id,
                engine_code=exc.code,
                request_id=rid,
                version_id=bound.version_id,
            )
        return self._ambiguous(bound, engine_id, rid, f"{exc.code}: {exc.message}", exc.code)

    def _ambiguous(
        self, bound: Bound, engine_id: str, rid: str, reason: str, engine_code: str = ""
    ) -> DispatchError:
        log.error("gateway.ambiguous", engine=engine_id, request_id=rid, reason=reason)
        return DispatchError(
            DispatchCode.AMBIGUOUS_DISPATCH,
            f"request {rid} was sent to {engine_id} and its outcome is unknown ({reason}); "
            "it was not resent",
            engine=engine_id,
            engine_code=engine_code,
            request_id=rid,
            version_id=bound.version_id,
            session=bound.session,
        )

    def _row(
        self,
        bound: Bound,
        generation: Generation,
        engine_id: str,
        rid: str,
        turn: int | None,
        head: int,
        started: float,
    ) -> ProvenanceRow:
        return ProvenanceRow(
            session=bound.session,
            turn=turn,
            engine=engine_id,
            incarnation=generation.incarnation,
            version_id=bound.version_id,
            lora_name=bound.lora_name,
            digest=bound.digest,
            bound_revision=bound.revision,
            head_revision=head,
            head_revision_done=self.routing.default_revision,
            request_id=generation.request_id or rid,
            prompt_tokens=generation.prompt_tokens,
            completion_tokens=sum(len(c.token_ids) for c in generation.choices)
            or len(generation.token_ids),
            cached_tokens=generation.cached_tokens,
            finish_reason=generation.finish_reason,
            started_at=started,
            finished_at=self._clock(),
            gateway=self.gateway_id,
            served_name=generation.lora_name,
        )


def _client_fields(extra_body: Mapping[str, Any] | None) -> dict[str, Any]:
    """The client's extra body minus every key the gateway owns (dropped, never forwarded)."""
    if not extra_body:
        return {}
    return {k: v for k, v in extra_body.items() if k not in OWNED_KEYS}
