"""ReclaimDriver: free an old version the moment nothing can use it any more, so slots do not
fill up, and never under a running request (docs/publication.md, docs/state-machine.md).

It runs beside the ledger for the life of the control plane, woken by every committed ledger
event (``ledger.subscribe()``: a release, a lease expiry, a commit that retires a version) and
by a periodic tick (in-flight counts fall without a ledger event). Each sweep:

1. **claims** every ``RETIRED`` version with no binding whose in-flight evidence is all zero --
   the counts of this process's sources (gateways: :class:`publisher.drivers.fleet.InFlightSource`)
   and of remote workers' lease renewals (``ledger.inflight_evidence``). The evidence is
   recorded in ``ReclaimClaimed``, so a replay shows what the decision relied on. After a
   controller restart no sweep claims or unloads until every live owner renewed (its counts
   were only in the previous controller's memory) or its lease ended;
2. **unloads** every ``RECLAIMING`` version on each member engine that has not confirmed yet,
   and only when that engine's in-flight count for it is zero right now (SGLang's unload blocks
   until the adapter's requests drain, docs/engines.md: at zero it is instant). Each
   confirmation is recorded (``EngineUnloaded``; an answer that the name was already absent is
   a confirmation too: :func:`publisher.drivers.engine_protocol.unload_fenced`); the ledger
   marks the version ``RECLAIMED`` when every engine confirmed;
3. an **ambiguous** unload (timeout, lost reply, 5xx) -- or a clean refusal that proves nothing
   -- is recorded (``ReclaimAmbiguous``): the version keeps its slot and blocks publication
   until inventory evidence decides (the reconciler, which is poked at once);
4. optionally **deletes the artifact directory** of a ``RECLAIMED`` version after a grace
   period -- only then, and only if no other live version shares its digest (vLLM re-reads
   adapters from disk, so a directory must outlive every reference).

A sweep that is interrupted (shutdown, crash) is resumed by the next one: ``RECLAIMING``
versions are driven to completion from whatever the ledger says is still missing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import anyio
import anyio.abc

from engines.artifacts import ArtifactStore
from evlog.errors import LoraLedgerError
from evlog.events import InFlight
from projections.registry import VersionState
from publisher.core.errors import Code
from publisher.drivers.engine_ops import EngineTimeouts
from publisher.drivers.engine_protocol import unload_fenced
from publisher.drivers.fleet import Fleet, HoldsCounts, InFlightSource
from publisher.logs import get_logger

if TYPE_CHECKING:
    from publisher.core.ledger import Ledger

log = get_logger("loraledger.reclaim")


class ReclaimDriver:
    """Reclaims versions of ``ledger`` on the engines of ``fleet`` (see the module docstring).

    ``on_ambiguous`` is called after a reclaim was marked ambiguous and ``on_restart`` when an
    engine's unload answered from an incarnation the ledger does not know yet (the plane wires
    both to ``Reconciler.poke``). ``delete_artifacts_after_s``: None keeps artifact directories
    forever; a number deletes a ``RECLAIMED`` version's directory that long after this driver
    first saw it reclaimed.
    """

    def __init__(
        self,
        ledger: Ledger,
        fleet: Fleet,
        *,
        sources: Iterable[InFlightSource] = (),
        timeouts: EngineTimeouts | None = None,
        tick_s: float = 0.5,
        artifacts: ArtifactStore | None = None,
        delete_artifacts_after_s: float | None = None,
        on_ambiguous: Callable[[], None] | None = None,
        on_restart: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ledger = ledger
        self._fleet = fleet
        self._sources: list[InFlightSource] = list(sources)
        self.timeouts = timeouts or EngineTimeouts()
        self.tick_s = tick_s
        self._artifacts = artifacts
        self.delete_artifacts_after_s = delete_artifacts_after_s
        self._on_ambiguous = on_ambiguous
        self._on_restart = on_restart
        self._clock = clock
        self._wake: anyio.Event | None = None
        self._seen_reclaimed: dict[int, float] = {}
        self.deleted: set[str] = set()
        self.sweeps = 0
        # The ledger closed or fenced this controller: every later sweep raises it (``run``
        # stops). Kept rather than raised inside an unload task, which would cancel the
        # other unloads mid-call.
        self._lost: LoraLedgerError | None = None

    def add_source(self, source: InFlightSource) -> None:
        self._sources.append(source)

    def wake(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # --- evidence -----------------------------------------------------------------------------

    def evidence(self, version_id: int) -> list[InFlight]:
        """Every reporter's in-flight counts for the version: this process's sources, then the
        remote workers' lease renewals."""
        reports: list[InFlight] = []
        for source in self._sources:
            reports.extend(source.inflight_evidence(version_id))
        reports.extend(self._ledger.inflight_evidence(version_id))
        return reports

    def inflight(self, engine_id: str, version_id: int) -> int:
        return sum(
            r.count for r in self.evidence(version_id) if r.engine in (engine_id, "*") and r.count
        )

    # --- the loop -----------------------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Sweep on every new ledger event and every ``tick_s``, forever."""
        self._wake = anyio.Event()
        self._wake.set()  # a first sweep resumes whatever a previous life left RECLAIMING
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._follow)
            tg.start_soon(self._tick)
            task_status.started()
            while True:
                await self._wake.wait()
                self._wake = anyio.Event()
                try:
                    await self.sweep()
                except LoraLedgerError as exc:
                    if exc.code in (Code.LEDGER_CLOSED, Code.FENCED):
                        raise  # this controller must stop
                    log.error("reclaim.sweep_failed", error=str(exc))
                except Exception:
                    # A bug or an unexpected OS error (e.g. deleting an artifact): loud, and
                    # the next event or tick tries again instead of stopping the plane.
                    log.exception("reclaim.sweep_crashed")

    async def _follow(self) -> None:
        async for _record in self._ledger.subscribe():
            self.wake()

    async def _tick(self) -> None:
        while True:
            await anyio.sleep(self.tick_s)
            self.wake()

    # --- one sweep ----------------------------------------------------------------------------

    async def sweep(self) -> list[int]:
        """Claim what became reclaimable, drive every RECLAIMING version, collect artifacts.
        Returns the versions that became RECLAIMED during this sweep."""
        self.sweeps += 1
        for source in self._sources:  # held counts the engines can now confirm end first
            if isinstance(source, HoldsCounts):
                await source.confirm_ends()
        unheard = self._ledger.inflight_unheard()
        if unheard:  # after a controller restart: counts unknown are not zero counts
            log.info("reclaim.waiting_for_owners", owners=unheard)
            return []
        state = self._ledger.state
        before = {
            v.version_id for v in state.versions.values() if v.state is VersionState.RECLAIMED
        }
        for version_id in state.reclaimable():
            await self._claim(version_id)
        driving = [
            v.version_id
            for v in state.versions.values()
            if v.state is VersionState.RECLAIMING and not v.ambiguous
        ]
        if driving:
            async with anyio.create_task_group() as tg:
                for version_id in driving:
                    for engine_id in sorted(state.engines):
                        if engine_id not in state.versions[version_id].confirmed:
                            tg.start_soon(self._unload, version_id, engine_id)
        if self._lost is not None:
            raise self._lost
        await self._collect_artifacts()
        after = {v.version_id for v in state.versions.values() if v.state is VersionState.RECLAIMED}
        return sorted(after - before)

    async def _claim(self, version_id: int) -> None:
        evidence = self.evidence(version_id)
        if any(r.count for r in evidence):
            return  # requests in flight: the tick brings us back when they finished
        try:
            granted = await self._ledger.claim_reclaim(version_id, evidence)
        except LoraLedgerError as exc:
            if self._must_stop(exc):
                raise
            # bound again or busy by now (a race with a bind/dispatch): the next sweep decides
            log.info("reclaim.not_claimed", version=version_id, code=exc.code)
            return
        log.info(
            "reclaim.claimed",
            version=version_id,
            engines=list(granted.engines),
            reporters=sorted({r.reporter for r in evidence}),
            seq=self._ledger.state.last_seq,
        )

    async def _unload(self, version_id: int, engine_id: str) -> None:
        state = self._ledger.state
        v = state.versions[version_id]
        member = state.engines.get(engine_id)
        if (
            v.state is not VersionState.RECLAIMING
            or v.ambiguous
            or member is None
            or member.suspended  # not waited for: it owes the drop, its repair unloads it
            or engine_id in v.confirmed
        ):
            return
        if self.inflight(engine_id, version_id):
            return  # never unload under a running request; the tick retries
        if engine_id not in self._fleet:
            return  # no handle here: the reconciler or a leave completes it
        known = member.incarnation  # as the ledger knew it when the unload was sent
        # Attempt-fenced: the engine then refuses every prepare of this (committed, final)
        # attempt for the rest of its incarnation, so a late duplicate of an earlier restore's
        # prepare cannot stage the reclaimed name again (found by the simulation).
        answer = await unload_fenced(
            self._fleet[engine_id], v.lora_name, attempt=v.attempt, timeout=self.timeouts.unload
        )
        error = answer.error
        if error is not None:
            # Not proven absent: a clean refusal proves nothing about the name either.
            reason = f"clean refusal {error.code}: {error}" if error.clean else str(error)
            await self._ambiguous(version_id, engine_id, reason)
            return
        # NOT_LOADED (no receipt) is as good a confirmation as an unload receipt.
        incarnation = known if answer.receipt is None else answer.receipt.incarnation
        try:
            outcome = await self._ledger.record_unloaded(version_id, engine_id, incarnation)
        except LoraLedgerError as exc:
            if self._must_stop(exc):
                return
            log.warning(
                "reclaim.unload_not_recorded", version=version_id, engine=engine_id, code=exc.code
            )
            if exc.code == Code.ENGINE_RESTARTED and self._on_restart is not None:
                self._on_restart()
            return
        log.info(
            "reclaim.unloaded",
            version=version_id,
            engine=engine_id,
            reclaimed=outcome.reclaimed,
            seq=self._ledger.state.last_seq,
        )

    async def _ambiguous(self, version_id: int, engine_id: str, reason: str) -> None:
        try:
            await self._ledger.mark_reclaim_ambiguous(version_id, engine_id, reason)
        except LoraLedgerError as exc:
            if self._must_stop(exc):
                return
            log.warning("reclaim.ambiguous_not_recorded", version=version_id, code=exc.code)
            return
        log.warning(
            "reclaim.ambiguous",
            version=version_id,
            engine=engine_id,
            reason=reason[:300],
            seq=self._ledger.state.last_seq,
        )
        if self._on_ambiguous is not None:
            self._on_ambiguous()

    def _must_stop(self, exc: LoraLedgerError) -> bool:
        """A refusal that ends this controller (its ledger closed, or another controller fenced
        it) rather than one the next sweep retries: kept for :meth:`sweep` to raise."""
        if exc.code not in (Code.LEDGER_CLOSED, Code.FENCED):
            return False
        if self._lost is None:
            self._lost = exc
        return True

    async def _collect_artifacts(self) -> None:
        if self._artifacts is None or self.delete_artifacts_after_s is None:
            return
        now = self._clock()
        state = self._ledger.state
        live = {v.digest for v in state.versions.values() if v.state is not VersionState.RECLAIMED}
        for v in state.versions.values():
            if v.state is not VersionState.RECLAIMED or v.digest in self.deleted:
                continue
            first = self._seen_reclaimed.setdefault(v.version_id, now)
            if v.digest in live or now - first < self.delete_artifacts_after_s:
                continue
            await anyio.to_thread.run_sync(self._artifacts.delete, v.digest)
            self.deleted.add(v.digest)
            log.info("reclaim.artifact_deleted", version=v.version_id, digest=v.digest[:16])
