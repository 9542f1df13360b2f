"""The gateway: the one place a session's generation is sent to an engine, for every face.

:meth:`Gateway.dispatch` is the dispatch executor. The Python face (:meth:`Gateway.generate`,
``SessionBinder.generate``) and the OpenAI face (in ``serve``, in a gateway process, in a Ray
gateway actor) both call it with a *sender* -- how one attempt reaches one engine (an engine
call; an HTTP request relayed to a client) -- and it does everything else, once:

* **Re-check every per-turn rule before each attempt**, not only the first: the owner's lease
  (a renewal, cheap and not logged), the session's staleness (``SESSION_TOO_STALE`` when it is
  beyond the deployment's ``max_staleness``: a retry on another holder may start after new
  versions were published during the failed try), then the pin and routability (below). The
  checks and the in-flight increment run with no ``await`` between them, so a reclaim decided
  after the lease check cannot miss the request. Then the owner's lease is confirmed by the
  ledger itself (``owner.confirm_live()``: awaited for a remote ledger, whose renewals answer
  from memory; nothing to wait for in process), so a life the ledger has ended never sends.
* **Route only to holders, sticky per session.** A generation for a version goes to a routable
  engine that holds it (:meth:`LedgerView.holders <publisher.gateway.view.LedgerView.holders>`),
  chosen by rendezvous hashing of the session id over those holders with bounded load
  (:func:`publisher.gateway.affinity.place`), so every turn of a session, from any gateway
  process, lands on the same engine and its prefix cache; it moves only when that engine stops
  holding the version, stops being routable, or has more requests in flight from this gateway
  than ``1 + load_eps`` times the holders' mean and than ``load_floor`` (then to the next
  holder in its rendezvous order, where it stays while that one is within the bound).
  Sending an unloaded name to stock SGLang would silently reload it (docs/engines.md), so "not
  a holder" is never "try anyway". When none is left, a remote view is refreshed once (a bind
  may name a version published after the last copy); then the caller gets ``NO_ROUTE``.
* **At most once.** Once a request may have left this process, its outcome is the engine's
  to tell: an ambiguous failure becomes ``AMBIGUOUS_DISPATCH`` and nothing below the caller
  resends it. Only what provably did not run is tried on another holder of the same version,
  once per holder (:func:`~publisher.gateway.failures.try_elsewhere`). Any other clean refusal
  is ``GENERATION_FAILED``; when no holder is left after refusals, the last one is the answer.
* **Count what is in flight, until the engine says it is over.** Per (engine, version),
  incremented before the attempt; the owner's own tally too, which its lease renewals carry,
  and the new count is reported at once (``owner.report()``); a remote ledger forwards it on
  its renewal timer, or, when the ledger may hold that engine and version at zero, at once and
  answered before the attempt is sent (``owner.confirm_live()``; publisher/remote/renewals.py).
  The count ends when the engine's word does:
  its reply, a clean refusal, a send that never left. An attempt that ended without that word
  -- the caller cancelled (a client disconnect, ``close_session(cancel=True)``), a timeout, a
  lost reply -- may still run on the engine, so the request is aborted there
  (:class:`~engines.contract.EndsRequests`, for an engine whose capabilities say it can
  confirm) and the count ends when the engine confirms, at most ``abort_timeout_s`` later;
  unconfirmed, the count is *held* (:meth:`InFlightCounter.hold
  <publisher.gateway.inflight.InFlightCounter.hold>`) until a later confirmation
  (:meth:`Gateway.confirm_ends`, each lease renewal of a rollout worker) or until the engine's
  incarnation ends or it leaves the fleet. The reclaim driver reads
  :meth:`Gateway.inflight_evidence` before claiming a version.
* **Report trouble.** Every failure that says something about the engine
  (:func:`~publisher.drivers.engine_ops.says_about_engine`) goes to the one hook
  ``on_engine_trouble(engine, error, session=, incarnation=)``, whether or not another holder
  then takes the request. One that proves the engine could not be reached
  (:func:`~publisher.drivers.trouble.says_unreachable`) also takes it out of this gateway's own
  routing at once, for :data:`UNREACHABLE_MARK_S` or until the view shows another life of it:
  the ledger records the outage within moments and every view follows, but the turns this
  process routes meanwhile need not try the dead engine first.
* **Own the cache namespace.** Every attempt carries the version's salt (:func:`version_salt`),
  so two versions can never share prefix-cache entries whatever the client asks.

Every generation that reaches an engine can be written as a provenance row through
:meth:`Gateway.record` (the version that served it, the revision the session bound at, the head
revision at dispatch and at completion, the engine and its incarnation, the request ids, the
adapter name the engine echoed: a different one is logged and left visible, ``attested``
False, never hidden).
"""

