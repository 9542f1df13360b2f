"""The ledger's typed API: one method per command, each a single call of ``_run``.

:class:`LedgerAPI` is what callers use (``ledger.bind(session, owner)``,
``ledger.commit(version_id, attempt)``): it builds the command, executes it through the
single-writer pipeline of :class:`publisher.core.ledger.Ledger` (which inherits these methods), and
checks the outcome is the kind the command answers. Names and types live here; ordering,
batching and durability live in the pipeline. Adding a command is one method whose body is one
``_run`` line.

What each command checks, and in which order: ``publisher/core/decider/`` (one module per
aggregate); the version states it can move through: ``projections/transitions.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

from evlog.errors import LoraLedgerError
from evlog.events import InFlight, TurnFailures
from projections.status import LedgerStatus, status_of
from publisher.core import commands as c
from publisher.core.decider import check_lease
from publisher.core.errors import Code, LedgerError
from publisher.core.outcomes import (
    Allocated,
    AttemptEnded,
    Bound,
    Claimed,
    Deregistered,
    Done,
    Expired,
    Forgotten,
    InventoryRecorded,
    Outcome,
    Published,
    ReclaimGranted,
    Released,
    Skipped,
    UnloadRecorded,
)
from publisher.core.session_activity import IDLE_TOMBSTONE_S
from publisher.logs import get_logger

if TYPE_CHECKING:
    from projections.registry import RegistryState
    from publisher.core.leases import LeaseBook
    from publisher.core.session_activity import SessionActivity

log = get_logger("loraledger.ledger")
OutcomeT = TypeVar("OutcomeT", bound=Outcome)


class TypedCommands:
    """One typed method per command over ``execute``, each a single :meth:`_run`: the session
    commands here, which every ledger a rollout worker uses offers (the in-process
    :class:`~publisher.core.ledger.Ledger`, a remote ledger); the others in :class:`LedgerAPI`."""

    __slots__ = ()

    if TYPE_CHECKING:

        async def execute(self, command: c.Command) -> Outcome: ...

    async def _run(
        self, command: c.Command, answer: type[OutcomeT] | tuple[type[OutcomeT], ...]
    ) -> OutcomeT:
        """The one path of the typed API: execute, then check the outcome is the kind the
        command answers (anything else is a bug in the decider, not a refusal)."""
        outcome = await self.execute(command)
        if not isinstance(outcome, answer):
            raise AssertionError(f"{type(command).__name__} answered {outcome!r}")
        return outcome

    async def bind(
        self, session: str, owner: str, *, incarnation: str = "", secret: str = ""
    ) -> Bound:
        """Bind a session to the default version, for good (later calls answer the same).
        ``incarnation`` (``""``: unchecked) fences out a replaced life of the owner;
        ``secret`` is the owner's current life's (``register_owner``)."""
        command = c.Bind(session=session, owner=owner, incarnation=incarnation, secret=secret)
        return await self._run(command, Bound)

    async def release(
        self,
        session: str,
        owner: str,
        *,
        cause: str = "closed",
        incarnation: str = "",
        secret: str = "",
    ) -> Released:
        """Release a session: it is tombstoned and can never bind again."""
        command = c.Release(
            session=session, owner=owner, cause=cause, incarnation=incarnation, secret=secret
        )
        return await self._run(command, Released)

    async def forget(self, sessions: Iterable[str]) -> Forgotten:
        """Drop released sessions' tombstones (refused, nothing dropped, if one is bound)."""
        return await self._run(c.Forget(sessions=tuple(sessions)), Forgotten)


