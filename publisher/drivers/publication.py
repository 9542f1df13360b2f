"""PublicationDriver: one trainer step's adapter, published to the fleet (docs/publication.md).

``await driver.publish(adapter, version_id=step)`` returns a :class:`PublicationOutcome`
(``PUBLISHED``, ``NO_OP`` or ``SKIPPED``) or raises :class:`PublicationError` whose ``kind`` is
``RETRYABLE`` (nothing left behind: the attempt ended ``FAILED_RETRYABLE``, or capacity or
another publication was in the way; a later step publishes again) or ``FATAL`` (the attempt
ended ``FAILED_FATAL`` and holds its slot until inventories resolve it, publication is blocked
by such an entry, or the request is wrong: ``VERSION_CONFLICT``, ``INVALID_VERSION``).

The steps, each one recorded in the ledger before the next begins:

1. **allocate** (``VersionAllocated``/``AttemptStarted``): capacity is checked here, before any
   byte moves. After bootstrap a full capacity is ``SKIPPED`` (``PublicationSkipped``). A
   ``PUBLICATION_BLOCKED`` refusal (an unresolved fatal/ambiguous entry) runs the reconciler once
   and retries allocate once.
2. **claim** (``TransportClaimed``): one transport owner per attempt. The owner id is unique per
   ``publish`` call, so a second driver -- or a re-entered ``publish`` of the same version that
   does not find the running call in this process -- is refused (``PUBLICATION_IN_PROGRESS``)
   and never sends a byte twice. A re-entered call that does find it waits for its result.
3. **prepare** every engine of the attempt's fleet (``EnginePrepared``), then **transfer**
   (staged engines get the adapter's buckets; the artifact directory is written once per
   digest for every version -- artifact engines load it by path, and the reconciler reloads
   restarted engines from it), **load**, and **confirm** with a *fresh inventory* that the name
   is really there with our digest in the receipt's incarnation (the "adapter silently never
   applied" bug class) before ``EngineReady`` is recorded. Engines run concurrently, each
   through :func:`publisher.drivers.engine_protocol.stage_and_load`.
4. **commit** (``VersionPublished``): the decider moves the default only if every engine of the
   attempt's target set (its fleet less the engines suspended since, each with its cause) is
   READY at its current incarnation.

Failure rules:

* An engine failure does not cancel its siblings (cancelling an in-flight call would turn a
  known outcome into an ambiguous one); every engine finishes or fails within its timeouts.
* Then the candidate is cleaned off every engine of the attempt (``unload(name, attempt=...)``,
  attempt-fenced) and each engine is asked for a fresh inventory
  (:func:`publisher.drivers.engine_protocol.unload_and_prove_absent`). If no reply of the attempt
  was ambiguous and every engine proved the name absent, the attempt ends ``FAILED_RETRYABLE``
  (slot freed); otherwise ``FAILED_FATAL`` (slot kept until inventories resolve it).
* **Cancellation** of ``publish`` runs the same cleanup inside a shielded, time-bounded scope.
  Justified (cleanup of a failed attempt is the one place for a shield): this call holds the
  attempt's claim, so nobody else may end it; abandoning it would leave a ``LOADING`` version
  that blocks every later publication. Each call inside is bounded by ``timeouts.cleanup``.
  The ledger calls that create or settle an obligation (allocate, claim, commit) are shielded
  for the same reason: a cancelled waiter would not learn whether it now holds an attempt.
* An engine **suspended** during the attempt (``EngineSuspended``: its probes failed for too
  long, or an operator) is no longer waited for: its run is abandoned (its failure does not
  fail the attempt), the commit needs READY from the active engines only, and the cleanup
  skips it -- its repair settles what it holds before it serves again.
* An engine that **does not answer** -- a call outstanding for the control timeout
  (``timeouts.probe``) while the ledger records an outage of it (its probes fail too) -- is
  offered to the decider (``SuspendUnanswered``), which suspends it with cause ``unanswered``:
  it leaves the attempt's target set as above, within the timeout rather than after the
  reconciler's ``suspend_after_s``. A slow engine that answers probes is waited for.
* Nothing here pauses generation or flushes a cache, and a failure reclaiming the predecessor
  (the reclaim driver's job, after commit) never turns a committed publication into an error.

Why one module of ~600 lines: the steps and the failure rules are one procedure (allocate to
commit, with the cleanup every exit path runs); the engine-side halves already live in
:mod:`publisher.drivers.engine_protocol`, so what remains reads top to bottom as the publication.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import msgspec

from engines.artifacts import ArtifactStore
from engines.contract import Candidate, EngineError, Receipt
from evlog.errors import LoraLedgerError, StoreCode
from projections.registry import VersionState
from publisher.core.errors import Code
from publisher.core.outcomes import Allocated, Skipped
from publisher.drivers.adapter_source import AdapterSource
from publisher.drivers.engine_ops import EngineTimeouts
from publisher.drivers.engine_protocol import stage_and_load, unload_and_prove_absent
from publisher.drivers.fleet import Fleet
from publisher.logs import get_logger

if TYPE_CHECKING:
    from publisher.core.ledger import Ledger
    from publisher.drivers.reconciler import Reconciler

log = get_logger("loraledger.publication")
T = TypeVar("T")

ARTIFACT_WRITE_FAILED = "ARTIFACT_WRITE_FAILED"
CANCELLED = "CANCELLED"


class PublicationStatus(StrEnum):
    PUBLISHED = "PUBLISHED"
    NO_OP = "NO_OP"  # the version id is already completed: nothing moved, the default neither
    SKIPPED = "SKIPPED"  # refused before any byte moved (capacity after bootstrap), recorded


class ErrorKind(StrEnum):
    RETRYABLE = "RETRYABLE"
    FATAL = "FATAL"


# Allocation refusals that a later step resolves by itself.
_RETRYABLE_CODES = frozenset(
    {
        Code.CAPACITY_ERROR,
        Code.PUBLICATION_IN_PROGRESS,
        Code.FLEET_MISMATCH,
        StoreCode.STORE_FAILED,
    }
)


# The publication driver's own code: an attempt that started and failed (its ``kind`` and
# ``details["cause"]`` say how); every other code of a PublicationError is the ledger's.
PUBLICATION_FAILED = "PUBLICATION_FAILED"
DEFAULT_MAX_ENGINES_AT_ONCE = 64  # PublicationDriver.max_engines_at_once


class PublicationError(LoraLedgerError):
    """A publication that did not happen. ``kind`` is ``RETRYABLE`` or ``FATAL``; ``code`` is
    the ledger refusal (allocation) or ``PUBLICATION_FAILED`` (an attempt that failed), with the
    cause in ``details["cause"]`` and the attempt's final state in ``details["state"]``.

    It belongs to no family: its ``kind`` is the trainer's retry rule (a ``FATAL`` may be an
    allocation refusal as well as an ambiguous engine reply)."""

    def __init__(self, code: str, message: str, *, kind: str, **details: Any) -> None:
        super().__init__(code, message, kind=kind, **details)
        self.kind = kind


class EngineTiming(msgspec.Struct, frozen=True, kw_only=True):
    """One engine's part of a publication. ``ready_after_s`` is the publish-to-ready latency:
    from the ``publish`` call to READY confirmed by inventory and recorded."""

    engine: str
    transport: str
    prepare_s: float
    transfer_s: float
    load_s: float
    confirm_s: float
    ready_after_s: float


class PublicationOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """What ``publish`` answers (plain data: it crosses process boundaries unchanged)."""

    status: str
    version_id: int
    digest: str
    lora_name: str | None = None
    revision: int | None = None
    attempt: int | None = None
    retired: int | None = None
    code: str | None = None  # SKIPPED: why
    message: str = ""
    size_bytes: int = 0
    total_s: float = 0.0
    artifact_s: float = 0.0
    engines: tuple[EngineTiming, ...] = ()

    def ready_latency(self) -> dict[str, float]:
        """Publish-to-ready seconds per engine."""
        return {t.engine: t.ready_after_s for t in self.engines}


@dataclasses.dataclass(frozen=True)
class _Attempt:
    version_id: int
    attempt: int
    lora_name: str
    digest: str
    fleet: tuple[str, ...]
    owner: str


@dataclasses.dataclass
class _EngineRun:
    engine: str
    timing: EngineTiming | None = None
    error: BaseException | None = None
    ambiguous: bool = False
    abandoned: bool = False  # the engine was suspended or left mid-attempt: not waited for
    scope: anyio.CancelScope | None = None
    finished: bool = False
    busy_since: float | None = None  # when the outstanding engine call began (monotonic)

    @property
    def busy(self) -> bool:
        """Inside an engine call right now (cancellation makes it ambiguous)."""
        return self.busy_since is not None

    @busy.setter
    def busy(self, value: bool) -> None:
        if not value:
            self.busy_since = None
        elif self.busy_since is None:
            self.busy_since = time.monotonic()


@dataclasses.dataclass
class _ArtifactWrite:
    done: anyio.Event
    path: Path | None = None
    error: BaseException | None = None
    seconds: float = 0.0


class _AttemptFailed(Exception):
    def __init__(self, *, clean: bool, code: str, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.clean = clean
        self.code = code
        self.reason = reason


class _Running:
    """A publish call in progress in this process, so a re-entered call can wait for it."""

    def __init__(self, digest: str) -> None:
        self.digest = digest
        self.done = anyio.Event()
        self.outcome: PublicationOutcome | None = None
        self.error: PublicationError | None = None


class PublicationDriver:
    """Drives publications against ``ledger`` and the engines of ``fleet``.

    ``reconciler`` (optional) is run once when allocation is ``PUBLICATION_BLOCKED``, and poked
    after a failed attempt so a restarted engine is noticed at once. ``owner`` prefixes the
    per-call transport owner ids recorded in the log.
    """

    def __init__(
        self,
        ledger: Ledger,
        fleet: Fleet,
        artifacts: ArtifactStore,
        *,
        reconciler: Reconciler | None = None,
        timeouts: EngineTimeouts | None = None,
        cleanup_timeout: float = 60.0,
        owner: str = "publisher",
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._ledger = ledger
        self._fleet = fleet
        self._artifacts = artifacts
        self._reconciler = reconciler
        self.timeouts = timeouts or EngineTimeouts()
        self.cleanup_timeout = cleanup_timeout
        self.suspension_poll_s = 0.1
        # How many engines one attempt drives at once (prepare through confirm, and the
        # cleanup's unloads): a fleet of hundreds is not hit by hundreds of loads and inventory
        # reads in the same instant, and this process does not hold a transfer per engine.
        # 64 keeps 256 engines to four waves of a small fleet's time.
        self.max_engines_at_once = DEFAULT_MAX_ENGINES_AT_ONCE
        self.owner = owner
        self._clock = clock
        self._running: dict[int, _Running] = {}

    # --- the API ----------------------------------------------------------------------------

    async def publish(
        self,
        adapter: AdapterSource,
        *,
        version_id: int,
        allow_rollback: bool = False,
        request_id: str | None = None,
    ) -> PublicationOutcome:
        """Publish ``adapter`` as ``version_id`` (see the module docstring). A version lower
        than the default is refused (``VERSION_REGRESSION``) unless ``allow_rollback``: then
        it becomes the default and the commit is recorded as a rollback.

        ``request_id`` names one request of a remote caller across its retries (a trainer
        whose reply was lost asks again with the same id). The allocation and the commit are
        recorded under it (the ledger's command ids), so asking again answers what the first
        ask reached, from the log: ``PUBLISHED`` with the same revision, attempt and retired
        version, ``SKIPPED``, or the attempt's failure; never a second attempt, and never the
        ``NO_OP`` a new request for a published step gets."""
        running = self._running.get(version_id)
        if running is not None and running.digest == adapter.digest:
            # Re-entered while this process already drives it: wait, never transfer again.
            await running.done.wait()
            if running.error is not None:
                e = running.error
                raise PublicationError(e.code, e.message, **e.details)
            assert running.outcome is not None
            return running.outcome
        mine = _Running(adapter.digest)
        if running is None:
            self._running[version_id] = mine
        try:
            outcome = await self._publish(adapter, version_id, allow_rollback, request_id)
            mine.outcome = outcome
            return outcome
        except PublicationError as exc:
            mine.error = exc
            raise
        except BaseException:
            mine.error = PublicationError(
                PUBLICATION_FAILED,
                f"the publish call driving version {version_id} did not finish",
                kind=ErrorKind.RETRYABLE,
                version_id=version_id,
                cause=CANCELLED,
            )
            raise
        finally:
            mine.done.set()
            if self._running.get(version_id) is mine:
                del self._running[version_id]

    # --- steps ------------------------------------------------------------------------------

    async def _publish(
        self,
        adapter: AdapterSource,
        version_id: int,
        allow_rollback: bool,
        request_id: str | None,
    ) -> PublicationOutcome:
        t0 = self._clock()
        allocated = await self._allocate(
            adapter, version_id, allow_rollback, _command_id(request_id, "allocate")
        )
        if isinstance(allocated, Skipped):
            log.info(
                "publication.skipped",
                version=version_id,
                code=allocated.code,
                seq=self._ledger.state.last_seq,
            )
            return PublicationOutcome(
                status=PublicationStatus.SKIPPED,
                version_id=version_id,
                digest=adapter.digest,
                code=allocated.code,
                message=allocated.message,
                size_bytes=adapter.size_bytes,
                total_s=self._clock() - t0,
            )
        if allocated.no_op:
            v = self._ledger.state.versions[version_id]
            log.info("publication.no_op", version=version_id, state=str(v.state))
            return PublicationOutcome(
                status=PublicationStatus.NO_OP,
                version_id=version_id,
                digest=v.digest,
                lora_name=v.lora_name,
                revision=v.revision,
                attempt=v.attempt,
                size_bytes=adapter.size_bytes,
                total_s=self._clock() - t0,
            )
        v = self._ledger.state.versions[version_id]
        if request_id is not None and (
            v.attempt != allocated.attempt or v.state != VersionState.LOADING
        ):
            # The allocation was answered from the log: this request's attempt ran before
            # (published, or failed: never run it a second time).
            return await self._answer_again(adapter, allocated, request_id, t0)
        att = _Attempt(
            version_id=version_id,
            attempt=allocated.attempt,
            lora_name=allocated.lora_name,
            digest=allocated.digest,
            fleet=allocated.fleet,
            owner=f"{self.owner}:{uuid.uuid4().hex[:12]}",
        )
        log.info(
            "publication.allocated",
            version=version_id,
            attempt=att.attempt,
            fleet=list(att.fleet),
            resumed=allocated.resumed,
            seq=self._ledger.state.last_seq,
        )
        try:
            await _shielded(
                lambda: self._ledger.claim_transport(version_id, att.attempt, att.owner)
            )
        except LoraLedgerError as exc:
            # Someone else drives this attempt (or it ended meanwhile): nothing here may touch
            # it, and no byte is sent a second time.
            raise PublicationError(
                exc.code,
                f"version {version_id} attempt {att.attempt} cannot be claimed: {exc.message}",
                kind=ErrorKind.RETRYABLE,
                version_id=version_id,
                attempt=att.attempt,
                owner=exc.details.get("owner"),
            ) from exc
        runs: dict[str, _EngineRun] = {e: _EngineRun(e) for e in att.fleet}
        try:
            artifact_s = await self._transfer_and_load(att, adapter, runs, t0)
            published = await _shielded(
                lambda: self._ledger.commit(
                    version_id, att.attempt, command_id=_command_id(request_id, "commit")
                )
            )
        except _AttemptFailed as failure:
            raise await self._settle_failure(
                att, clean=failure.clean, code=failure.code, reason=failure.reason
            ) from failure
        except LoraLedgerError as exc:  # commit refused (e.g. an engine restarted after READY)
            raise await self._settle_failure(
                att, clean=True, code=exc.code, reason=exc.message
            ) from exc
        except BaseException:
            # Cancelled (or a bug): end the attempt before letting go of it.
            busy = [r.engine for r in runs.values() if r.busy or r.ambiguous]
            with anyio.CancelScope(shield=True):
                await self._end_attempt(
                    att,
                    clean=not busy,
                    code=CANCELLED,
                    reason="the publish call was cancelled"
                    + (f" during calls to {busy}" if busy else ""),
                )
            raise
        log.info(
            "publication.committed",
            version=version_id,
            attempt=att.attempt,
            revision=published.revision,
            retired=published.retired,
            seq=self._ledger.state.last_seq,
        )
        return PublicationOutcome(
            status=PublicationStatus.PUBLISHED,
            version_id=version_id,
            digest=att.digest,
            lora_name=att.lora_name,
            revision=published.revision,
            attempt=att.attempt,
            retired=published.retired,
            size_bytes=adapter.size_bytes,
            total_s=self._clock() - t0,
            artifact_s=artifact_s,
            engines=tuple(runs[e].timing for e in att.fleet if runs[e].timing is not None),  # type: ignore[misc]
        )

    async def _answer_again(
        self, adapter: AdapterSource, allocated: Allocated, request_id: str, t0: float
    ) -> PublicationOutcome:
        """What a request whose attempt ran before reached, read from the log. Committed: the
        commit recorded under the request answers again (revision, retired). Otherwise the
        attempt failed: its recorded state and cause, or, when a later attempt of the version
        exists, a clean failure (only a ``FAILED_RETRYABLE`` version is allocated again)."""
        version_id, attempt = allocated.version_id, allocated.attempt
        v = self._ledger.state.versions[version_id]
        if v.attempt == attempt and v.revision is not None:
            published = await _shielded(
                lambda: self._ledger.commit(
                    version_id, attempt, command_id=_command_id(request_id, "commit")
                )
            )
            log.info("publication.answered_again", version=version_id, attempt=attempt)
            return PublicationOutcome(
                status=PublicationStatus.PUBLISHED,
                version_id=version_id,
                digest=v.digest,
                lora_name=v.lora_name,
                revision=published.revision,
                attempt=attempt,
                retired=published.retired,
                size_bytes=adapter.size_bytes,
                total_s=self._clock() - t0,
            )
        if v.attempt == attempt:
            state, cause = v.state, v.failure_code or PUBLICATION_FAILED
        else:
            state, cause = VersionState.FAILED_RETRYABLE, f"SUPERSEDED_BY_ATTEMPT_{v.attempt}"
        kind = ErrorKind.RETRYABLE if state == VersionState.FAILED_RETRYABLE else ErrorKind.FATAL
        raise PublicationError(
            PUBLICATION_FAILED,
            f"version {version_id} attempt {attempt} of this request failed before ({cause}); "
            f"the attempt is {state}",
            kind=kind,
            version_id=version_id,
            attempt=attempt,
            state=str(state),
            cause=cause,
        )

    async def _allocate(
        self,
        adapter: AdapterSource,
        version_id: int,
        allow_rollback: bool,
        command_id: str | None,
    ) -> Allocated | Skipped:
        for round_ in (1, 2):
            try:
                return await _shielded(
                    lambda: self._ledger.allocate(
                        version_id,
                        adapter.digest,
                        size_bytes=adapter.size_bytes,
                        allow_rollback=allow_rollback,
                        command_id=command_id,
                    )
                )
            except LoraLedgerError as exc:
                if (
                    exc.code == Code.PUBLICATION_BLOCKED
                    and round_ == 1
                    and self._reconciler is not None
                ):
                    log.warning("publication.blocked", version=version_id, blocked_by=exc.details)
                    await self._reconciler.reconcile()
                    continue
                kind = ErrorKind.RETRYABLE if exc.code in _RETRYABLE_CODES else ErrorKind.FATAL
                details = {**exc.details, "version_id": version_id}
                raise PublicationError(exc.code, exc.message, kind=kind, **details) from exc
        raise AssertionError("unreachable")

    async def _transfer_and_load(
        self,
        att: _Attempt,
        adapter: AdapterSource,
        runs: dict[str, _EngineRun],
        t0: float,
    ) -> float:
        """Artifact write + every engine's prepare/transfer/load/confirm, concurrently."""
        artifact = _ArtifactWrite(done=anyio.Event())
        at_once = anyio.CapacityLimiter(self.max_engines_at_once)
        async with anyio.create_task_group() as watching:
            watching.start_soon(self._abandon_suspended, att, runs)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._write_artifact, adapter, artifact)
                for engine_id in att.fleet:
                    tg.start_soon(
                        self._engine_run, att, adapter, artifact, runs[engine_id], t0, at_once
                    )
            watching.cancel_scope.cancel()
        failed = [
            r
            for r in runs.values()
            if r.error is not None and not r.abandoned and not self._suspended(r.engine)
        ]
        if failed:
            first = failed[0].error
            code = getattr(first, "code", type(first).__name__)
            raise _AttemptFailed(
                clean=not any(r.ambiguous for r in failed),
                code=str(code),
                reason="; ".join(f"{r.engine}: {r.error}" for r in failed),
            )
        if artifact.error is not None:
            raise _AttemptFailed(
                clean=True, code=ARTIFACT_WRITE_FAILED, reason=f"artifact store: {artifact.error}"
            )
        return artifact.seconds

    def _suspended(self, engine_id: str) -> bool:
        """Whether the ledger stopped waiting for the engine (suspended, or no member)."""
        member = self._ledger.state.engines.get(engine_id)
        return member is None or member.suspended

    async def _abandon_suspended(self, att: _Attempt, runs: dict[str, _EngineRun]) -> None:
        """Cancel the run of an engine suspended mid-attempt: a hung engine must not hold the
        publication until its calls time out. Polls the ledger's state (cheap, in memory).
        An engine whose call is unanswered past the control timeout (``timeouts.probe``) is
        offered to the decider for suspension; it suspends only if the probes fail too."""
        offered: set[str] = set()
        while True:
            for run in runs.values():
                if run.finished or run.abandoned or run.scope is None:
                    continue
                if run.engine not in offered and await self._offer_unanswered(att, run):
                    offered.add(run.engine)
                if self._suspended(run.engine):
                    run.abandoned = True
                    run.scope.cancel()
                    log.warning(
                        "publication.engine_abandoned",
                        version=att.version_id,
                        attempt=att.attempt,
                        engine=run.engine,
                        reason="suspended",
                    )
            await anyio.sleep(self.suspension_poll_s)

    async def _offer_unanswered(self, att: _Attempt, run: _EngineRun) -> bool:
        """Ask the decider to take ``run``'s engine out of the attempt when its call has waited
        the control timeout while the ledger records an outage of it (the reconciler's probes
        failed). Whether the evidence suffices is the decider's rule; this only gathers it.
        Returns whether the engine's case was settled (suspended, or refused: not again)."""
        since = run.busy_since
        timeout = self.timeouts.probe
        member = self._ledger.state.engines.get(run.engine)
        if since is None or member is None or member.unreachable is None:
            return False
        waited = time.monotonic() - since
        if waited < timeout:
            return False
        try:
            done = await self._ledger.suspend_unanswered(
                run.engine,
                member.incarnation,
                call="publication call",
                waited_s=waited,
                timeout_s=timeout,
            )
        except LoraLedgerError as exc:  # restarted or left meanwhile: the run settles it
            log.warning("publication.suspend_refused", engine=run.engine, error=str(exc))
            return True
        log.warning(
            "publication.engine_unanswered",
            version=att.version_id,
            attempt=att.attempt,
            engine=run.engine,
            waited_s=round(waited, 1),
            suspended=not done.no_op,
        )
        return not done.no_op

    async def _write_artifact(self, adapter: AdapterSource, artifact: _ArtifactWrite) -> None:
        """Once per digest (an existing directory is verified and reused, the source's tensors
        never read: uploaded bytes are not fetched again), for every version: artifact engines
        load it, and a restarted engine is repaired from it."""
        t = self._clock()
        try:
            # ``tensors`` is read in the worker thread: a source whose bytes are elsewhere (Ray's
            # object store) fetches them there, never on the event loop.
            artifact.path = await anyio.to_thread.run_sync(
                lambda: self._artifacts.ensure(adapter.manifest, lambda: dict(adapter.tensors))
            )
        except Exception as exc:
            artifact.error = exc
        finally:
            artifact.seconds = self._clock() - t
            artifact.done.set()

    async def _engine_run(
        self,
        att: _Attempt,
        adapter: AdapterSource,
        artifact: _ArtifactWrite,
        run: _EngineRun,
        t0: float,
        at_once: anyio.CapacityLimiter,
    ) -> None:
        with anyio.CancelScope() as run.scope:  # an abandoned engine's wait for a turn ends too
            async with at_once:
                await self._engine_run_once(att, adapter, artifact, run, t0)
        run.finished = True

    async def _engine_run_once(
        self,
        att: _Attempt,
        adapter: AdapterSource,
        artifact: _ArtifactWrite,
        run: _EngineRun,
        t0: float,
    ) -> None:
        try:
            run.timing = await self._one_engine(att, adapter, artifact, run, t0)
        except EngineError as exc:
            run.error, run.ambiguous = exc, not exc.clean
        except (LoraLedgerError, _AttemptFailed) as exc:
            run.error = exc
        except Exception as exc:  # a bug in an adapter or here: we cannot know what happened
            run.error, run.ambiguous = exc, True
        if run.error is not None:
            log.warning(
                "publication.engine_failed",
                version=att.version_id,
                attempt=att.attempt,
                engine=run.engine,
                ambiguous=run.ambiguous,
                error=str(run.error),
            )

    async def _one_engine(
        self,
        att: _Attempt,
        adapter: AdapterSource,
        artifact: _ArtifactWrite,
        run: _EngineRun,
        t0: float,
    ) -> EngineTiming:
        engine = self._fleet[run.engine]
        ledger = self._ledger
        staged = engine.transport == "staged"
        path: str | None = None
        if not staged:
            await artifact.done.wait()
            if artifact.error is not None or artifact.path is None:
                raise _AttemptFailed(
                    clean=True,
                    code=ARTIFACT_WRITE_FAILED,
                    reason=f"no artifact directory to load from: {artifact.error}",
                )
            path = str(artifact.path)
        candidate = Candidate(
            lora_name=att.lora_name,
            digest=att.digest,
            attempt=att.attempt,
            manifest=adapter.manifest,
            artifact_path=path,
        )

        async def record_prepared(prepared: Receipt) -> None:
            await ledger.record_prepared(
                att.version_id,
                prepared.attempt,
                run.engine,
                prepared.incarnation,
                prepared.digest,
                prepared.lora_name,
            )

        # A load the inventory does not confirm fails cleanly (LoadNotConfirmed).
        loaded = await stage_and_load(
            engine,
            candidate,
            adapter.buckets if staged else (),
            timeouts=self.timeouts,
            on_prepared=record_prepared,
            watch=run,
            clock=self._clock,
        )
        ready = loaded.ready
        await ledger.record_ready(
            att.version_id,
            ready.attempt,
            run.engine,
            ready.incarnation,
            ready.digest,
            ready.lora_name,
        )
        t_ready = self._clock()
        log.info(
            "publication.engine_ready",
            version=att.version_id,
            attempt=att.attempt,
            engine=run.engine,
            incarnation=ready.incarnation,
            seq=ledger.state.last_seq,
        )
        return EngineTiming(
            engine=run.engine,
            transport=engine.transport,
            prepare_s=loaded.prepared_at - loaded.started,
            transfer_s=loaded.transferred_at - loaded.prepared_at,
            load_s=loaded.loaded_at - loaded.transferred_at,
            confirm_s=t_ready - loaded.loaded_at,
            ready_after_s=t_ready - t0,
        )

    # --- failure --------------------------------------------------------------------------

    async def _settle_failure(
        self, att: _Attempt, *, clean: bool, code: str, reason: str
    ) -> PublicationError:
        """End a failed attempt (shielded, bounded) and return the trainer's error."""
        with anyio.CancelScope(shield=True):
            state = await self._end_attempt(att, clean=clean, code=code, reason=reason)
        kind = ErrorKind.RETRYABLE if state == VersionState.FAILED_RETRYABLE else ErrorKind.FATAL
        return PublicationError(
            PUBLICATION_FAILED,
            f"version {att.version_id} attempt {att.attempt} failed ({code}): {reason}; "
            f"the attempt is {state}",
            kind=kind,
            version_id=att.version_id,
            attempt=att.attempt,
            state=str(state),
            cause=code,
        )

    async def _end_attempt(
        self, att: _Attempt, *, clean: bool, code: str, reason: str
    ) -> str | None:
        """Clean the candidate off every engine of the attempt, then record how it ended.
        Returns the version's state afterwards. Never leaves the attempt LOADING unless the
        ledger itself stopped."""
        v = self._ledger.state.versions.get(att.version_id)
        if v is None or v.state is not VersionState.LOADING or v.attempt != att.attempt:
            return None if v is None else str(v.state)  # committed or ended elsewhere
        absent = await self._clean_up(att)
        if self._reconciler is not None:
            self._reconciler.poke()  # a restart may be why: let the health loop look now
        try:
            ended = await self._ledger.fail_attempt(
                att.version_id,
                att.attempt,
                clean=clean,
                code=code,
                reason=reason,
                absent_on=absent,
            )
        except LoraLedgerError as exc:
            log.error("publication.fail_attempt_refused", version=att.version_id, error=str(exc))
            v = self._ledger.state.versions.get(att.version_id)
            return None if v is None else str(v.state)
        log.warning(
            "publication.failed",
            version=att.version_id,
            attempt=att.attempt,
            state=ended.state,
            code=code,
            absent_on=sorted(absent),
            reason=reason[:500],
            seq=self._ledger.state.last_seq,
        )
        return ended.state

    async def _clean_up(self, att: _Attempt) -> set[str]:
        """Unload the candidate (fenced by this attempt) on every engine of the attempt and
        collect the engines that proved it absent (:func:`unload_and_prove_absent`)."""
        absent: set[str] = set()

        at_once = anyio.CapacityLimiter(self.max_engines_at_once)

        async def one(engine_id: str) -> None:
            if engine_id not in self._fleet or self._suspended(engine_id):
                return  # a suspended engine owes the drop; its repair unloads it
            async with at_once:
                absence = await unload_and_prove_absent(
                    self._fleet[engine_id],
                    att.lora_name,
                    attempt=att.attempt,
                    unload_timeout=min(self.timeouts.unload, self.cleanup_timeout),
                    inventory_timeout=min(self.timeouts.inventory, self.cleanup_timeout),
                )
            if absence.proven:
                absent.add(engine_id)

        async with anyio.create_task_group() as tg:
            for engine_id in att.fleet:
                tg.start_soon(one, engine_id)
        return absent


def _command_id(request_id: str | None, step: str) -> str | None:
    """The ledger's command id of one step of a request (None: no request id, not recorded)."""
    return None if request_id is None else f"publish:{request_id}:{step}"


async def _shielded(fn: Callable[[], Awaitable[T]]) -> T:
    """A ledger call whose outcome we must learn even if our caller is cancelled meanwhile
    (the single writer answers it promptly; see the module docstring)."""
    with anyio.CancelScope(shield=True):
        return await fn()
    raise AssertionError("unreachable: a scope nobody cancels swallows no exception")
