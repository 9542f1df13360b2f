"""Model-based test: random command sequences against the ledger SERVICE and an independent,
deliberately simple model written here (not the decider), compared after every step.

The sequences include duplicates, stale attempts and receipts, lease-free session churn,
reclaims (clean and ambiguous), fatal failures resolved by inventories, and restarts of the
service mid-sequence (close and reopen on the same log, with and without a snapshot). After
every step the service's outcome must equal the model's prediction, the deep invariants must
hold, and the model's view (default, revision, version states, bindings) must equal the
service's.

Examples: a few hundred in CI, many more under ``--slow``.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass, field

from anyio.from_thread import start_blocking_portal
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from evlog.errors import LoraLedgerError
from evlog.memory import MemoryStore
from projections import invariants
from publisher.core import commands as c
from publisher.core.ledger import Ledger

ENGINES = ("e0", "e1")
CAPACITY = 2
VERSIONS = st.integers(min_value=1, max_value=3)
DIGESTS = st.sampled_from("ab")
SESSIONS = st.sampled_from([f"s{i}" for i in range(4)])
CAPACITY_STATES = {"LOADING", "PUBLISHED", "RETIRED", "RECLAIMING", "FAILED_FATAL"}
COMPLETED = {"PUBLISHED", "RETIRED", "RECLAIMING", "RECLAIMED"}


def digest(label: str) -> str:
    return hashlib.sha256(label.encode()).hexdigest()


@dataclass
class V:
    digest: str
    state: str = "LOADING"
    attempt: int = 1
    claimed: bool = False
    prepared: set[str] = field(default_factory=set)
    ready: set[str] = field(default_factory=set)
    confirmed: set[str] = field(default_factory=set)
    ambiguous: bool = False


class Model:
    """The registry rules of docs/state-machine.md, restated as plainly as possible."""

    def __init__(self) -> None:
        self.versions: dict[int, V] = {}
        self.default: int | None = None
        self.revision = 0
        self.bound: dict[str, int] = {}
        self.closed: set[str] = set()

    def used(self) -> int:
        return sum(v.state in CAPACITY_STATES for v in self.versions.values())

    def loading(self) -> int | None:
        return next((k for k, v in self.versions.items() if v.state == "LOADING"), None)

    def bound_to(self, vid: int) -> int:
        return sum(1 for x in self.bound.values() if x == vid)

    def blocked(self) -> bool:
        return any(x.state == "FAILED_FATAL" or (x.state == "RECLAIMING" and x.ambiguous)
                   for x in self.versions.values())  # fmt: skip

    def allocate(self, vid: int, dig: str, rollback: bool) -> tuple[str, object]:
        v = self.versions.get(vid)
        if v is not None and v.digest != dig:
            return "error", "VERSION_CONFLICT"
        if v is not None and v.state in COMPLETED:
            return "no_op", v.attempt
        if v is not None and v.state == "LOADING":
            return "resumed", v.attempt
        if self.default is not None and vid < self.default and not rollback:
            return "error", "VERSION_REGRESSION"
        if self.blocked():
            return "error", "PUBLICATION_BLOCKED"
        if self.used() >= CAPACITY:
            return ("skipped", None) if self.default is not None else ("error", "CAPACITY_ERROR")
        if self.loading() is not None:
            return "error", "PUBLICATION_IN_PROGRESS"
        if v is None:
            self.versions[vid] = V(digest=dig)
        else:
            v.state, v.attempt, v.ready = "LOADING", v.attempt + 1, set()
            v.claimed, v.prepared = False, set()
        return "allocated", self.versions[vid].attempt

    def ready(self, vid: int, attempt: int, engine: str) -> tuple[str, object]:
        """A driver's claim, PREPARED and READY in a row: the answer to the READY."""
        v = self.versions[vid]
        if engine in v.ready and attempt == v.attempt and v.state == "LOADING":
            return "no_op", None
        if v.state != "LOADING" or attempt != v.attempt:
            return "error", "ATTEMPT_CONFLICT"
        if not v.claimed and self.blocked():  # the claim is refused, so are the receipts
            return "error", "RECEIPT_OUT_OF_ORDER"
        v.claimed = True
        v.prepared.add(engine)
        v.ready.add(engine)
        return "ok", None

    def ready_alone(self, vid: int, engine: str) -> tuple[str, object]:
        """A READY of the current attempt with no claim or PREPARED sent just before."""
        v = self.versions[vid]
        if engine in v.ready:
            return "no_op", None
        if not v.claimed or engine not in v.prepared:
            return "error", "RECEIPT_OUT_OF_ORDER"
        v.ready.add(engine)
        return "ok", None

    def commit(self, vid: int) -> tuple[str, object]:
        v = self.versions.get(vid)
        if v is None:
            return "error", "UNKNOWN_VERSION"
        if v.state in COMPLETED:
            return "no_op", None
        if v.state == "FAILED_FATAL":
            return "error", "PUBLICATION_BLOCKED"
        if v.state != "LOADING":
            return "error", "INVALID_STATE"
        if self.blocked():
            return "error", "PUBLICATION_BLOCKED"
        if v.ready != set(ENGINES):
            return "error", "NOT_READY"
        if self.default is not None:
            self.versions[self.default].state = "RETIRED"
        v.state, self.default = "PUBLISHED", vid
        self.revision += 1
        return "ok", self.revision

    def fail(self, vid: int, clean: bool) -> tuple[str, object]:
        v = self.versions[vid]
        if v.state in ("FAILED_RETRYABLE", "FAILED_FATAL"):
            return "no_op", v.state
        if v.state != "LOADING":
            return "error", "INVALID_STATE"
        v.state = "FAILED_RETRYABLE" if clean else "FAILED_FATAL"
        v.confirmed = set()
        return "ok", v.state

    def observe_absent(self, engine: str) -> None:
        for v in self.versions.values():
            if v.state in ("FAILED_FATAL", "RECLAIMING"):
                v.confirmed.add(engine)
                if v.confirmed >= set(ENGINES):
                    v.state = "FAILED_RETRYABLE" if v.state == "FAILED_FATAL" else "RECLAIMED"
                    v.ambiguous = False

    def bind(self, session: str) -> tuple[str, object]:
        if session in self.bound:
            return "ok", self.bound[session]
        if session in self.closed:
            return "error", "SESSION_CLOSED"
        if self.default is None:
            return "error", "NO_PUBLISHED_VERSION"
        self.bound[session] = self.default
        return "ok", self.default

    def release(self, session: str) -> tuple[str, object]:
        existed = self.bound.pop(session, None) is not None
        self.closed.add(session)
        return "ok", existed

    def forget(self, sessions: list[str]) -> tuple[str, object]:
        if any(s in self.bound for s in sessions):
            return "error", "SESSION_STILL_BOUND"
        gone = {s for s in sessions if s in self.closed}
        self.closed -= gone
        return "ok", len(gone)

    def claim_reclaim(self, vid: int) -> tuple[str, object]:
        v = self.versions.get(vid)
        if v is None:
            return "error", "UNKNOWN_VERSION"
        if v.state != "RETIRED" or self.bound_to(vid):
            return "error", "NOT_RECLAIMABLE"
        v.state, v.confirmed, v.ambiguous = "RECLAIMING", set(), False
        return "ok", None

    def unloaded(self, vid: int, engine: str) -> tuple[str, object]:
        v = self.versions.get(vid)
        if v is None:
            return "error", "UNKNOWN_VERSION"
        if v.state == "RECLAIMED":
            return "ok", True
        if v.state != "RECLAIMING":
            return "error", "INVALID_STATE"
        v.confirmed.add(engine)
        if v.confirmed >= set(ENGINES):
            v.state = "RECLAIMED"
        return "ok", v.state == "RECLAIMED"

    def ambiguous(self, vid: int) -> tuple[str, object]:
        v = self.versions.get(vid)
        if v is None:
            return "error", "UNKNOWN_VERSION"
        if v.state != "RECLAIMING":
            return "error", "INVALID_STATE"
        v.ambiguous = True
        return "ok", None


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.portal_cm = start_blocking_portal("asyncio")
        self.portal = self.portal_cm.__enter__()
        self.store = MemoryStore()
        self.model = Model()
        self.ledger_cm: contextlib.AbstractContextManager[Ledger] | None = None
        self.ledger: Ledger = self._open(snapshot=False)
        self.portal.call(self._bootstrap)

    def _open(self, *, snapshot: bool) -> Ledger:
        cm = self.portal.wrap_async_context_manager(
            Ledger.open(self.store, snapshot_on_close=snapshot)
        )
        self.ledger_cm = cm
        return cm.__enter__()

    async def _bootstrap(self) -> None:
        ledger = self.ledger
        await ledger.create_deployment("dep", prefix="agent", capacity=CAPACITY)
        for engine in ENGINES:
            await ledger.join_engine(engine, f"{engine}-1")
            await ledger.repair_engine(engine, f"{engine}-1")
        await ledger.register_owner("w", ttl_s=1e9)

    def teardown(self) -> None:
        if self.ledger_cm is not None:
            self.ledger_cm.__exit__(None, None, None)
        self.portal_cm.__exit__(None, None, None)

    def call(self, command: c.Command):  # type: ignore[no-untyped-def]
        try:
            return self.portal.call(self.ledger.execute, command)
        except LoraLedgerError as err:
            return err

    def expect_error(self, result: object, code: str) -> None:
        assert isinstance(result, LoraLedgerError), f"expected {code}, got {result!r}"
        assert result.code == code, f"expected {code}, got {result.code}: {result.message}"

    # --- rules ---------------------------------------------------------------------------------

    @rule(vid=VERSIONS, label=DIGESTS, rollback=st.booleans())
    def allocate(self, vid: int, label: str, rollback: bool) -> None:
        kind, detail = self.model.allocate(vid, digest(label), rollback)
        command = c.Allocate(version_id=vid, digest=digest(label), allow_rollback=rollback)
        result = self.call(command)
        if kind == "error":
            self.expect_error(result, str(detail))
        elif kind == "skipped":
            assert type(result).__name__ == "Skipped", result
        else:
            assert type(result).__name__ == "Allocated", result
            assert result.attempt == detail
            assert result.no_op == (kind == "no_op")
            assert result.resumed == (kind == "resumed")

    @precondition(lambda self: self.model.loading() is not None)
    @rule(engine=st.sampled_from(ENGINES), stale=st.booleans())
    def ready(self, engine: str, stale: bool) -> None:
        vid = self.model.loading()
        assert vid is not None
        attempt = self.model.versions[vid].attempt - (1 if stale else 0)
        kind, detail = self.model.ready(vid, attempt, engine)
        v = self.ledger.state.versions[vid]
        receipt = dict(
            version_id=vid,
            attempt=attempt,
            engine=engine,
            incarnation=f"{engine}-1",
            digest=v.digest,
            lora_name=v.lora_name,
        )
        self.call(c.ClaimTransport(version_id=vid, attempt=attempt, owner="t"))
        self.call(c.RecordPrepared(**receipt))  # type: ignore[arg-type]
        result = self.call(c.RecordReady(**receipt))  # type: ignore[arg-type]
        if kind == "error":
            self.expect_error(result, str(detail))
        else:
            assert result.no_op == (kind == "no_op"), result

    @precondition(lambda self: self.model.loading() is not None)
    @rule(engine=st.sampled_from(ENGINES))
    def ready_out_of_order(self, engine: str) -> None:
        vid = self.model.loading()
        assert vid is not None
        kind, detail = self.model.ready_alone(vid, engine)
        v = self.ledger.state.versions[vid]
        result = self.call(
            c.RecordReady(
                version_id=vid,
                attempt=v.attempt,
                engine=engine,
                incarnation=f"{engine}-1",
                digest=v.digest,
                lora_name=v.lora_name,
            )
        )
        if kind == "error":
            self.expect_error(result, str(detail))
        else:
            assert result.no_op == (kind == "no_op"), result

    @precondition(lambda self: self.model.loading() is not None)
    @rule(engine=st.sampled_from(ENGINES))
    def ready_from_an_old_incarnation(self, engine: str) -> None:
        vid = self.model.loading()
        assert vid is not None
        v = self.ledger.state.versions[vid]
        result = self.call(
            c.RecordReady(
                version_id=vid,
                attempt=v.attempt,
                engine=engine,
                incarnation=f"{engine}-0",
                digest=v.digest,
                lora_name=v.lora_name,
            )
        )
        self.expect_error(result, "ENGINE_RESTARTED")

    @rule(vid=VERSIONS)
    def commit(self, vid: int) -> None:
        attempt = self.model.versions[vid].attempt if vid in self.model.versions else 1
        kind, detail = self.model.commit(vid)
        result = self.call(c.Commit(version_id=vid, attempt=attempt))
        if kind == "error":
            self.expect_error(result, str(detail))
        else:
            assert result.no_op == (kind == "no_op"), result
            if kind == "ok":
                assert result.revision == detail

    @precondition(lambda self: any(v.state in ("LOADING", "FAILED_FATAL", "FAILED_RETRYABLE")
                                   for v in self.model.versions.values()))  # fmt: skip
    @rule(data=st.data(), clean=st.booleans())
    def fail(self, data: st.DataObject, clean: bool) -> None:
        candidates = sorted(
            k for k, v in self.model.versions.items()
            if v.state in ("LOADING", "FAILED_FATAL", "FAILED_RETRYABLE")
        )  # fmt: skip
        vid = data.draw(st.sampled_from(candidates))
        attempt = self.model.versions[vid].attempt
        kind, detail = self.model.fail(vid, clean)
        result = self.call(
            c.FailAttempt(
                version_id=vid,
                attempt=attempt,
                clean=clean,
                code="TEST",
                reason="injected",
                absent_on=ENGINES if clean else (),
            )
        )
        if kind == "error":
            self.expect_error(result, str(detail))
        else:
            assert result.state == detail, (result, detail)

    @rule(engine=st.sampled_from(ENGINES))
    def inventory_shows_nothing(self, engine: str) -> None:
        self.model.observe_absent(engine)
        result = self.call(
            c.ObserveInventory(engine=engine, incarnation=f"{engine}-1", adapters=())
        )
        assert not isinstance(result, LoraLedgerError), result

    @rule(session=SESSIONS)
    def bind(self, session: str) -> None:
        kind, detail = self.model.bind(session)
        result = self.call(c.Bind(session=session, owner="w"))
        if kind == "error":
            self.expect_error(result, str(detail))
        else:
            assert result.version_id == detail, (result, detail)

    @rule(session=SESSIONS)
    def release(self, session: str) -> None:
        _, existed = self.model.release(session)
        result = self.call(c.Release(session=session, owner="w"))
        assert result.released == existed, (result, existed)

    @rule(sessions=st.lists(SESSIONS, min_size=1, max_size=3))
    def forget(self, sessions: list[str]) -> None:
        kind, detail = self.model.forget(sessions)
        result = self.call(c.Forget(sessions=tuple(sessions)))
        if kind == "error":
            self.expect_error(result, str(detail))
        else:
            assert result.count == detail, (result, detail)

    @rule(vid=VERSIONS)
    def claim_reclaim(self, vid: int) -> None:
        kind, detail = self.model.claim_reclaim(vid)
        result = self.call(c.ClaimReclaim(version_id=vid))
        if kind == "error":
            self.expect_error(result, str(detail))
        else:
            assert result.version_id == vid

    @rule(vid=VERSIONS, engine=st.sampled_from(ENGINES))
    def unloaded(self, vid: int, engine: str) -> None:
        kind, detail = self.model.unloaded(vid, engine)
        result = self.call(
            c.RecordUnloaded(version_id=vid, engine=engine, incarnation=f"{engine}-1")
        )
        if kind == "error":
            self.expect_error(result, str(detail))
        else:
            assert result.reclaimed == detail, (result, detail)

    @rule(vid=VERSIONS, engine=st.sampled_from(ENGINES))
    def unload_ambiguous(self, vid: int, engine: str) -> None:
        kind, detail = self.model.ambiguous(vid)
        result = self.call(c.MarkReclaimAmbiguous(version_id=vid, engine=engine, reason="t"))
        if kind == "error":
            self.expect_error(result, str(detail))

    # Macro rules: reach deep states (RETIRED with bindings, RECLAIMING) often enough that
    # random walks exercise reclaim and resolution, not only the first steps of publication.

    @rule(vid=VERSIONS, label=DIGESTS)
    def publish(self, vid: int, label: str) -> None:
        self.allocate(vid, label, rollback=True)  # any order of ids, to reach deep states
        if self.model.loading() == vid:
            for engine in ENGINES:
                self.ready(engine, stale=False)
        self.commit(vid)

    @rule(vid=VERSIONS)
    def reclaim(self, vid: int) -> None:
        self.claim_reclaim(vid)
        for engine in ENGINES:
            self.unloaded(vid, engine)

    @rule(snapshot=st.booleans())
    def restart_service(self, snapshot: bool) -> None:
        epoch = self.ledger.state.epoch
        assert self.ledger_cm is not None
        self.ledger_cm.__exit__(None, None, None)
        self.ledger_cm = None
        self.ledger = self._open(snapshot=snapshot)
        assert self.ledger.state.epoch == epoch + 1

    # --- agreement -----------------------------------------------------------------------------

    @invariant()
    def service_agrees_with_model(self) -> None:
        state = self.ledger.state
        invariants.check(state)
        assert state.default == self.model.default
        assert state.default_revision == self.model.revision
        assert {k: v.state for k, v in state.versions.items()} == {
            k: v.state for k, v in self.model.versions.items()
        }
        assert {s: b.version_id for s, b in state.sessions.items()} == self.model.bound
        assert set(state.tombstones) == self.model.closed


def test_ledger_service_agrees_with_an_independent_model(slow: bool) -> None:
    machine = LedgerMachine.TestCase
    machine.settings = settings(
        max_examples=1500 if slow else 150,
        stateful_step_count=60 if slow else 40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    machine().runTest()