from __future__ import annotations

import hashlib
import itertools
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import anyio
import msgspec

from engines.contract import (
    AmbiguousReply,
    EngineError,
    ErrorCode,
    Generation,
    SamplingParams,
    ends_requests,
)
from evlog.errors import INVALID_INPUT, InvalidInput, LoraLedgerError
from evlog.events import InFlight
from projections.staleness import staleness, too_stale
from publisher.core.errors import Code, LedgerError
from publisher.core.outcomes import Bound
from publisher.drivers.engine_ops import lacks_adapter, says_about_engine
from publisher.drivers.fleet import Fleet
from publisher.drivers.trouble import TroubleHook, says_unreachable
from publisher.gateway.affinity import (
    DEFAULT_LOAD_EPS,
    DEFAULT_LOAD_FLOOR,
    least_loaded,
    moved_by_load,
    place,
)
from publisher.gateway.failures import DispatchCode, DispatchError, NotSent, try_elsewhere
from publisher.gateway.inflight import InFlightCounter
from publisher.gateway.provenance import ProvenanceRecorder, ProvenanceRow, Usage
from publisher.gateway.view import LedgerView, refreshed
from publisher.logs import get_logger

log = get_logger("loraledger.gateway")

T = TypeVar("T")

# Client keys the gateway owns: the cache namespace, and what selects the adapter or request.
OWNED_KEYS = frozenset({"extra_key", "cache_salt", "lora_path", "lora_id", "rid", "model"})
DEFAULT_PARAMS = SamplingParams()
# How long a gateway keeps an engine it could not reach out of its own routing. The ledger
# records the outage within moments and every view routes around it from then on; this only
# covers that moment, and expires so that a wrong report cannot keep a live engine out.
UNREACHABLE_MARK_S = 3.0
# How many sessions' last engines a gateway remembers (soft state, oldest forgotten first): a
# forgotten session starts again from its rendezvous order, which only costs a cache miss.
PLACED_SESSIONS_KEPT = 65_536


class Attempt(msgspec.Struct, frozen=True, kw_only=True):
    """One try of a request on one engine, as the executor hands it to a face's sender."""

    engine_id: str
    request_id: str  # the id the engine sees: unique among its running requests
    cache_salt: str  # the version's prefix-cache namespace (:func:`version_salt`)
    head_revision: int  # the default's revision when the attempt started (staleness)
    started_at: float


class Owner(Protocol):
    """The lease a turn runs under (a :class:`~publisher.sessions.RolloutWorker`)."""

    @property
    def inflight(self) -> InFlightCounter:
        """This owner's requests in flight, carried by its lease renewals."""
        ...

    def ensure_live(self) -> None:
        """Renew the lease now, synchronously; raise ``LEASE_EXPIRED`` (or the owner's other
        end) when the ledger ended it."""
        ...

    def report(self) -> None:
        """Forward the current in-flight counts now; never raises."""
        ...

    async def confirm_live(self) -> None:
        """Have the ledger itself confirm the lease before the attempt is sent (a remote
        ledger's answer to a renewal, awaited; in process there is nothing to wait for);
        raise the refusal."""
        ...


class Unconfirmed:
    """A request whose attempt ended without the engine's word (cancelled, timed out, reply
    lost): counted until the engine confirms its end or the life it was sent to is over."""

    __slots__ = ("confirmed", "engine_id", "incarnation", "lora_name", "request_id", "version_id")

    def __init__(
        self, engine_id: str, version_id: int, request_id: str, lora_name: str, incarnation: str
    ) -> None:
        self.engine_id = engine_id
        self.version_id = version_id
        self.request_id = request_id
        self.lora_name = lora_name
        self.incarnation = incarnation  # the engine's life when the request was sent
        self.confirmed = False