class LedgerAPI(TypedCommands):
    """The typed methods of the ledger, over what the pipeline provides: ``execute``, the
    live ``state``, the ``clock`` and the lease book (``leases``, renewals are not logged)."""

    __slots__ = ()

    if TYPE_CHECKING:
        leases: LeaseBook
        activity: SessionActivity

        @property
        def state(self) -> RegistryState: ...

        def clock(self) -> float: ...

        async def execute_many(
            self, commands: Sequence[c.Command]
        ) -> list[Outcome | LoraLedgerError]: ...

    # --- deployment and fleet ------------------------------------------------------------------

    async def create_deployment(
        self, deployment: str, *, prefix: str, capacity: int, fleet: Iterable[str] = ()
    ) -> Done:
        """Create the log's one deployment (a no-op when it exists with the same rules)."""
        command = c.CreateDeployment(
            deployment=deployment, prefix=prefix, capacity=capacity, fleet=tuple(fleet)
        )
        return await self._run(command, Done)

    async def configure_deployment(self, *, max_staleness: int | None = None) -> Done:
        """Set the deployment's tunable rules (recorded; a no-op when unchanged):
        ``max_staleness`` bounds how many versions a session may fall behind the default
        before its next turn is refused (``SESSION_TOO_STALE``); None: unbounded."""
        return await self._run(c.ConfigureDeployment(max_staleness=max_staleness), Done)

    async def join_engine(
        self, engine: str, incarnation: str, *, endpoint: str = "", kind: str = "local"
    ) -> Done:
        """Admit an engine to the fleet. It serves nothing until :meth:`repair_engine`."""
        command = c.JoinEngine(engine=engine, incarnation=incarnation, endpoint=endpoint, kind=kind)
        return await self._run(command, Done)

    async def observe_restart(
        self,
        engine: str,
        incarnation: str,
        *,
        endpoint: str | None = None,
        kind: str | None = None,
    ) -> Done:
        """A new process life of an engine: it lost every adapter, unroutable until repaired.
        Its ``endpoint`` and ``kind`` are recorded if they changed."""
        command = c.ObserveRestart(
            engine=engine, incarnation=incarnation, endpoint=endpoint, kind=kind
        )
        return await self._run(command, Done)

    async def restore_version(self, version_id: int, engine: str, incarnation: str) -> Done:
        """Repair reloaded a still-needed version on an engine."""
        command = c.RestoreVersion(version_id=version_id, engine=engine, incarnation=incarnation)
        return await self._run(command, Done)

    async def repair_engine(self, engine: str, incarnation: str) -> Done:
        """Make an engine routable; refused (``NOT_READY``) until it holds every needed version."""
        return await self._run(c.RepairEngine(engine=engine, incarnation=incarnation), Done)

    async def leave_engine(self, engine: str) -> Done:
        """Remove an engine from the fleet (the proofs still owed by it are owed no more)."""
        return await self._run(c.LeaveEngine(engine=engine), Done)

    async def suspend_engine(
        self, engine: str, *, cause: str, detail: str = "", incarnation: str = ""
    ) -> Done:
        """Quarantine an engine (``unhealthy``, ``lost_adapter`` or ``operator``): no new
        traffic, and publication and reclaim stop waiting for it until it is repaired."""
        command = c.SuspendEngine(
            engine=engine, cause=cause, detail=detail, incarnation=incarnation
        )
        return await self._run(command, Done)

    async def suspend_unanswered(
        self,
        engine: str,
        incarnation: str,
        *,
        call: str,
        waited_s: float,
        timeout_s: float,
    ) -> Done:
        """Take an engine whose publication call went unanswered past the control timeout,
        and whose probes fail, out of the attempt and of routing (cause ``unanswered``)."""
        command = c.SuspendUnanswered(
            engine=engine,
            incarnation=incarnation,
            call=call,
            waited_s=waited_s,
            timeout_s=timeout_s,
        )
        return await self._run(command, Done)

    async def resume_engine(self, engine: str, *, cause: str = "operator") -> Done:
        """Lift a suspension; the engine serves again once the reconciler repaired it."""
        return await self._run(c.ResumeEngine(engine=engine, cause=cause), Done)

    async def remove_engine(self, engine: str, *, cause: str = "operator") -> Done:
        """An operator removes an engine from the fleet (recorded with its cause)."""
        return await self._run(c.RemoveEngine(engine=engine, cause=cause), Done)

    async def observe_inventory(
        self,
        engine: str,
        incarnation: str,
        adapters: Iterable[str],
        *,
        digests: Iterable[tuple[str, str]] = (),
    ) -> InventoryRecorded:
        """What an engine says it holds: absence proofs for fatal attempts and reclaims, strays,
        and (``digests``: name, digest of the bytes it loaded) content that is not the
        version's under a committed name."""
        command = c.ObserveInventory(
            engine=engine,
            incarnation=incarnation,
            adapters=tuple(adapters),
            digests=tuple(sorted(digests)),
        )
        return await self._run(command, InventoryRecorded)

    async def check_canary(
        self, engine: str, incarnation: str, version_id: int, answer: str
    ) -> Done:
        """An engine life's answer to a held version's canary: its baseline the first time,
        a ``ServedContentMismatch`` when a later answer differs, else nothing."""
        command = c.CheckCanary(
            engine=engine, incarnation=incarnation, version_id=version_id, answer=answer
        )
        return await self._run(command, Done)

    async def report_unreachable(
        self,
        engine: str,
        incarnation: str,
        *,
        at: float,
        error: str,
        source: str,
        reporter: str = "",
    ) -> Done:
        """The engine could not be reached at ``at`` (``source`` ``probe`` or ``dispatch``):
        out of routing from now on, recorded once per outage (``EngineUnreachable``)."""
        command = c.ReportUnreachable(
            engine=engine,
            incarnation=incarnation,
            at=at,
            error=error,
            source=source,
            reporter=reporter,
        )
        return await self._run(command, Done)

    async def count_dispatch_failures(
        self, engine: str, incarnation: str, failures: Iterable[TurnFailures]
    ) -> Done:
        """Generations that failed on the engine, per session, recorded against its open
        outage (``DispatchFailures``); a no-op without one."""
        command = c.CountDispatchFailures(
            engine=engine, incarnation=incarnation, failures=tuple(failures)
        )
        return await self._run(command, Done)

    async def report_reachable(self, engine: str, incarnation: str, *, at: float) -> Done:
        """A probe of the engine's life ``incarnation`` answered at ``at``: its outage ends
        (``EngineReachable``)."""
        command = c.ReportReachable(engine=engine, incarnation=incarnation, at=at)
        return await self._run(command, Done)

    # --- publication ---------------------------------------------------------------------------

    async def allocate(
        self,
        version_id: int,
        digest: str,
        *,
        size_bytes: int = 0,
        allow_rollback: bool = False,
        command_id: str | None = None,
    ) -> Allocated | Skipped:
        """Open the next attempt of a version (or return the one under way, or the completed
        version); a full capacity once something is published is a recorded skip. A version
        lower than the default is refused (``VERSION_REGRESSION``, recorded) unless
        ``allow_rollback``."""
        command = c.Allocate(
            version_id=version_id,
            digest=digest,
            size_bytes=size_bytes,
            allow_rollback=allow_rollback,
            command_id=command_id,
        )
        return await self._run(command, (Allocated, Skipped))

    async def claim_transport(self, version_id: int, attempt: int, owner: str) -> Claimed:
        """Make ``owner`` the one driver of the attempt's transfers."""
        command = c.ClaimTransport(version_id=version_id, attempt=attempt, owner=owner)
        return await self._run(command, Claimed)

    async def record_prepared(
        self,
        version_id: int,
        attempt: int,
        engine: str,
        incarnation: str,
        digest: str,
        lora_name: str,
    ) -> Done:
        """A fenced receipt: the engine staged the attempt's adapter."""
        return await self._receipt(
            c.RecordPrepared, version_id, attempt, engine, incarnation, digest, lora_name
        )

    async def record_ready(
        self,
        version_id: int,
        attempt: int,
        engine: str,
        incarnation: str,
        digest: str,
        lora_name: str,
    ) -> Done:
        """A fenced receipt: the engine loaded the attempt's adapter and echoed its name and
        digest. A mismatch is recorded (``ReceiptRejected``) and refused."""
        return await self._receipt(
            c.RecordReady, version_id, attempt, engine, incarnation, digest, lora_name
        )

    async def _receipt(
        self,
        step: type[c.EngineReceipt],
        version_id: int,
        attempt: int,
        engine: str,
        incarnation: str,
        digest: str,
        lora_name: str,
    ) -> Done:
        """Both receipts are one command shape; only the step (the command's type) differs."""
        command = step(
            version_id=version_id,
            attempt=attempt,
            engine=engine,
            incarnation=incarnation,
            digest=digest,
            lora_name=lora_name,
        )
        return await self._run(command, Done)

    async def commit(
        self, version_id: int, attempt: int, *, command_id: str | None = None
    ) -> Published:
        """Publish the attempt once every fleet engine is READY: it becomes the default and the
        previous default is RETIRED. Under a ``command_id``, asking again answers the recorded
        outcome (its revision and the version it retired)."""
        command = c.Commit(version_id=version_id, attempt=attempt, command_id=command_id)
        return await self._run(command, Published)

    async def fail_attempt(
        self,
        version_id: int,
        attempt: int,
        *,
        clean: bool,
        code: str,
        reason: str,
        absent_on: Iterable[str] = (),
    ) -> AttemptEnded:
        """End the attempt: FAILED_RETRYABLE if ``clean`` and ``absent_on`` covers the fleet,
        otherwise FAILED_FATAL (publication blocked until inventories prove absence)."""
        command = c.FailAttempt(
            version_id=version_id,
            attempt=attempt,
            clean=clean,
            code=code,
            reason=reason,
            absent_on=tuple(absent_on),
        )
        return await self._run(command, AttemptEnded)

    # --- owners and sessions -------------------------------------------------------------------

    async def register_owner(
        self,
        owner: str,
        *,
        ttl_s: float = 30.0,
        incarnation: str = "",
        sessions_idle_s: float | None = None,
        secret: str = "",
    ) -> Done:
        """Register a session owner; its lease starts now and must be renewed within ``ttl_s``.

        ``incarnation`` names this process life of the owner (a uuid per worker start; the
        worker makes one). Another incarnation of a live owner replaces it: the predecessor's
        sessions are released (``owner_restarted``) and it is fenced out
        (``OWNER_RESTARTED``). The same incarnation again is a no-op (a retry).

        ``sessions_idle_s`` (None: the owner holds its sessions) registers a relay whose
        sessions are client-held: no end of its life releases them, and this process releases
        one after that long without a turn (0: never; docs/sessions.md).

        ``secret`` (made by the caller, ``secrets.token_hex(32)``; the log keeps its digest):
        every later bind, renewal, release and deregistration of this life must carry it."""
        now = self.clock()
        before = self.state.owners.get(owner)
        replaced = (
            (before.incarnation, before.ttl_s) if before is not None and before.live else None
        )
        command = c.RegisterOwner(
            owner=owner,
            ttl_s=ttl_s,
            now=now,
            incarnation=incarnation,
            sessions_idle_s=sessions_idle_s,
            secret=secret,
        )
        outcome = await self._run(command, Done)
        if outcome.no_op:
            self.leases.grant(owner, now)
        elif replaced is not None:
            self.leases.restart(owner, now, replaced=replaced[0], ttl_s=replaced[1])
        else:
            self.leases.restart(owner, now)
        return outcome

    async def deregister_owner(
        self, owner: str, *, incarnation: str = "", secret: str = ""
    ) -> Deregistered:
        """A clean exit: end ``owner``'s life (``incarnation``; ``""``: the current one) and
        release its sessions still bound (``owner_exited``) now, without waiting for its lease
        to run out. Recorded as a clean end, not an incident. Idempotent."""
        command = c.DeregisterOwner(
            owner=owner, now=self.clock(), incarnation=incarnation, secret=secret
        )
        outcome = await self._run(command, Deregistered)
        if not outcome.no_op:
            self.leases.drop(owner)
        return outcome

    def renew_lease(
        self,
        owner: str,
        inflight: Mapping[tuple[str, int], int] | None = None,
        *,
        incarnation: str = "",
        sessions: Iterable[str] = (),
        secret: str = "",
    ) -> None:
        """Renew ``owner``'s lease (not logged) and record its in-flight counts per
        (engine, version_id). A stale worker gets ``OWNER_RESTARTED`` (a newer incarnation
        replaced ``incarnation``), ``LEASE_EXPIRED``, ``OWNER_DEREGISTERED`` or
        ``UNKNOWN_OWNER``, by the same rule the decider applies to its commands; a call
        without the life's ``secret`` ``OWNER_SECRET_MISMATCH``: only the life that dispatched
        the requests can report them in flight (or none), so no other caller can make a
        version look idle to reclaim.

        ``sessions``: the client-held sessions a relay had a turn of since its last renewal
        (admitted, ended, or running): their last turn is now, by this process's clock (soft
        state, ``publisher/core/session_activity.py``)."""
        check_lease(self.state, owner, required=True, incarnation=incarnation, secret=secret)
        if inflight is not None:
            _check_inflight(inflight)
        now = self.clock()
        if sessions:
            touched = () if isinstance(sessions, str) else tuple(sessions)
            if not touched or not all(isinstance(x, str) for x in touched):
                raise LedgerError(Code.INVALID_INPUT, "sessions must be session ids (strings)")
            self.activity.touch(touched, now, self.state.sessions)
        self.leases.renew(owner, now, inflight)

    async def expire_leases(self) -> list[Expired]:
        """Record the expiry of every owner whose lease ran out (called periodically)."""
        now = self.clock()
        live = {o: r for o, r in self.state.owners.items() if r.live}
        expired: list[Expired] = []
        for owner, last_seen in self.leases.overdue(now, {o: r.ttl_s for o, r in live.items()}):
            command = c.ExpireOwner(
                owner=owner, now=now, last_seen=last_seen, incarnation=live[owner].incarnation
            )
            try:
                outcome = await self._run(command, Expired)
            except LedgerError as refusal:
                if refusal.code != Code.OWNER_RESTARTED:
                    raise
                continue  # a new incarnation registered meanwhile: its lease is a fresh one
            self.leases.drop(owner)
            expired.append(outcome)
            log.warning("ledger.lease_expired", owner=owner, released=outcome.released)
        return expired

    async def release_idle_sessions(self, *, tombstone_s: float = IDLE_TOMBSTONE_S) -> int:
        """Release every client-held session that had no turn for its idle bound (by the
        faces' reports, :meth:`renew_lease`), each with the last turn as evidence, and forget
        the tombstones of this process's idle releases older than ``tombstone_s`` (called
        periodically, beside :meth:`expire_leases`). Returns how many it released.

        A session whose turn is reported between the sweep and the decision is released on
        the older evidence (as a renewal racing an expiry): a turn admitted at that instant
        runs to its end (its in-flight count holds the version), and its next one is refused
        ``SESSION_CLOSED``."""
        now = self.clock()
        idle = self.activity.idle(now, self.state.sessions)
        released = 0
        if idle:
            commands = [c.ReleaseIdle(session=s, now=now, last_turn=t) for s, t in idle]
            for (session, _), result in zip(idle, await self.execute_many(commands), strict=True):
                if isinstance(result, Released):
                    released += result.released
                    self.activity.drop(session)
                else:
                    log.error("ledger.idle_release_failed", session=session, error=str(result))
            log.info("ledger.idle_released", released=released)
        old: list[str] = []
        for session, at in self.state.idle_released.items():  # in release order
            if now - at < tombstone_s or len(old) >= FORGET_BATCH:
                break
            old.append(session)
        if old:
            await self.forget(old)
        return released

    def inflight_evidence(self, version_id: int) -> list[InFlight]:
        """The in-flight counts the live owners last renewed with (and lives replaced while
        their lease still runs), for ``claim_reclaim``."""
        return self.leases.inflight(version_id, self.clock())

    def inflight_unheard(self) -> list[str]:
        """Live owners whose in-flight counts this controller has not heard since it started
        (no renewal yet, lease still running): until each renews or expires, a request of
        theirs may run on a version with no count to show it, so reclaim waits."""
        return self.leases.unheard()

    # --- reclaim -------------------------------------------------------------------------------

    async def claim_reclaim(
        self, version_id: int, evidence: Iterable[InFlight] = ()
    ) -> ReclaimGranted:
        """Start reclaiming a RETIRED version no session is bound to and, by ``evidence``, no
        request uses."""
        command = c.ClaimReclaim(version_id=version_id, evidence=tuple(evidence))
        return await self._run(command, ReclaimGranted)

    async def record_unloaded(
        self, version_id: int, engine: str, incarnation: str
    ) -> UnloadRecorded:
        """An engine proved it unloaded a reclaiming version (the last proof completes it)."""
        command = c.RecordUnloaded(version_id=version_id, engine=engine, incarnation=incarnation)
        return await self._run(command, UnloadRecorded)

    async def mark_reclaim_ambiguous(self, version_id: int, engine: str, reason: str) -> Done:
        """An unload's outcome is unknown: the slot stays held until an inventory resolves it."""
        command = c.MarkReclaimAmbiguous(version_id=version_id, engine=engine, reason=reason)
        return await self._run(command, Done)

    def status(self) -> LedgerStatus:
        """The live state as a :class:`~projections.status.LedgerStatus`."""
        return status_of(self.state)


