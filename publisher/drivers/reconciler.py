"""Reconciler: make the ledger's view of each engine true again, from the engine's own evidence.

The ledger only knows what engines proved. Whenever that proof may be stale -- at start, when an
engine comes back with a new incarnation, when a fatal or ambiguous entry blocks publication --
the reconciler reads each engine's inventory and turns it into decisions (docs/publication.md,
docs/engines.md):

* **Membership**: an engine of this process's fleet that the ledger does not know is joined
  (``EngineJoined``); a new incarnation is a restart (``EngineRestarted``): the engine lost every
  adapter and is not routable. At start, ledger members this process has no handle for leave
  (``EngineLeft``): the fleet a control plane is opened with is the fleet. An engine being
  removed is held out of every pass while it drains (:meth:`Reconciler.hold_out`): its handle
  is still here, but the ledger no longer has it, and joining it again would undo the removal.
* **Evidence**: the inventory's managed names (``{prefix}@{deployment}-``; foreign adapters are
  not ours) are recorded (``InventoryObserved``). The decider resolves a ``FAILED_FATAL``
  candidate once every engine of its attempt proved it absent (``FatalResolved``) and completes
  a reclaim once every engine proved absence (``VersionReclaimed``).
* **Cleanup**: a version being reclaimed is unloaded (attempt-fenced) *before* the engine's
  inventory counts as evidence for it, present or not (a failed restore may have staged bytes
  under the name); a fatal candidate still present is unloaded (attempt-fenced), and strays
  (managed names the engine should not hold: a reclaimed name that came back, a cleanly failed
  candidate that landed late) are unloaded, fenced by their version's last attempt when the
  ledger knows the name, and so are names the inventory reports *staged* (bytes never loaded)
  for a version that is over; then the inventory is observed again, which releases the
  entries.
* **Repair**: every version still needed (the default and every bound version) is loaded again
  on an engine that lacks it -- from the artifact store, which holds a verified directory for
  every version (staged engines get its bytes as buckets) -- confirmed by a fresh inventory and
  recorded (``VersionRestored``); then ``EngineRepaired`` makes the engine routable. Nothing is
  routed to a joined or restarted engine before that.
* **Orphans**: at start, a ``LOADING`` attempt belongs to a controller that no longer exists
  (the log has one writer). It is cleaned off the engines and ended ``FAILED_FATAL`` (its old
  driver's calls may still land), and the inventories read right after resolve it.

**Reachability** (docs/operations.md): the first failed probe of an engine, or the first
report of a generation that could not reach it (:meth:`Reconciler.engine_trouble`), records an
outage at once (``EngineUnreachable``, once, with its first error): the engine leaves routing
everywhere within moments, not ``suspend_after_s`` later. The failures the faces report while
it lasts are counted per session and recorded in batches (``DispatchFailures``); the first probe
of the same life that answers ends it (``EngineReachable``), a new life through the restart.

**Health** (docs/operations.md): an engine whose probes keep failing for ``suspend_after_s`` is
suspended (``EngineSuspended``, cause ``unhealthy``): one event when its health changes, never
one per probe; a probe that proves the engine gone for good (``ENGINE_GONE``, a dead Ray engine
actor) suspends it at the first failure. It gets no new traffic and publication and reclaim
stop waiting for it; once it answers again it is repaired like a restarted engine -- what it
owes (names reclaimed or resolved while it was away) unloaded, strays unloaded, needed
versions reloaded -- and ``EngineRepaired`` makes it routable. A needed version lost by a
routable engine (``AdapterLost``, recorded by the decider from the inventory) is reloaded
under its name; a restore the engine refuses, or one that keeps failing, suspends the engine
(cause ``lost_adapter``) to be repaired as a whole. Restores back off exponentially (up to
``restore_backoff_max_s``) within one life of the engine (a restarted engine owes nothing to
its previous life's failures: its first repair restores at once), and an inventory equal to
what the ledger knows writes nothing, so a restore that keeps failing does not grow the log.

The health loop (:meth:`Reconciler.run`) probes every engine's ``incarnation()`` each
``probe_interval_s`` (or when poked) and reconciles an engine that restarted, is not routable,
lacks a needed version, or is involved in a blocking entry; every ``full_every_s`` it reconciles
every engine anyway, so drift nobody reported (a stray loaded behind our back, SGLang's implicit
reload of an unloaded name) is found and undone too. Trouble somebody *did* report -- a
gateway whose generation failed in a way that says something about the engine
(:meth:`Reconciler.engine_trouble`, the gateway's ``on_engine_trouble`` hook) -- wakes the loop
at once: an engine that refused as not loaded is reconciled in full (a lost adapter is recorded
and routed around within moments, not at the next full pass), an engine that could not be
reached or failed ambiguously is probed (a failed probe counts towards its suspension, a new
incarnation is a restart, repaired before it serves). Engines are driven through
:mod:`publisher.drivers.engine_protocol` (restore: ``stage_and_load``; every cleanup:
``unload_fenced``), every call bounded (:mod:`publisher.drivers.engine_ops`); one engine's
failure never stops the others or the loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import msgspec

from engines.artifacts import ArtifactError, ArtifactStore
from engines.contract import (
    AmbiguousReply,
    Candidate,
    Engine,
    EngineError,
    ErrorCode,
    Generation,
    Inventory,
    SamplingParams,
)
from evlog.errors import LoraLedgerError
from evlog.events import InFlight, TurnFailures
from projections.registry import SERVING_STATES, VersionRecord, VersionState
from publisher.drivers.adapter_copy import DEFAULT_BUCKET_BYTES, plan_buckets
from publisher.drivers.adapter_source import RestoreBytes
from publisher.drivers.engine_ops import (
    EngineTimeouts,
    call,
    lacks_adapter,
    managed_names,
    managed_prefix,
)
from publisher.drivers.engine_protocol import inventory_confirms, stage_and_load, unload_fenced
from publisher.drivers.fleet import Fleet
from publisher.drivers.trouble import FailureTally, says_unreachable
from publisher.logs import get_logger

if TYPE_CHECKING:
    from publisher.core.ledger import Ledger

log = get_logger("loraledger.reconciler")

ORPHANED_ATTEMPT = "ORPHANED_ATTEMPT"
_READ_TRIES = 3
# The canary: a fixed short prompt, a handful of greedy tokens. Cheap, and the same weights on
# the same engine give the same tokens; other weights under the name do not.
CANARY_PROMPT = "loraledger canary: the quick brown fox"
CANARY_PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=False)
# Restores of one version on one engine that may fail before the engine is suspended.
_RESTORE_TRIES = 3
# Versions nothing loads any more: what an engine still has staged for them is a leftover.
_OVER = frozenset(
    {
        VersionState.RECLAIMING,
        VersionState.RECLAIMED,
        VersionState.FAILED_RETRYABLE,
        VersionState.FAILED_FATAL,
    }
)


class ReconcileReport(msgspec.Struct, frozen=True, kw_only=True):
    """What a reconcile pass did (``engine:name`` / ``engine:version`` strings where useful).
    Two reports add up field by field, in order (``a + b``)."""

    engines: tuple[str, ...] = ()
    joined: tuple[str, ...] = ()
    restarted: tuple[str, ...] = ()
    left: tuple[str, ...] = ()
    orphans: tuple[int, ...] = ()
    resolved: tuple[int, ...] = ()
    reclaimed: tuple[int, ...] = ()
    unloaded: tuple[str, ...] = ()
    restored: tuple[str, ...] = ()
    repaired: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()

    def __add__(self, other: ReconcileReport) -> ReconcileReport:
        return ReconcileReport(
            **{f: getattr(self, f) + getattr(other, f) for f in self.__struct_fields__}
        )


class _Findings:
    """A pass in progress: its :class:`ReconcileReport` so far, extended as findings arrive.
    The pass's concurrent tasks add to the same one, and what was found before a failure is
    kept (the failure is added to ``errors``)."""

    def __init__(self, **first: Any) -> None:
        self.report = ReconcileReport(**first)

    def add(self, **found: Any) -> None:
        """``found``: report fields with the items to append, e.g. ``joined=("e0",)``."""
        self.report += ReconcileReport(**found)

    def merge(self, report: ReconcileReport) -> None:
        self.report += report


class _Leaving(Exception):
    """A pass found that the engine it reads is leaving the fleet: it stops there."""


class Reconciler:
    """Reconciles the engines of ``fleet`` with ``ledger`` (see the module docstring)."""

    def __init__(
        self,
        ledger: Ledger,
        fleet: Fleet,
        artifacts: ArtifactStore,
        *,
        timeouts: EngineTimeouts | None = None,
        probe_interval_s: float = 1.0,
        full_every_s: float = 30.0,
        cleanup_timeout: float = 60.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        clock: Callable[[], float] = time.monotonic,
        inflight: Callable[[str, int], int] | None = None,
        suspend_after_s: float | None = 30.0,
        restore_backoff_s: float = 1.0,
        restore_backoff_max_s: float = 60.0,
        restore_bytes: RestoreBytes = plan_buckets,
        canary_every_s: float | None = None,
    ) -> None:
        self._ledger = ledger
        # How often a path engine's held versions answer their canary (None: never); the
        # first answer of a life is taken at the first pass that sees the version held.
        self.canary_every_s = canary_every_s
        # (engine, incarnation, version) -> clock time of its last canary: soft state, never
        # logged (only a baseline or a mismatch is a decision)
        self._canary_at: dict[tuple[str, str, int], float] = {}
        # canaries running per (engine, version_id): requests of this controller's own on the
        # version, which reclaim must wait for as for a gateway's (inflight_evidence)
        self._canaries_running: dict[tuple[str, int], int] = {}
        self._restore_bytes = restore_bytes  # how a restore's bytes reach a staged engine
        # None: never suspend on failed probes (an operator still can).
        self.suspend_after_s = suspend_after_s
        self.restore_backoff_s = restore_backoff_s
        self.restore_backoff_max_s = restore_backoff_max_s
        # engine -> (clock time of the first failed probe of the current run, last error); any
        # answer to a probe ends the run (`_check`, `_read`)
        self._failing: dict[str, tuple[float, str]] = {}
        # (engine, incarnation, version) -> (failed restores in a row, clock time before which
        # not to retry). One life's back-off: a restarted engine is a new, empty process that
        # owes nothing to its previous life's failures (its entries go at its next repair).
        self._restore_backoff: dict[tuple[str, str, int], tuple[int, float]] = {}
        # requests in flight per (engine, version), as the reclaim driver counts them
        self._inflight = inflight or (lambda engine_id, version_id: 0)
        self._fleet = fleet
        self._artifacts = artifacts
        self.timeouts = timeouts or EngineTimeouts()
        self.probe_interval_s = probe_interval_s
        self.full_every_s = full_every_s
        self._last_full = clock()
        self.cleanup_timeout = cleanup_timeout
        self.bucket_bytes = bucket_bytes
        self._clock = clock
        self._locks: dict[str, anyio.Lock] = {}
        # Engines leaving the fleet: recorded as left (or about to be), their handles kept only
        # while the requests on them drain. No pass may read, join or repair them: a probe
        # would find an engine the ledger no longer has and join it again, routable.
        self._leaving: set[str] = set()
        self._poked: anyio.Event | None = None
        # Engines a gateway saw refuse a generation as not loaded: read at the next wake.
        self._suspects: set[str] = set()
        self._reported_at: dict[str, float] = {}  # engine -> when a report last woke the loop
        # Outages faces reported, not recorded yet: engine -> (its life, when on the ledger's
        # clock, the first error, who saw it). Recorded by their own task, at once: a probe of
        # another engine that hangs must not delay them (:meth:`_record_outages`).
        self._outages: dict[str, tuple[str, float, str, str]] = {}
        self._outage_reported: anyio.Event | None = None
        # Dispatch failures faces counted, per (engine, life), until recorded against the
        # engine's outage or dropped once a probe found it reachable (no outage to count in).
        self._tallies: dict[tuple[str, str], FailureTally] = {}
        self.passes = 0
        self.wakes = 0  # health-loop wakes done (a tick or a poke): what a test counts, not time
        self._busy = False  # the health loop is inside a wake's work

    @property
    def settled(self) -> bool:
        """The health loop is waiting and nothing asked it to look: every report made so far
        has been acted on. (Tests wait for this rather than for time.)"""
        return self._poked is not None and not self._busy and not self._poked.is_set()

    @property
    def prefix(self) -> str:
        state = self._ledger.state
        return managed_prefix(state.prefix, state.deployment or "")

    def poke(self) -> None:
        """Ask the health loop to look at every engine now rather than at its next tick."""
        if self._poked is not None:
            self._poked.set()

    def engine_trouble(
        self,
        engine_id: str,
        error: EngineError,
        /,
        *,
        session: str = "",
        incarnation: str = "",
        failures: tuple[TurnFailures, ...] = (),
        age_s: float = 0.0,
        reporter: str = "gateway",
    ) -> None:
        """A caller's generation on ``engine_id`` failed with ``error`` in a way that says
        something about the engine (the gateway's ``on_engine_trouble`` hook: every such
        failure, of the Python path and the OpenAI face; a remote ledger's batch, with the
        ``failures`` it counted, ``age_s`` after it saw ``error``). ``incarnation``: the life the
        reporter chose the engine at (default: the one the ledger knows).

        If the error proves the engine could not be reached
        (:func:`~publisher.drivers.trouble.says_unreachable`), the outage is recorded at once,
        dated when it was seen, unless one is open. The turn's failure is counted for
        ``session`` (recorded against the outage once a probe confirmed it). The health loop
        wakes now rather than at its next tick, and what it does depends on what the error
        says:

        * the engine refused because it lacks the adapter (``NOT_LOADED``, ``NAME_RECLAIMED``:
          :func:`~publisher.drivers.engine_ops.lacks_adapter`): it may have lost a committed
          version (an external unload, an eviction), which a probe cannot see, so its inventory is
          read in full and the loss is recorded (``AdapterLost``), routed around and repaired
          within moments instead of at the next full pass;
        * anything else (unreachable, gone, a timeout, a lost reply, a 5xx): the engine is
          probed -- the loop's own probe, nothing else -- so a failed probe counts towards its
          suspension (``ENGINE_GONE`` suspends at once) and a new incarnation is a restart,
          repaired before it serves.

        Only a hint, never a verdict: the probe and the inventory decide, so a report about a
        healthy engine costs one probe and writes nothing. Synchronous and non-blocking (it
        only marks the engine and sets the loop's event), cheap and idempotent: many reports
        before the wake are one read, and an engine wakes the loop at most once per
        ``probe_interval_s`` (a flood of failures is handled at the regular ticks, not in a
        storm of passes). An engine outside this fleet is ignored."""
        if engine_id not in self._fleet:
            return
        member = self._ledger.state.engines.get(engine_id)
        life = incarnation or ("" if member is None else member.incarnation)
        tally = self._tallies.setdefault((engine_id, life), FailureTally())
        tally.add(session, error)
        tally.merge(failures)
        if (
            says_unreachable(error)
            and member is not None
            and member.incarnation == life
            and member.unreachable is None
            and engine_id not in self._outages
        ):
            at = self._ledger.clock() - max(0.0, age_s)
            self._outages[engine_id] = (life, at, f"{error.code}: {error.message}", reporter)
            if self._outage_reported is not None:
                self._outage_reported.set()
        if lacks_adapter(error):
            self._suspects.add(engine_id)
        now = self._clock()
        last = self._reported_at.get(engine_id)
        if last is None or now - last >= self.probe_interval_s:
            self._reported_at[engine_id] = now
            log.info("reconciler.engine_trouble", engine=engine_id, code=error.code)
            self.poke()

    def hold_out(self, engine_id: str) -> None:
        """``engine_id`` is leaving the fleet: from now on no pass touches it, though its
        handle stays in the fleet while it drains (see :meth:`let_in`)."""
        self._leaving.add(engine_id)

    def let_in(self, engine_id: str) -> None:
        """End :meth:`hold_out` (the handle is gone, or the removal failed before it was
        recorded): an engine added again under the same id is reconciled as any other."""
        self._leaving.discard(engine_id)

    def _members(self) -> list[str]:
        """The engines passes look at: the fleet's, less those leaving it."""
        return [e for e in self._fleet.ids() if e not in self._leaving]

    def _lock(self, engine_id: str) -> anyio.Lock:
        lock = self._locks.get(engine_id)
        if lock is None:
            lock = self._locks[engine_id] = anyio.Lock()
        return lock

    # --- passes -------------------------------------------------------------------------------

    async def start(self) -> ReconcileReport:
        """The start-up pass: leave engines without a handle, end orphaned attempts, then
        reconcile every engine of the fleet."""
        rep = _Findings()
        for engine_id in sorted(self._ledger.state.engines):
            if engine_id not in self._fleet:
                await self._ledger.leave_engine(engine_id)
                rep.add(left=(engine_id,))
                log.warning("reconciler.left", engine=engine_id, seq=self._ledger.state.last_seq)
        for v in list(self._ledger.state.versions.values()):
            if v.state is VersionState.LOADING:
                await self._end_orphan(v, rep)
        rep.merge(await self.reconcile())
        return rep.report

    async def reconcile(self) -> ReconcileReport:
        """One pass over every engine of the fleet, concurrently."""
        rep = _Findings()

        async def one(engine_id: str) -> None:
            rep.merge(await self.reconcile_engine(engine_id))

        async with anyio.create_task_group() as tg:
            for engine_id in self._members():
                tg.start_soon(one, engine_id)
        self.passes += 1
        self._last_full = self._clock()
        return rep.report

    async def reconcile_engine(self, engine_id: str) -> ReconcileReport:
        """Membership, evidence, cleanup and repair of one engine. Never raises for an engine
        or ledger refusal: they are reported in ``errors``."""
        rep = _Findings(engines=(engine_id,))
        async with self._lock(engine_id):
            if engine_id in self._leaving:
                return rep.report
            try:
                await self._reconcile(engine_id, rep)
            except _Leaving:
                pass  # the removal owns it now
            except (EngineError, LoraLedgerError, ArtifactError) as exc:
                rep.add(errors=(f"{engine_id}: {exc}",))
                log.warning("reconciler.engine_failed", engine=engine_id, error=str(exc))
            except Exception as exc:
                # A bug or an unexpected OS error: loud, but one engine's pass must not take
                # the health loop (and with it the control plane) down.
                rep.add(errors=(f"{engine_id}: unexpected {type(exc).__name__}: {exc}",))
                log.exception("reconciler.engine_crashed", engine=engine_id)
        return rep.report

    async def _reconcile(self, engine_id: str, rep: _Findings) -> None:
        engine = self._fleet[engine_id]
        inventory = await self._read(engine_id, engine, rep)
        reclaiming = self._reclaims_to_fence(engine_id) + self._owed(engine_id)
        if reclaiming:
            unloaded = [
                await self._unload(engine_id, engine, name, attempt, rep)
                for name, attempt in reclaiming
            ]
            if not all(unloaded):
                return  # no evidence until the fenced unload went through (errors reported)
            inventory = await self._read(engine_id, engine, rep)
        await self._observe(engine_id, inventory, rep)
        unwanted = self._unwanted(engine_id, set(managed_names(inventory, self.prefix)))
        unwanted += self._stale_staging(inventory, {name for name, _ in unwanted})
        if unwanted:
            for name, attempt in unwanted:
                if await self._unload(engine_id, engine, name, attempt, rep):
                    rep.add(unloaded=(f"{engine_id}:{name}",))
            inventory = await self._read(engine_id, engine, rep)
            await self._observe(engine_id, inventory, rep)
        await self._repair(engine_id, engine, inventory.incarnation, rep)
        await self._canaries(engine_id, engine, inventory.incarnation)

    async def _read(self, engine_id: str, engine: Engine, rep: _Findings) -> Inventory:
        """A fresh inventory, with membership brought up to date with its incarnation first
        (read again if the engine restarted while we read it)."""
        to = self.timeouts
        for _ in range(_READ_TRIES):
            incarnation = await call(engine_id, "incarnation", to.probe, engine.incarnation)
            # An answer ends a run of failed probes, whichever pass got it (a full pass may be
            # the first to reach a restarted engine): a later failure starts a new run.
            self._failing.pop(engine_id, None)
            await self._answered(engine_id, incarnation)
            await self._membership(engine_id, engine, incarnation, rep)
            inventory = await call(engine_id, "inventory", to.inventory, engine.inventory)
            if inventory.incarnation == incarnation:
                return inventory
        raise AmbiguousReply(
            ErrorCode.ENGINE_STOPPED,
            f"{engine_id} changed incarnation on every read ({_READ_TRIES} tries)",
            engine_id=engine_id,
        )

    async def _membership(
        self, engine_id: str, engine: Engine, incarnation: str, rep: _Findings
    ) -> None:
        ledger = self._ledger
        member = ledger.state.engines.get(engine_id)
        if member is None and engine_id in self._leaving:
            raise _Leaving(engine_id)  # it left while this pass read it: nothing to join
        if member is None:
            await ledger.join_engine(
                engine_id,
                incarnation,
                endpoint=engine.capabilities.endpoint,
                kind=engine.kind,
            )
            rep.add(joined=(engine_id,))
            log.info("reconciler.joined", engine=engine_id, seq=ledger.state.last_seq)
        elif member.incarnation != incarnation:
            old = member.incarnation
            await ledger.observe_restart(
                engine_id, incarnation, endpoint=engine.capabilities.endpoint, kind=engine.kind
            )
            rep.add(restarted=(engine_id,))
            log.warning(
                "reconciler.restarted",
                engine=engine_id,
                old=old,
                new=incarnation,
                seq=ledger.state.last_seq,
            )

    async def _observe(self, engine_id: str, inventory: Inventory, rep: _Findings) -> None:
        managed = managed_names(inventory, self.prefix)
        outcome = await self._ledger.observe_inventory(
            engine_id, inventory.incarnation, managed, digests=served_digests(inventory, managed)
        )
        rep.add(resolved=tuple(outcome.resolved), reclaimed=tuple(outcome.reclaimed))
        if outcome.resolved or outcome.reclaimed or outcome.strays:
            log.info(
                "reconciler.observed",
                engine=engine_id,
                resolved=list(outcome.resolved),
                reclaimed=list(outcome.reclaimed),
                strays=list(outcome.strays),
                seq=self._ledger.state.last_seq,
            )

    def _reclaims_to_fence(self, engine_id: str) -> list[tuple[str, int]]:
        """Versions being reclaimed that this engine has not confirmed yet, to unload
        (attempt-fenced) before its inventory is taken as evidence -- present or not. An absent
        name still confirms the reclaim, but the engine may hold bytes a failed restore staged
        under it, and only a fenced unload drops them and refuses a late duplicate of that
        restore's prepare (found by the simulation, --slow seeds 1601 and 2893). Doing it here
        rather than leaving it to the reclaim driver matters: the reconciler may read the
        inventory first (it runs at start, before the driver). A reclaimed version's attempt
        is final, so the fence never shuts out a wanted load; a version with a request in
        flight on this engine is left to the reclaim driver's next tick."""
        state = self._ledger.state
        return sorted(
            (v.lora_name, v.attempt)
            for v in state.versions.values()
            if v.state is VersionState.RECLAIMING
            and engine_id not in v.confirmed
            and not self._inflight(engine_id, v.version_id)
        )

    def _owed(self, engine_id: str) -> list[tuple[str, int]]:
        """Names the engine owes (reclaimed or resolved while it was suspended), unloaded
        attempt-fenced before its inventory counts: a load still in flight from before its
        suspension then cannot land after the proof. The engine was routed away (suspended);
        a name with a request still counted in flight on it waits for the drain (a later
        pass), as a reclaim's unload does."""
        state = self._ledger.state
        member = state.engines.get(engine_id)
        if member is None:
            return []
        return sorted(
            (name, attempt)
            for name, attempt in member.owes.items()
            if (v := state.version_by_name(name)) is None
            or not self._inflight(engine_id, v.version_id)
        )

    def _unwanted(self, engine_id: str, present: set[str]) -> list[tuple[str, int | None]]:
        """Managed names present on the engine that must go, with the attempt that fences
        their cleanup (None: no fence). A name of a known version with a request still counted
        in flight on this engine waits for the drain (a later pass), as every unload does: a
        name the engine owes, skipped by ``_owed`` for that request, reads as a stray once its
        inventory is observed, and must not be unloaded under it here instead."""
        state = self._ledger.state
        out: dict[str, int | None] = {}
        for v in state.versions.values():
            if v.lora_name not in present:
                continue
            if v.state is VersionState.FAILED_FATAL:
                # on any engine: one that joined after the attempt may hold the candidate too,
                # and the attempt resolves only once no member does
                out[v.lora_name] = v.attempt
        member = state.engines.get(engine_id)
        for name in member.strays if member is not None else ():
            if name.startswith(self.prefix):
                # A stray of a known version (a failed attempt that landed late, a reclaimed
                # name that came back) is fenced by that version's latest attempt, which is
                # over: a late duplicate of this unload can then never remove a later attempt
                # of the same name. Only a name the ledger never allocated goes unfenced.
                known = state.version_by_name(name)
                out.setdefault(name, known.attempt if known is not None else None)
        return sorted(
            (name, attempt)
            for name, attempt in out.items()
            if (version := state.version_by_name(name)) is None
            or not self._inflight(engine_id, version.version_id)
        )

    def _stale_staging(
        self, inventory: Inventory, chosen: set[str]
    ) -> list[tuple[str, int | None]]:
        """Names the engine holds bytes staged under (prepared, never loaded) that nothing will
        ever load, with the attempt that fences their cleanup: a version that is over
        (reclaimed, failed, or being reclaimed) by its last attempt; a name the ledger never
        allocated unfenced, as a stray.

        A failed restore leaves its staging on purpose (no cleanup may fence the committed
        attempt out), counting on the reclaim's fenced unload to drop it. That unload can be
        answered without being carried out (an engine that acknowledged and did nothing), and
        then nothing else would ever look: the reclaim is confirmed, and staging is not an
        adapter (found by the simulation, --slow seed 1585). So each pass reads the staging an
        inventory reports. Left alone: staging of a ``LOADING`` version (its publication or the
        orphan cleanup owns it) and of a version still published or retired (a restore's next
        prepare replaces it, a load consumes it, the reclaim drops it; a fenced unload there
        would shut the committed attempt out of the engine for good)."""
        state = self._ledger.state
        out: list[tuple[str, int | None]] = []
        for name in inventory.staged:
            if not name.startswith(self.prefix) or name in chosen or name in inventory.names():
                continue
            v = state.version_by_name(name)
            if v is None:
                out.append((name, None))
            elif v.state in _OVER:
                out.append((name, v.attempt))
        return sorted(out, key=lambda item: item[0])

    async def _unload(
        self, engine_id: str, engine: Engine, name: str, attempt: int | None, rep: _Findings
    ) -> bool:
        """Whether the engine answered that ``name`` is gone (its inventory is read next)."""
        answer = await unload_fenced(
            engine, name, attempt=attempt, timeout=min(self.timeouts.unload, self.cleanup_timeout)
        )
        if answer.error is not None:
            rep.add(errors=(f"{engine_id}: unload {name}: {answer.error}",))
            return False
        if answer.receipt is not None:
            log.info("reconciler.unloaded", engine=engine_id, name=name, attempt=attempt)
        return True

    # --- repair -------------------------------------------------------------------------------

    async def _repair(
        self, engine_id: str, engine: Engine, incarnation: str, rep: _Findings
    ) -> None:
        state = self._ledger.state
        member = state.engines.get(engine_id)
        if member is None or member.incarnation != incarnation:
            return
        self._forget_other_lives(engine_id, incarnation)
        for version_id in state.needed_versions():
            v = state.versions[version_id]
            if v.lora_name in member.holds:
                continue
            key = (engine_id, incarnation, version_id)
            failures, not_before = self._restore_backoff.get(key, (0, 0.0))
            if self._clock() < not_before:
                continue  # backing off: a failing restore is retried ever less often
            try:
                await self._restore(engine_id, engine, incarnation, v)
            except (EngineError, LoraLedgerError, ArtifactError) as exc:
                failures += 1
                delay = min(
                    self.restore_backoff_s * 2 ** (failures - 1), self.restore_backoff_max_s
                )
                self._restore_backoff[key] = (failures, self._clock() + delay)
                rep.add(errors=(f"{engine_id}: restore version {version_id}: {exc}",))
                log.error(
                    "reconciler.restore_failed",
                    engine=engine_id,
                    version=version_id,
                    failures=failures,
                    retry_in_s=delay,
                    error=str(exc),
                )
                refused = isinstance(exc, EngineError) and exc.clean
                if member.routable and (refused or failures >= _RESTORE_TRIES):
                    await self._suspend_for_loss(engine_id, v, failures, exc)
                continue
            self._restore_backoff.pop(key, None)
            self._canary_at.pop(key, None)  # a restored version answers its canary at once
            rep.add(restored=(f"{engine_id}:{version_id}",))
        if member.suspended and member.suspend_cause == "operator":
            return  # only an operator lifts it; the repair waits for the resume
        if not member.routable:
            await self._ledger.repair_engine(engine_id, incarnation)
            rep.add(repaired=(engine_id,))
            log.info("reconciler.repaired", engine=engine_id, seq=self._ledger.state.last_seq)

    def _forget_other_lives(self, engine_id: str, incarnation: str) -> None:
        """Drop the restore back-off of the engine's earlier lives. A restart (or a replacement)
        is a new process: the old life's delays -- up to ``restore_backoff_max_s`` -- would
        keep a healthy engine out of routing (the ledger refuses the repair while a needed
        version is missing) and start its first failure at the longest wait."""
        for key in [k for k in self._restore_backoff if k[0] == engine_id and k[1] != incarnation]:
            del self._restore_backoff[key]
        for key in [k for k in self._canary_at if k[0] == engine_id and k[1] != incarnation]:
            del self._canary_at[key]

    async def _suspend_for_loss(
        self, engine_id: str, v: VersionRecord, failures: int, exc: Exception
    ) -> None:
        """The engine lost a needed version and will not (or keeps failing to) reload it under
        its name: it is suspended and repaired as a whole (a restart clears its fences)."""
        member = self._ledger.state.engines.get(engine_id)
        how = "served with other content" if member and v.lora_name in member.mismatched else "lost"
        detail = f"version {v.version_id} {how} and not restored after {failures} tries: {exc}"
        await self._ledger.suspend_engine(engine_id, cause="lost_adapter", detail=detail[:2000])
        log.warning(
            "reconciler.suspended",
            engine=engine_id,
            cause="lost_adapter",
            version=v.version_id,
            seq=self._ledger.state.last_seq,
        )

    async def _restore(
        self, engine_id: str, engine: Engine, incarnation: str, v: VersionRecord
    ) -> None:
        """Load a still-needed version again (its committed attempt, its immutable name) from
        the artifact store, confirm it by inventory, and record it."""
        manifest, tensors = await anyio.to_thread.run_sync(self._artifacts.open, v.digest)
        staged = engine.transport == "staged"
        candidate = Candidate(
            lora_name=v.lora_name,
            digest=v.digest,
            attempt=v.attempt,
            manifest=manifest,
            artifact_path=None if staged else str(self._artifacts.path_for(v.digest)),
        )
        buckets = (
            await anyio.to_thread.run_sync(self._restore_bytes, tensors, self.bucket_bytes)
            if staged
            else ()
        )
        try:
            await stage_and_load(
                engine, candidate, buckets, timeouts=self.timeouts, incarnation=incarnation
            )
        except EngineError:
            # A lost reply may hide a load that happened: the engine's inventory decides. No
            # cleanup unload: an engine fences an unloaded (name, attempt) for the rest of its
            # life, and a committed version's attempt never changes, so a cleanup shut the
            # version out of this engine for good (found by the simulation). What a failed
            # restore leaves is harmless: staging is replaced by the next prepare. A name the
            # engine was found serving with other content proves nothing by its inventory: a
            # path engine's digest is the name of the directory it loaded, which the other
            # content passed already (counting it restored routed those weights again).
            member = self._ledger.state.engines[engine_id]
            if v.lora_name in member.mismatched or not await self._loaded_anyway(
                engine, v, incarnation
            ):
                raise
        await self._ledger.restore_version(v.version_id, engine_id, incarnation)
        log.info(
            "reconciler.restored",
            engine=engine_id,
            version=v.version_id,
            seq=self._ledger.state.last_seq,
        )

    async def _loaded_anyway(self, engine: Engine, v: VersionRecord, incarnation: str) -> bool:
        """Whether a fresh inventory proves ``v`` loaded in ``incarnation`` after all.

        What a failed restore staged is left alone: the next restore's prepare replaces it, a
        successful load consumes it, and once the version is retired the (attempt-fenced)
        reclaim unload drops it. An *unfenced* cleanup unload here was tried and is wrong: a
        late duplicate of it unloaded the version after a later restore had succeeded, under
        sessions still bound to it (found by the simulation, --slow seeds 1739 and 1912)."""
        return await inventory_confirms(
            engine, v.lora_name, v.digest, incarnation, timeout=self.timeouts.inventory
        )

    # --- canaries ------------------------------------------------------------------------

    def _canaries_due(self, engine_id: str, incarnation: str) -> list[VersionRecord]:
        """The held committed versions whose canary this engine life should answer now: never
        answered in this life (no baseline yet), or last answered ``canary_every_s`` ago. Only
        for engines that report no digest of the bytes they loaded (kind other than
        ``local``: a path engine names its digest by the directory it loaded, which other
        weights under the same path would not change)."""
        member = self._ledger.state.engines.get(engine_id)
        every = self.canary_every_s
        if (
            every is None
            or member is None
            or member.incarnation != incarnation
            or engine_id not in self._fleet
            or self._fleet[engine_id].kind == "local"
        ):
            return []
        now = self._clock()
        due = []
        for name, version_id in sorted(member.holds.items()):
            v = self._ledger.state.versions[version_id]
            if v.state not in SERVING_STATES:
                continue
            last = self._canary_at.get((engine_id, incarnation, version_id))
            if name not in member.canaries or last is None or now - last >= every:
                due.append(v)
        return due

    async def _canaries(self, engine_id: str, engine: Engine, incarnation: str) -> None:
        """Ask each due version's canary and let the ledger compare it with the baseline. An
        answer that differs is asked again before it counts: only an answer the engine gives
        twice is evidence (a one-off difference is noise, never an incident)."""
        for v in self._canaries_due(engine_id, incarnation):
            try:
                answer = await self._canary(engine_id, engine, v)
                if answer is None:
                    continue  # claimed for reclaim meanwhile: not asked
                baseline = self._ledger.state.engines[engine_id].canaries.get(v.lora_name)
                differs = baseline is not None and answer != baseline
                if not differs or await self._canary(engine_id, engine, v) == answer:
                    await self._ledger.check_canary(engine_id, incarnation, v.version_id, answer)
                # else not stable: no evidence either way; asked again a period later
            except (EngineError, LoraLedgerError) as exc:
                log.warning(
                    "reconciler.canary_failed",
                    engine=engine_id,
                    version=v.version_id,
                    error=str(exc),
                )
                continue
            self._canary_at[(engine_id, incarnation, v.version_id)] = self._clock()
            if self._ledger.state.engines[engine_id].mismatched.get(v.lora_name):
                log.warning(
                    "reconciler.canary_mismatch",
                    engine=engine_id,
                    version=v.version_id,
                    seq=self._ledger.state.last_seq,
                )

    async def _canary(self, engine_id: str, engine: Engine, v: VersionRecord) -> str | None:
        """The engine's greedy tokens for the canary prompt on ``v``, as comma-separated ids;
        None, unasked, once ``v`` no longer serves (a reclaim claimed it meanwhile).

        A canary is a request on the version like any turn: counted in flight from before it
        is sent until the engine answered (:meth:`inflight_evidence`), or reclaim would unload
        a retired version under it (on SGLang a request naming an unloaded adapter even loads
        it again). The state is read and the count taken with no await between, so a claim
        either came first (not asked) or sees the count (it waits)."""
        if self._ledger.state.versions[v.version_id].state not in SERVING_STATES:
            return None
        key = (engine_id, v.version_id)
        self._canaries_running[key] = self._canaries_running.get(key, 0) + 1
        try:
            out: Generation = await call(
                engine_id,
                "generate",
                self.timeouts.probe + self.timeouts.inventory,
                lambda: engine.generate(CANARY_PROMPT, v.lora_name, CANARY_PARAMS),
            )
        finally:
            # A canary that timed out may still run its few tokens on the engine: its count is
            # not held until the engine confirms the end, as a gateway holds a lost request's.
            left = self._canaries_running.pop(key) - 1
            if left:
                self._canaries_running[key] = left
        return ",".join(str(t) for t in out.token_ids)

    def inflight_evidence(self, version_id: int) -> list[InFlight]:
        """The canaries running on ``version_id`` per engine, or one zero entry for all
        engines: this controller's own requests, an in-flight source of reclaim."""
        now = self._clock()
        busy = sorted((e, n) for (e, vid), n in self._canaries_running.items() if vid == version_id)
        return [
            InFlight(reporter="canaries", engine=engine, count=n, at=now)
            for engine, n in busy or [("*", 0)]
        ]

    # --- orphans --------------------------------------------------------------------------

    async def _end_orphan(self, v: VersionRecord, rep: _Findings) -> None:
        """A LOADING attempt found at start: its driver died with the previous controller."""
        attempt, name = v.attempt, v.lora_name

        async def clean(engine_id: str) -> None:
            # Whatever it answers: the inventories read after the attempt ended decide.
            await unload_fenced(
                self._fleet[engine_id], name, attempt=attempt, timeout=self.cleanup_timeout
            )

        async with anyio.create_task_group() as tg:
            for engine_id in v.fleet:
                if engine_id in self._fleet:
                    tg.start_soon(clean, engine_id)
        await self._ledger.fail_attempt(
            v.version_id,
            attempt,
            clean=False,
            code=ORPHANED_ATTEMPT,
            reason=f"attempt {attempt} was LOADING when this controller started: its driver is "
            "gone; inventories decide",
        )
        rep.add(orphans=(v.version_id,))
        log.warning(
            "reconciler.orphan_ended",
            version=v.version_id,
            attempt=attempt,
            seq=self._ledger.state.last_seq,
        )

    # --- health loop ----------------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Probe every engine each ``probe_interval_s`` (or when poked), forever; engines
        reported lacking an adapter (:meth:`engine_trouble`) get a full reconcile, not just a
        probe."""
        self._poked = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._record_outages)
            task_status.started()
            while True:
                with anyio.move_on_after(self.probe_interval_s):
                    await self._poked.wait()
                self._poked = anyio.Event()
                suspects, self._suspects = self._suspects, set()
                tallies, self._tallies = self._tallies, {}
                self._busy = True
                try:
                    if self._clock() - self._last_full >= self.full_every_s:
                        await self.reconcile()
                    else:
                        await self.health_check(suspects)
                    await self._record_failures(tallies)
                finally:
                    self._busy = False
                    self.wakes += 1

    async def _record_outages(self) -> None:
        """Record the outages faces reported, as they come: the log and every process's
        routing hear of a refused connection within moments, whatever the health loop is doing
        (a probe of another engine may hang for ``timeouts.probe``). Reports made before this
        task started are recorded as it starts: their ``set`` found no event to wake."""
        self._outage_reported = anyio.Event()
        while True:
            if not self._outages:
                await self._outage_reported.wait()
            self._outage_reported = anyio.Event()
            reported, self._outages = self._outages, {}
            for engine_id, (life, at, error, reporter) in reported.items():
                await self._outage(engine_id, life, at, error, "dispatch", reporter)

    async def _outage(
        self, engine_id: str, life: str, at: float, error: str, source: str, reporter: str
    ) -> None:
        """Record that ``engine_id`` (its life ``life``) could not be reached at ``at``: a
        no-op in the ledger when its outage is open, or the report is late or of an earlier
        life."""
        try:
            outcome = await self._ledger.report_unreachable(
                engine_id, life, at=at, error=error[:2000], source=source, reporter=reporter
            )
        except LoraLedgerError as exc:  # left meanwhile, or the ledger closed: logged
            log.warning("reconciler.unreachable_refused", engine=engine_id, error=str(exc))
            return
        if not outcome.no_op:
            log.warning(
                "reconciler.unreachable",
                engine=engine_id,
                source=source,
                error=error,
                seq=self._ledger.state.last_seq,
            )

    async def _answered(self, engine_id: str, incarnation: str) -> None:
        """A probe of ``engine_id`` answered ``incarnation``: the life the ledger knows ends its
        outage now (a new life ends it through the restart the membership records next)."""
        member = self._ledger.state.engines.get(engine_id)
        if member is None or member.unreachable is None or member.incarnation != incarnation:
            return
        try:
            await self._ledger.report_reachable(engine_id, incarnation, at=self._ledger.clock())
        except LoraLedgerError as exc:
            log.warning("reconciler.reachable_refused", engine=engine_id, error=str(exc))
            return
        log.info("reconciler.reachable", engine=engine_id, seq=self._ledger.state.last_seq)

    async def _record_failures(self, tallies: dict[tuple[str, str], FailureTally]) -> None:
        """Record the failures faces counted before this pass, against the outage of the life
        they name, now that every engine was probed: an engine still in an outage gets them
        (``DispatchFailures``); one that answered had no outage to count them in (its
        failures stay in the faces' logs and provenance), and they are dropped."""
        for (engine_id, life), tally in tallies.items():
            member = self._ledger.state.engines.get(engine_id)
            if member is None or member.unreachable is None or member.incarnation != life:
                continue
            failures = tally.take()
            if not failures:
                continue
            try:
                await self._ledger.count_dispatch_failures(engine_id, life, failures)
            except LoraLedgerError as exc:
                log.warning("reconciler.failures_refused", engine=engine_id, error=str(exc))

    async def health_check(self, suspects: set[str] | frozenset[str] = frozenset()) -> None:
        """Probe every engine; reconcile those that need it by the ledger, and ``suspects``
        (their inventory is read whatever the ledger believes)."""
        async with anyio.create_task_group() as tg:
            for engine_id in self._members():
                tg.start_soon(self._check, engine_id, engine_id in suspects)

    async def _check(self, engine_id: str, suspected: bool = False) -> None:
        try:
            engine = self._fleet[engine_id]
            incarnation = await call(
                engine_id, "incarnation", self.timeouts.probe, engine.incarnation
            )
        except (EngineError, LoraLedgerError) as exc:
            gone = isinstance(exc, EngineError) and exc.code == ErrorCode.ENGINE_GONE
            member = self._ledger.state.engines.get(engine_id)
            if gone and member is not None and member.suspended and member.unreachable is not None:
                return  # known dead, out of service, its outage open: nothing new to say or do
            log.warning("reconciler.probe_failed", engine=engine_id, error=str(exc))
            await self._probe_failed(engine_id, exc, gone=gone)
            return
        self._failing.pop(engine_id, None)
        await self._answered(engine_id, incarnation)
        if suspected or self._needs_reconcile(engine_id, incarnation):
            await self.reconcile_engine(engine_id)

    async def _probe_failed(
        self, engine_id: str, exc: EngineError | LoraLedgerError, *, gone: bool = False
    ) -> None:
        """Record the outage at the first failure (out of routing at once; a no-op while one is
        open), and count the failure; suspend the engine once it has failed for
        ``suspend_after_s``, or at once when the failure proves the engine's process is gone
        for good (``ENGINE_GONE``: a Ray engine actor that died and will not restart --
        waiting could only keep it routable for nothing). Each decision is one event (a
        suspended engine is not suspended again), whatever the number of probes that failed."""
        error = str(exc)
        now = self._clock()
        since, _ = self._failing.get(engine_id, (now, error))
        self._failing[engine_id] = (since, error)
        member = self._ledger.state.engines.get(engine_id)
        # The life the probes failed in, read before any await: the ledger's state evolves in
        # place, and a restart recorded meanwhile must not have its new life suspended.
        life = "" if member is None else member.incarnation
        if member is not None and member.unreachable is None:
            first = f"{exc.code}: {exc.message}"
            at = self._ledger.clock()
            await self._outage(engine_id, life, at, first, "probe", "reconciler")
        if self.suspend_after_s is None or member is None or member.suspended:
            return
        if now - since < self.suspend_after_s and not gone:
            return
        detail = f"{'gone' if gone else 'probes failed'} for {now - since:.1f} s: {error}"
        try:
            await self._ledger.suspend_engine(
                engine_id, cause="unhealthy", detail=detail[:2000], incarnation=life
            )
        except LoraLedgerError as exc:  # restarted or left meanwhile: the next probe decides
            log.warning("reconciler.suspend_refused", engine=engine_id, error=str(exc))
            return
        log.warning(
            "reconciler.suspended",
            engine=engine_id,
            cause="unhealthy",
            detail=detail,
            seq=self._ledger.state.last_seq,
        )

    def _needs_reconcile(self, engine_id: str, incarnation: str) -> bool:
        state = self._ledger.state
        member = state.engines.get(engine_id)
        if member is None or member.incarnation != incarnation or not member.routable:
            return True
        if self._canaries_due(engine_id, incarnation):
            return True
        if any(name.startswith(self.prefix) for name in member.strays) or member.owes:
            return True
        for version_id in state.needed_versions():
            if state.versions[version_id].lora_name not in member.holds:
                return True
        for version_id in state.blocked_by():
            v = state.versions[version_id]
            if (
                v.state is VersionState.RECLAIMING
                or engine_id in v.fleet
                or v.lora_name in member.holds
            ):
                return True
        return False


def served_digests(inventory: Inventory, names: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """(name, digest) for each of ``names`` whose engine reports the digest of the bytes it
    loaded: the evidence the ledger checks a committed version's content against (an engine
    that reports none, e.g. a path engine whose directory is not named by its digest, proves
    nothing here)."""
    wanted = set(names)
    return tuple(
        sorted(
            (a.lora_name, a.digest)
            for a in inventory.adapters
            if a.lora_name in wanted and a.digest is not None
        )
    )