class Served(msgspec.Struct, frozen=True, kw_only=True):
    """A completed generation of the Python face, and where it came from."""

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

    ``view`` is how this process reads the ledger (:class:`~publisher.gateway.view.LocalView`
    in process; a remote ledger's ``view``); ``fleet`` the engine handles it can reach.
    ``gateway_id`` names this reporter in in-flight evidence and provenance; ``clock`` stamps
    evidence and rows (pass the ledger's clock to keep one time base).

    ``on_engine_trouble(engine, error, session=, incarnation=)`` hears every failed generation
    that says something about its engine (:class:`~publisher.drivers.trouble.TroubleHook`). One
    hook, not one per kind of trouble, so that a deployment wires one receiver and that receiver
    hears everything: in process ``plane.reconciler.engine_trouble``; a remote ledger's
    ``engine_failed``. It is called synchronously, inside the failing dispatch, and must not
    block or await: a receiver only schedules work, so a report never delays the caller's
    answer or another holder's try.

    ``abort_timeout_s`` bounds how long an attempt that ended without the engine's word waits
    for the engine to confirm the request's end before its count is held (module docstring);
    the caller's cancellation waits that long at most.

    ``load_eps`` is how far over its version's holders' mean load (this gateway's requests in
    flight) an engine may go before a session's turn is placed on another holder (module
    docstring); ``math.inf`` is pure rendezvous, load ignored. Below ``load_floor`` requests
    in flight an engine is never over the bound (an engine batches that many at once)."""

    def __init__(
        self,
        fleet: Fleet,
        view: LedgerView,
        *,
        gateway_id: str = "gateway",
        recorder: ProvenanceRecorder | None = None,
        clock: Callable[[], float] = time.time,
        on_engine_trouble: TroubleHook | None = None,
        abort_timeout_s: float = 10.0,
        load_eps: float = DEFAULT_LOAD_EPS,
        load_floor: int = DEFAULT_LOAD_FLOOR,
    ) -> None:
        self.fleet = fleet
        self.load_eps = load_eps
        self.load_floor = load_floor
        # session -> the engine the load bound moved it to, oldest first (PLACED_SESSIONS_KEPT)
        self._placed: dict[str, str] = {}
        self.abort_timeout_s = abort_timeout_s
        self._unconfirmed: list[Unconfirmed] = []  # held counts, asked again by confirm_ends
        self.view = view
        self.gateway_id = gateway_id
        self.recorder = recorder
        self.on_engine_trouble = on_engine_trouble
        self._clock = clock
        self._inflight = InFlightCounter()
        self._load: dict[str, int] = {}  # engine -> requests in flight, all versions
        self._seen: dict[int, set[str]] = {}  # version -> engines it was ever sent to
        self._rr = itertools.count()  # round-robin start among equally loaded holders
        self._ids = itertools.count(1)
        self._prefix = uuid.uuid4().hex[:12]
        # engine -> (the life it was chosen at, monotonic time): could not be reached from here
        self._unreachable: dict[str, tuple[str, float]] = {}
        self.dispatched = 0  # attempts handed to an engine (refusals by a rule not counted)

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
        return staleness(bound.revision, self.view.default_revision)

    def check_staleness(self, bound: Bound) -> int:
        """The session's staleness, or ``SESSION_TOO_STALE`` when it exceeds the deployment's
        ``max_staleness``: the attempt must not be made (the session's binder then records the
        release, cause ``too_stale``)."""
        head = self.view.default_revision
        limit = self.view.max_staleness
        behind = staleness(bound.revision, head)
        if too_stale(bound.revision, head, limit):
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
        return behind

    # --- the executor ------------------------------------------------------------------------

    async def dispatch(
        self,
        bound: Bound,
        send: Callable[[Attempt], Awaitable[T]],
        *,
        request_id: str | None = None,
        engine_request_id: str | None = None,
        owner: Owner | None = None,
        check: Callable[[Bound], None] | None = None,
    ) -> T:
        """Send ``bound``'s request through ``send`` (one attempt on one engine; it raises the
        engine's :class:`~engines.contract.EngineError` when the attempt fails, or
        :class:`~publisher.gateway.failures.NotSent` to refuse before sending), by the rules
        of the module docstring, and return what ``send`` returned.

        ``request_id`` names the request in answers and logs (default: a new one);
        ``engine_request_id`` is what the engine sees (default: ``request_id``). ``owner``: the
        lease the turn runs under (checked before each attempt, its tally counted, its
        renewal forwarded after each admission). ``check``: the face's own rule of this
        request against the binding (the OpenAI face's pin of ``model``), checked before each
        attempt after the lease and the staleness bound; it raises the refusal.

        Raises :class:`~publisher.gateway.failures.DispatchError` (``NO_ROUTE``,
        ``AMBIGUOUS_DISPATCH``, ``GENERATION_FAILED``: its details name the ``engine`` and its
        ``engine_code``); ``LedgerError`` ``SESSION_TOO_STALE``, the owner's end or ``check``'s
        refusal (nothing was sent by the attempt refused); a ``NotSent``'s error."""
        rid = request_id or f"{self.gateway_id}-{self._prefix}-{next(self._ids)}"
        engine_rid = engine_request_id or rid
        tally = None if owner is None else owner.inflight
        tried: list[str] = []
        unreachable: list[str] = []
        refused: tuple[EngineError, str] | None = None  # the last clean refusal, and by whom
        read_again = False
        while True:
            # The per-turn rules, before every attempt; no await from here to the increment.
            if owner is not None:
                owner.ensure_live()
            self.check_staleness(bound)
            if check is not None:
                check(bound)
            engine_id = self.admit(bound, tried, tally)
            if engine_id is None:
                if not read_again:  # a remote view may not show the version's holders yet
                    read_again = True
                    await refreshed(self.view, request_id=rid)
                    continue
                if refused is not None:  # every holder refused: the last refusal is the answer
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
            life = self.view.incarnation(engine_id)  # the life this attempt was routed to
            over = False  # the engine's word ended the request: its count may end now
            try:
                if owner is not None:
                    owner.report()  # the new count, reached the ledger when confirm_live returns
                    try:
                        # The ledger's answer reaches a remote owner before anything is sent:
                        # a zombie whose sessions were released is refused here, not served.
                        await owner.confirm_live()
                    except LoraLedgerError as lost:
                        raise NotSent(lost) from None
                attempt = Attempt(
                    engine_id=engine_id,
                    request_id=engine_rid,
                    cache_salt=version_salt(bound),
                    head_revision=self.view.default_revision,
                    started_at=self._clock(),
                )
                result = await send(attempt)
                over = True
                return result
            except EngineError as exc:
                over = exc.clean or not exc.dispatched
                # Reported whether or not another holder takes the request: the engine may be
                # down or have lost a committed version, and that is checked now.
                self.report_trouble(engine_id, exc, session=bound.session, incarnation=life)
                if not try_elsewhere(exc):
                    raise self._failure(exc, bound, engine_id, rid) from exc
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
            except NotSent as refused:
                over = True
                self.dispatched -= 1  # nothing left this process
                raise refused.error from None
            except anyio.get_cancelled_exc_class():
                raise  # the caller is gone: the finally below aborts the request at the engine
            except Exception as exc:
                # Unknown failure after the attempt started: it may have been sent.
                raise self._ambiguous(bound, engine_id, rid, repr(exc)) from exc
            finally:
                if over:
                    self.finish(engine_id, bound.version_id, tally)
                else:
                    await self._end_at_engine(
                        Unconfirmed(engine_id, bound.version_id, engine_rid, bound.lora_name, life),
                        tally,
                    )

    # --- the Python face ---------------------------------------------------------------------

    async def generate(
        self,
        bound: Bound,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        turn: int | None = None,
        request_id: str | None = None,
        extra_body: Mapping[str, Any] | None = None,
        owner: Owner | None = None,
    ) -> Served:
        """Generate once for the session of ``bound`` on a holder of its version
        (:meth:`dispatch`), under ``owner``'s lease when given, and record its provenance row.

        Raises what :meth:`dispatch` raises, and ``InvalidInput`` for extra body fields sent
        to an engine that takes none (its ``capabilities.extra_body`` is False: nothing was
        sent)."""
        params = DEFAULT_PARAMS if params is None else params
        extra = _client_fields(extra_body)

        async def call_engine(attempt: Attempt) -> tuple[Generation, Attempt]:
            if attempt.engine_id not in self.fleet:  # removed since it was chosen: not sent
                raise AmbiguousReply(
                    ErrorCode.ENGINE_GONE,
                    f"engine {attempt.engine_id} left this process's fleet; nothing was sent",
                    engine_id=attempt.engine_id,
                    dispatched=False,
                )
            engine = self.fleet[attempt.engine_id]
            kwargs: dict[str, Any] = {
                "request_id": attempt.request_id,
                "cache_salt": attempt.cache_salt,
            }
            if extra:
                if not engine.capabilities.extra_body:
                    raise NotSent(
                        InvalidInput(
                            INVALID_INPUT,
                            f"engine {attempt.engine_id} takes no extra body fields "
                            f"({sorted(extra)})",
                        )
                    )
                kwargs["extra_body"] = extra
            generation = await engine.generate(prompt, bound.lora_name, params, **kwargs)
            return generation, attempt

        generation, attempt = await self.dispatch(
            bound, call_engine, request_id=request_id, owner=owner
        )
        row = await self.record(
            bound,
            attempt,
            Usage.of(generation),
            turn=turn,
            request_id=generation.request_id or attempt.request_id,
        )
        return Served(generation=generation, provenance=row)

    # --- provenance --------------------------------------------------------------------------

    async def record(
        self,
        bound: Bound,
        attempt: Attempt,
        usage: Usage,
        *,
        turn: int | None,
        request_id: str,
    ) -> ProvenanceRow:
        """The provenance row of ``attempt`` (``request_id`` is the caller's key for it; the
        engine's own id is kept beside it when different), recorded when this gateway has a
        recorder. A row whose engine named another adapter is logged: the trainer must not
        take that sample as on-policy."""
        row = ProvenanceRow(
            session=bound.session,
            turn=turn,
            engine=attempt.engine_id,
            incarnation=(
                usage.incarnation
                if usage.incarnation is not None
                else self.view.incarnation(attempt.engine_id)
            ),
            version_id=bound.version_id,
            lora_name=bound.lora_name,
            digest=bound.digest,
            bound_revision=bound.revision,
            head_revision=attempt.head_revision,
            head_revision_done=self.view.default_revision,
            request_id=request_id,
            engine_request_id=None if attempt.request_id == request_id else attempt.request_id,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
            finish_reason=usage.finish_reason,
            started_at=attempt.started_at,
            finished_at=self._clock(),
            gateway=self.gateway_id,
            served_name=usage.served_name,
            row_id=uuid.uuid4().hex,
            refusal_code=usage.refusal_code,
        )
        if not row.attested:
            log.error(
                "gateway.served_other_adapter",
                engine=attempt.engine_id,
                request_id=request_id,
                bound=bound.lora_name,
                served=usage.served_name,
            )
        if self.recorder is not None:
            await self.recorder.record(row)
        return row

    # --- accounting ----------------------------------------------------------------------------

    def choose(self, bound: Bound, tried: Sequence[str] = (), *, sticky: bool = True) -> str | None:
        """The engine for the next try of ``bound``'s request: a routable holder of its
        version in this fleet, not tried yet; by rendezvous hashing of the session id with
        bounded load (``sticky``), else the least loaded (round-robin among equals)."""
        holders = self._routable_holders(bound)
        if sticky:
            return place(
                bound.session,
                holders,
                load=self._load,
                eps=self.load_eps,
                floor=self.load_floor,
                current=self._placed.get(bound.session),
                exclude=tried,
            )
        return least_loaded(holders, load=self._load, exclude=tried, start=next(self._rr))

    def _routable_holders(self, bound: Bound) -> list[str]:
        return [
            e
            for e in self.view.holders(bound.lora_name)
            if e in self.fleet and not self.marked_unreachable(e)
        ]

    def admit(
        self,
        bound: Bound,
        tried: Sequence[str] = (),
        tally: InFlightCounter | None = None,
        *,
        sticky: bool = True,
    ) -> str | None:
        """Choose the engine and count the request in flight on it (and on ``tally``),
        synchronously. Every engine returned must be given back to :meth:`finish` exactly
        once; :meth:`dispatch` does both."""
        engine_id = self.choose(bound, tried, sticky=sticky)
        if engine_id is None:
            return None
        key = (engine_id, bound.version_id)
        self._inflight.enter(key)
        if tally is not None:
            tally.enter(key)
        self._load[engine_id] = self._load.get(engine_id, 0) + 1
        if sticky:
            self._placed.pop(bound.session, None)  # re-inserted: the newest entry
            holders = self._routable_holders(bound)
            if moved_by_load(bound.session, engine_id, holders, exclude=tried):
                self._placed[bound.session] = engine_id
                if len(self._placed) > PLACED_SESSIONS_KEPT:
                    del self._placed[next(iter(self._placed))]
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

    async def _end_at_engine(self, request: Unconfirmed, tally: InFlightCounter | None) -> None:
        """An attempt ended without the engine's word: abort the request there and end its
        count at the engine's confirmation, or hold the count (module docstring). Shielded: it
        runs while the caller is being cancelled, and is the cleanup that must not be skipped;
        bounded by ``abort_timeout_s``."""
        with anyio.move_on_after(self.abort_timeout_s, shield=True):
            request.confirmed = await self._ask_end(request)
        if request.confirmed:
            self.finish(request.engine_id, request.version_id, tally)
            return
        key = (request.engine_id, request.version_id)

        def gone() -> bool:
            return request.confirmed or self._life_over(request)

        self._inflight.hold(key, gone)
        if tally is not None:
            tally.hold(key, gone)
        self._load[request.engine_id] -= 1
        self._unconfirmed.append(request)
        log.warning(
            "gateway.end_unconfirmed",
            engine=request.engine_id,
            request_id=request.request_id,
            version_id=request.version_id,
        )

    async def _ask_end(self, request: Unconfirmed) -> bool:
        """Whether the engine confirms that ``request`` no longer runs (False when it cannot:
        no such capability, no handle, or the question failed)."""
        if request.engine_id not in self.fleet:
            return False
        ender = ends_requests(self.fleet[request.engine_id])
        if ender is None:
            return False
        try:
            return await ender.abort_request(request.request_id, request.lora_name)
        except Exception as exc:  # an engine error, or anything a handle lets through
            log.warning(
                "gateway.abort_failed",
                engine=request.engine_id,
                request_id=request.request_id,
                error=repr(exc),
            )
            return False

    def _life_over(self, request: Unconfirmed) -> bool:
        """The process life the request was sent to is over (a new incarnation, or the engine
        left this fleet): nothing of it runs any more that could use a version here."""
        return (
            request.engine_id not in self.fleet
            or self.view.incarnation(request.engine_id) != request.incarnation
        )

    async def confirm_ends(self) -> int:
        """Ask the engines again about every held request (each question bounded by
        ``abort_timeout_s``); returns how many are still held. A rollout worker calls it with
        each lease renewal, so a held count ends soon after the engine can confirm."""
        for request in list(self._unconfirmed):
            if not (request.confirmed or self._life_over(request)):
                with anyio.move_on_after(self.abort_timeout_s):
                    request.confirmed = await self._ask_end(request)
        self._unconfirmed = [
            r for r in self._unconfirmed if not (r.confirmed or self._life_over(r))
        ]
        return len(self._unconfirmed)

    @property
    def unconfirmed(self) -> int:
        """Requests whose count is held until the engine confirms their end (or their
        engine's life ends)."""
        return sum(1 for r in self._unconfirmed if not (r.confirmed or self._life_over(r)))

    def report_trouble(
        self, engine_id: str, error: EngineError, *, session: str = "", incarnation: str = ""
    ) -> None:
        """A generation of ``session`` sent to ``engine_id`` (its life ``incarnation``, as
        routed) failed with ``error``: tell ``on_engine_trouble`` when the failure says
        something about the engine, so its receiver looks at that engine now; a refusal about
        the request is not reported. An engine that could not be reached leaves this gateway's
        routing at once (:meth:`marked_unreachable`)."""
        if not says_about_engine(error):
            return
        if lacks_adapter(error):
            log.warning(
                "gateway.adapter_missing", engine=engine_id, code=error.code, msg=error.message
            )
        if says_unreachable(error):
            life = incarnation or self.view.incarnation(engine_id)
            self._unreachable[engine_id] = (life, time.monotonic())
        if self.on_engine_trouble is not None:
            self.on_engine_trouble(
                engine_id,
                error,
                session=session,
                incarnation=incarnation or self.view.incarnation(engine_id),
            )

    def marked_unreachable(self, engine_id: str) -> bool:
        """Whether this gateway could not reach ``engine_id`` a moment ago: for
        :data:`UNREACHABLE_MARK_S`, and only while the view still shows the life it failed at
        (a restarted engine is the view's to route again, once repaired)."""
        mark = self._unreachable.get(engine_id)
        if mark is None:
            return False
        life, at = mark
        if time.monotonic() - at > UNREACHABLE_MARK_S or self.view.incarnation(engine_id) != life:
            del self._unreachable[engine_id]
            return False
        return True

    def _failure(self, exc: EngineError, bound: Bound, engine_id: str, rid: str) -> DispatchError:
        if not exc.clean:
            return self._ambiguous(bound, engine_id, rid, f"{exc.code}: {exc.message}", exc.code)
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


def _client_fields(extra_body: Mapping[str, Any] | None) -> dict[str, Any]:
    """The client's extra body minus every key the gateway owns (dropped, never forwarded)."""
    if not extra_body:
        return {}
    return {k: v for k, v in extra_body.items() if k not in OWNED_KEYS}