# Idle tombstones forgotten in one command (a day's releases of a busy gateway are many).
FORGET_BATCH = 1024

# One renewal reports a worker's requests per (engine, version): a few entries, small counts.
# The caps bound what one renewal may make the ledger hold and sum (leases are kept in memory
# per owner, and every reclaim decision adds them up).
MAX_INFLIGHT_ENTRIES = 1024
MAX_INFLIGHT_COUNT = 1_000_000
MAX_ENGINE_ID_CHARS = 256


def _check_inflight(inflight: Mapping[tuple[str, int], int]) -> None:
    """Refuse (``INVALID_INPUT``, nothing renewed) counts a reclaim decision could misread: a
    negative count cancelled another reporter's positive one in the reclaim driver's sum (an
    unload under a running request), and any non-zero one held the version forever. Over the
    caps above is refused the same way."""
    if len(inflight) > MAX_INFLIGHT_ENTRIES:
        raise LedgerError(
            Code.INVALID_INPUT,
            f"{len(inflight)} in-flight entries in one renewal; at most {MAX_INFLIGHT_ENTRIES}",
        )
    for key, count in inflight.items():
        engine, version_id = key if isinstance(key, tuple) and len(key) == 2 else (None, None)
        if (
            not isinstance(engine, str)
            or not engine
            or not isinstance(version_id, int)
            or isinstance(version_id, bool)
            or version_id <= 0
            or not isinstance(count, int)
            or isinstance(count, bool)
            or not 0 <= count <= MAX_INFLIGHT_COUNT
            or len(engine) > MAX_ENGINE_ID_CHARS
            or version_id >= 2**63
        ):
            raise LedgerError(
                Code.INVALID_INPUT,
                f"in-flight count {key!r}: {count!r} must be (engine, version id > 0): "
                f"0 <= count <= {MAX_INFLIGHT_COUNT}",
            )
