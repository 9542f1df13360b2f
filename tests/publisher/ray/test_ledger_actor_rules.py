"""The ledger actor's own rules, in process: what the Ray face adds to the one ledger service
every transport shares, or forwards to it.

- :class:`LedgerActor` forwards each call with its arguments in order and its documented
  defaults (a registration's 30 s lease, the current life, the 5 s long poll), refuses every
  call ``FENCED`` once another controller took the log over without asking the stopped host,
  says why when asked who it is, closes quietly, and ends its process when the hosted service
  dies on its own, unless it is fenced (Ray would restart it and it would take the log back);
- its replies carry the routing when it changed since the caller's mark and the fleet's
  handles when they changed since the caller's fleet mark (a bare ledger's view says it has
  no fleet);
- a bare ledger expires overdue owners and releases idle client-held sessions on the actor's
  own loop, and goes on after a failed round unless the ledger is closed or fenced;
- a hosted plane's runtime fleet changes (an engine added, replaced, removed) reach the plane,
  are kept in the engine book for a restart, and an unknown engine is refused; a caller's
  report of an engine's trouble reaches the reconciler with its batch;
- a publication from a descriptor pulls the bytes once for the durable copy, rolls back only
  when asked, and an attempt that ended FAILED_FATAL is answered with what it settles as once
  the engines were looked at again;
- ``start_ledger`` pins a SQLite log's actor to its node and leaves a PostgreSQL one free,
  starts it detached, named, restarted without limit and never resent a call, asks again
  while a killed actor still holds the name, and refuses an actor serving another log or
  fenced; ``stop_ledger`` closes, then kills for good.

Why without Ray: the ledger actor's class is a plain class until ``ray.remote`` wraps it, and
its hosted service a plain async context manager (``_serve``), so both run here, on a real
SQLite log (and a real control plane over real local engines); the mutation campaign over the
actor runs these tests once per mutant, and a Ray instance per mutant would cost minutes (a
Ray worker would also import the unmutated module). Doubled are only Ray's parts: the runtime
context an actor reads its name and node from, the engine book's key-value table (Ray's GCS),
what the book asks an engine actor (its name), the object store behind a descriptor's ref,
and Ray's actor calls (``ray.remote(...).options``, ``ray.get``, ``get_actor``, ``kill``);
and, where a test states only that the actor forwards a call, the hosted service's method.
The same actor across Ray: ``test_ledger_actor.py`` and ``test_fleet_runtime.py``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import anyio
import pytest
import ray
from ray.exceptions import GetTimeoutError, RayActorError

from engines.contract import AmbiguousReply, CleanRefusal
from engines.local.engine import LocalEngine
from evlog.errors import LoraLedgerError
from evlog.events import EngineUnreachable
from evlog.sqlite import SQLiteStore
from evlog.stores import describe
from projections.transitions import VersionState
from publisher.core import commands as c
from publisher.core import ledger as ledger_module
from publisher.core.errors import Code, LedgerError
from publisher.core.ledger import Ledger
from publisher.core.outcomes import Allocated, Bound, Done, Outcome
from publisher.drivers.publication import PUBLICATION_FAILED, ErrorKind, PublicationError
from publisher.drivers.reconciler import ReconcileReport
from publisher.ray import ledger_actor
from publisher.ray.adapter_objects import AdapterDescriptor
from publisher.ray.engine_book import BookEntry
from publisher.ray.ledger_actor import (
    FleetView,
    LedgerActor,
    LedgerConfig,
    LedgerInfo,
    PlaneConfig,
    _expire_leases,
    _serve,
    _Service,
    start_ledger,
    stop_ledger,
)
from publisher.ray.stored_adapter import PullStats
from publisher.remote.service import TroubleBatch
from tests.engines.faulty_engine import ServerError
from tests.publisher.gateway.test_provenance import row as provenance_row
from tests.publisher.plane_kit import (
    FAST,
    LIMITS,
    PEFT_WARNINGS,
    adapter_copy,
    faulty_engines,
    local_engines,
)
from tests.publisher.ray.kit import create
from tests.publisher.ray.test_engine_book_rules import NAMESPACE, GcsKeyValueDouble
from tests.support.ledger import digest, publish
from tests.support.waiting import wait_for

pytestmark = pytest.mark.anyio

SECRET = "s" * 64
NODE = "ab" * 28  # a node id as Ray writes one (28 bytes, in hex)


class RuntimeContextDouble:
    """Test double of ``ray.get_runtime_context()`` inside an actor: its name (None for an
    unnamed actor), namespace and node, as Ray's runtime context answers them."""

    def __init__(self, name: str | None = None, namespace: str = "fleet") -> None:
        self._name, self.namespace = name, namespace

    def get_actor_name(self) -> str | None:
        return self._name

    def get_node_id(self) -> str:
        return NODE


@pytest.fixture
def unnamed_actor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray, "get_runtime_context", lambda: RuntimeContextDouble())


@pytest.fixture
async def actor(tmp_path: Path, unnamed_actor: None) -> AsyncIterator[LedgerActor]:
    """A bare ledger actor, its class called as Ray would call it, on a fresh SQLite file, with
    a deployment over two engines (:func:`tests.publisher.ray.kit.create`)."""
    config = LedgerConfig(path=str(tmp_path / "ledger.db"), lease_check_s=0.02)
    made = await anyio.to_thread.run_sync(LedgerActor, config)
    try:
        await create(ThroughTheActor(made))
        yield made
    finally:
        await made.close()


class ThroughTheActor:
    """What :func:`tests.support.ledger.publish` needs of a ledger, through the actor's batch
    call: the outcome, or its refusal raised."""

    def __init__(self, actor: LedgerActor) -> None:
        self.actor = actor

    async def execute(self, command: c.Command) -> Outcome:
        (result,) = (await self.actor.execute_many([command])).results
        if isinstance(result, LoraLedgerError):
            raise result
        return result


def owner(actor: LedgerActor, name: str) -> Any:
    return actor._service.ledger.state.owners[name]


# --- owners: registration, deregistration, renewal -------------------------------------------


async def test_a_registration_is_forwarded_whole_and_with_its_defaults(actor: LedgerActor) -> None:
    """``ttl_s``, ``incarnation``, ``sessions_idle_s`` and ``secret`` reach the ledger in their
    places; left out, a life is an owner-held one of 30 s, unnamed."""
    assert await actor.register_owner("w1", secret=SECRET) == Done()
    w1 = owner(actor, "w1")
    assert (w1.ttl_s, w1.incarnation, w1.sessions_idle_s) == (30.0, "", None)
    assert w1.secret_digest
    assert await actor.register_owner("relay", 5.0, "r-1", 60.0, SECRET) == Done()
    relay = owner(actor, "relay")
    assert (relay.ttl_s, relay.incarnation, relay.sessions_idle_s) == (5.0, "r-1", 60.0)
    with pytest.raises(LoraLedgerError) as without_secret:
        await actor.register_owner("w2")  # a life needs its secret
    assert without_secret.value.code == Code.OWNER_SECRET_MISMATCH
    assert "must carry the secret" in without_secret.value.message


async def test_a_deregistration_names_the_life_and_proves_it(actor: LedgerActor) -> None:
    await actor.register_owner("w1", 30.0, "one", None, SECRET)
    await actor.register_owner("w2", 30.0, "", None, SECRET)
    with pytest.raises(LoraLedgerError) as unproven:
        await actor.deregister_owner("w1", "one")  # no secret by default
    assert unproven.value.code == Code.OWNER_SECRET_MISMATCH
    assert "must carry the secret" in unproven.value.message  # none sent, not a wrong one
    gone = await actor.deregister_owner("w1", "one", SECRET)
    assert (gone.owner, gone.no_op) == ("w1", False)
    assert owner(actor, "w1").exited
    current = await actor.deregister_owner("w2", secret=SECRET)  # "": the current life
    assert (current.owner, current.no_op) == ("w2", False)
    assert owner(actor, "w2").exited


async def test_a_renewal_carries_counts_sessions_and_secrets_of_each_life(
    actor: LedgerActor,
) -> None:
    """Each life's in-flight counts reach the lease book, a relay's sessions their last turn,
    and a life renewed without its secret comes back lost, by name."""
    await publish(ThroughTheActor(actor), 1)
    await actor.register_owner("relay", 30.0, "r", 60.0, SECRET)
    await actor.register_owner("w1", 30.0, "one", None, SECRET)
    bound = await actor.execute_many([c.Bind(session="s1", owner="relay", secret=SECRET)])
    assert isinstance(bound.results[0], Bound)
    ledger = actor._service.ledger
    ledger.activity.drop("s1")  # no turn known: only the renewal below reports one

    reply = await actor.renew_leases(
        {("relay", "r"): {}, ("w1", "one"): {("e0", 1): 2}},
        None,
        None,
        {("relay", "r"): ("s1",)},
        {("relay", "r"): SECRET, ("w1", "one"): SECRET},
    )
    assert reply.lost == {}
    counted = {(x.reporter, x.engine): x.count for x in ledger.inflight_evidence(1)}
    assert counted[("w1", "e0")] == 2
    assert ledger.activity.last_turn("s1") is not None

    unproven = await actor.renew_leases({("w1", "one"): {}})  # no secrets by default
    assert list(unproven.lost) == [("w1", "one")]
    assert unproven.lost[("w1", "one")].code == Code.OWNER_SECRET_MISMATCH


# --- replies: routing and the fleet view ------------------------------------------------------


async def test_replies_carry_routing_since_the_mark_and_a_bare_ledgers_view(
    actor: LedgerActor,
) -> None:
    """The routing comes when it is not the caller's (``mark``); the handles when the caller
    mirrors a fleet other than this one (``fleet_mark``), never when it mirrors none. A bare
    ledger's view has no engines and says it has no plane."""
    await actor.register_owner("w1", 30.0, "one", None, SECRET)
    table = await actor.routing()
    epoch = actor._service.ledger.epoch
    assert table.epoch == epoch
    bare = FleetView(epoch=epoch, version=0, engines=(), plane=False)

    first = await actor.execute_many([c.Forget(sessions=("nobody",))])
    assert first.routing == table and first.fleet is None
    same = await actor.execute_many([c.Forget(sessions=("nobody",))], table.mark, (epoch, 0))
    assert same.routing is None and same.fleet is None
    other = await actor.execute_many([c.Forget(sessions=("nobody",))], table.mark, (epoch, 9))
    assert other.fleet == bare and other.routing is None

    renewed = await actor.renew_leases({("w1", "one"): {}}, None, (epoch - 1, 0), None, None)
    assert renewed.routing == table and renewed.fleet == bare
    quiet = await actor.renew_leases(
        {("w1", "one"): {}}, table.mark, (epoch, 0), None, {("w1", "one"): SECRET}
    )
    assert (quiet.lost, quiet.routing, quiet.fleet) == ({}, None, None)

    assert await actor.fleet_view() == bare


async def test_the_long_poll_answers_a_newer_table_at_once_and_nothing_after_its_wait(
    actor: LedgerActor,
) -> None:
    table = await actor.routing()
    epoch = actor._service.ledger.epoch
    newer = await actor.wait_routing((epoch - 1, 0), (epoch, 5), 60.0)
    assert newer.results == [] and newer.routing == table
    assert newer.fleet == FleetView(epoch=epoch, version=0, engines=(), plane=False)
    mirrored = await actor.wait_routing((epoch - 1, 0), (epoch, 0), 60.0)
    assert mirrored.routing == table and mirrored.fleet is None
    with anyio.fail_after(30):
        nothing = await actor.wait_routing(table.mark, (epoch, 5), 0.01)
    assert (nothing.results, nothing.routing, nothing.fleet) == ([], None, None)


async def test_status_provenance_and_pull_stats_are_the_services(
    actor: LedgerActor, tmp_path: Path
) -> None:
    await actor.register_owner("w1", 30.0, "one", None, SECRET)
    assert (await actor.status()).owners == 1
    row = provenance_row("s1", 1)
    assert await actor.store_provenance([row]) == 1
    assert await actor.store_provenance([row]) == 0  # a resend stores nothing twice
    stats = await actor.pull_stats()
    assert stats == PullStats()
    assert stats is not actor._service.pulls  # a copy, not the counters the actor updates


async def test_describe_says_where_and_who_the_actor_is(actor: LedgerActor) -> None:
    info = await actor.describe()
    state = actor._service.ledger.state
    assert info.path == describe(actor._service.config.path)
    assert (info.node_id, info.pid) == (NODE, os.getpid())
    assert (info.epoch, info.last_seq) == (state.epoch, state.last_seq)
    assert (info.plane, info.bucket_bytes, info.fenced) == (False, None, "")


async def test_a_bare_ledger_refuses_what_needs_a_plane(actor: LedgerActor) -> None:
    for call, args, what in (
        (actor.add_engine, (object(),), "cannot add an engine"),
        (actor.replace_engine, (object(),), "cannot replace an engine"),
        (actor.remove_engine, ("e0",), "cannot remove an engine"),
        (actor.publish, (object(), 1), "nothing publishes"),
    ):
        with pytest.raises(LoraLedgerError) as refused:
            await call(*args)
        assert refused.value.code == Code.INVALID_STATE, call
        assert refused.value.message.endswith(f"hosts no control plane: {what}")
    # a bare ledger hears no engine trouble: nothing to hand it to, nothing raised
    await actor.engine_failed("e0", CleanRefusal("ENGINE_BUSY", "busy"))


# --- fencing and death --------------------------------------------------------------------------


async def test_a_fenced_actor_refuses_every_call_and_says_why_without_exiting(
    actor: LedgerActor, monkeypatch: pytest.MonkeyPatch
) -> None:
    exits: list[str] = []
    monkeypatch.setattr(ledger_actor, "exit_process", exits.append)
    await actor.register_owner("w1", 30.0, "one", None, SECRET)
    epoch = actor._service.ledger.epoch
    path = actor._service.config.path
    async with SQLiteStore.open(path) as store, Ledger.open(store) as rival:
        await wait_for("the actor to be fenced", lambda: actor._fenced() is not None, timeout=30)
        await wait_for("its hosted service to stop", lambda: actor._host._stopped, timeout=30)
        rival_epoch = rival.epoch
    for name, args in (
        ("execute_many", ([c.Forget(sessions=("s",))],)),
        ("register_owner", ("w2", 30.0, "two", None, SECRET)),
        ("deregister_owner", ("w1", "one", SECRET)),
        ("renew_leases", ({("w1", "one"): {}},)),
        ("routing", ()),
        ("wait_routing", ()),
        ("status", ()),
        ("fleet_view", ()),
        ("pull_stats", ()),
    ):
        with pytest.raises(LoraLedgerError) as refused:
            await getattr(actor, name)(*args)
        assert refused.value.code == Code.FENCED, name
    info = await actor.describe()
    assert "another controller" in info.fenced
    assert info.epoch == epoch != rival_epoch  # its own life's epoch, not the rival's
    actor._on_dead("the hosted ledger stopped")
    assert exits == []  # fenced: the process stays, so Ray does not restart it
    await actor.close()  # the hosted service already stopped: closing says nothing more


async def test_a_hosted_service_that_dies_unfenced_ends_the_process(
    actor: LedgerActor, monkeypatch: pytest.MonkeyPatch
) -> None:
    exits: list[str] = []
    monkeypatch.setattr(ledger_actor, "exit_process", exits.append)
    actor._on_dead("the writer broke")
    assert exits == ["the writer broke"]


# --- the bare ledger's lease expiry ------------------------------------------------------------


async def test_a_bare_ledger_expires_owners_and_releases_idle_sessions_on_its_loop(
    actor: LedgerActor,
) -> None:
    await publish(ThroughTheActor(actor), 1)
    await actor.register_owner("relay", 600.0, "r", 0.05, SECRET)
    bound = await actor.execute_many([c.Bind(session="s1", owner="relay", secret=SECRET)])
    assert isinstance(bound.results[0], Bound)
    await actor.renew_leases(
        {("relay", "r"): {}}, None, None, {("relay", "r"): ("s1",)}, {("relay", "r"): SECRET}
    )
    await actor.register_owner("w1", 0.05, "one", None, SECRET)
    ledger = actor._service.ledger
    await wait_for("w1's lease to expire", lambda: owner(actor, "w1").expired, timeout=30)
    await wait_for("s1 to be released", lambda: "s1" not in ledger.state.sessions, timeout=30)


class ExpiryLedgerDouble:
    """Test double of a ledger whose expiry rounds fail as told (a real ledger's rounds cannot
    be made to fail with a chosen code): counts the rounds, fails the listed ones."""

    def __init__(self, *failures: LoraLedgerError | None) -> None:
        self.failures = list(failures)
        self.rounds = 0
        self.releases = 0

    async def expire_leases(self) -> list[Any]:
        self.rounds += 1
        failure = self.failures.pop(0) if self.failures else None
        if failure is not None:
            raise failure
        return []

    async def release_idle_sessions(self) -> int:
        self.releases += 1
        return 0


async def test_a_failed_expiry_round_is_logged_and_the_next_one_runs() -> None:
    ledger = ExpiryLedgerDouble(LedgerError(Code.INVALID_INPUT, "a refusal"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(_expire_leases, cast(Ledger, ledger), 0.001)
        await wait_for("three rounds", lambda: ledger.rounds >= 3 and ledger.releases >= 2)
        tg.cancel_scope.cancel()


@pytest.mark.parametrize("code", [Code.LEDGER_CLOSED, Code.FENCED])
async def test_expiry_stops_when_the_ledger_is_closed_or_fenced(code: str) -> None:
    ledger = ExpiryLedgerDouble(None, LedgerError(code, "stopped"))
    with anyio.fail_after(30), pytest.raises(LoraLedgerError) as stopped:
        await _expire_leases(cast(Ledger, ledger), 0.001)
    assert stopped.value.code == code
    assert (ledger.rounds, ledger.releases) == (2, 1)


# --- a hosted plane: the fleet view and runtime fleet changes ------------------------------------


class EntryDouble:
    """Test double of ``entry_for``, which asks an engine's Ray actor for its name: every
    engine's actor is named ``actor-<id>`` in namespace ``fleet`` but the ``unnamed`` ones."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.unnamed = {"e3"}

    def __call__(self, engine: Any) -> BookEntry | None:
        self.asked.append(engine.engine_id)
        if engine.engine_id in self.unnamed:
            return None
        return BookEntry(
            actor_name=f"actor-{engine.engine_id}",
            actor_namespace="fleet",
            kind=engine.kind,
            transport=engine.transport,
        )


@pytest.fixture
def entries() -> EntryDouble:
    return EntryDouble()


@pytest.fixture
def gcs(monkeypatch: pytest.MonkeyPatch, entries: EntryDouble) -> GcsKeyValueDouble:
    from ray.experimental import internal_kv

    table = GcsKeyValueDouble()
    monkeypatch.setattr(internal_kv, "global_gcs_client", table)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: RuntimeContextDouble("ledger"))
    monkeypatch.setattr(ledger_actor, "entry_for", entries)
    return table


@asynccontextmanager
async def hosted_plane(tmp_path: Path, engines: list[Any]) -> AsyncIterator[_Service]:
    config = LedgerConfig(
        path=str(tmp_path / "ledger.db"),
        plane=PlaneConfig(
            deployment="dep",
            prefix="agent",
            capacity=2,
            artifact_root=str(tmp_path / "artifacts"),
            engines=tuple(engines),
            options={"probe_interval_s": 0.05, "reclaim_tick_s": 0.05, "timeouts": FAST},
        ),
    )
    async with _serve(config) as service:
        yield service


def book_of(gcs: GcsKeyValueDouble) -> dict[str, Any]:
    return dict(gcs.book("engine-book/fleet/ledger/dep"))


async def test_a_plane_s_view_and_its_runtime_changes_reach_plane_and_book(
    tmp_path: Path, gcs: GcsKeyValueDouble, entries: EntryDouble
) -> None:
    async with (
        local_engines(4) as made,
        hosted_plane(tmp_path, made[:2]) as service,
    ):
        plane = service.plane
        assert plane is not None
        e0, e1, e2, unnamed = cast(list[Any], made)
        view = service._view()
        assert view == FleetView(
            epoch=service.ledger.epoch,
            version=plane.fleet.version,
            engines=(e0, e1),
            plane=True,
        )
        assert service.fleet_for(None) is None
        assert service.fleet_for(view.mark) is None
        assert service.fleet_for((view.epoch, view.version + 1)) == view
        assert (await service.info()).bucket_bytes == plane.bucket_bytes

        await service.add_engine(e2)
        assert "e2" in plane.fleet and "e2" in service.ledger.state.engines
        assert book_of(gcs)["e2"] == BookEntry(
            actor_name="actor-e2", actor_namespace="fleet", kind=e2.kind, transport=e2.transport
        )
        assert service.fleet_version == plane.fleet.version > view.version
        table = await service.routing_table()  # its fleet mark names the fleet it routes over
        assert table.fleet_mark == (service.ledger.epoch, plane.fleet.version)
        assert isinstance(await service.replace_engine(e2), ReconcileReport)
        await service.add_engine(unnamed)  # an unnamed actor: no entry
        assert "e3" not in book_of(gcs)
        entries.unnamed.add("e2")  # e2's new actor has no name: its old entry is forgotten
        await service.replace_engine(e2)
        assert "e2" not in book_of(gcs) and "e2" in plane.fleet

        with pytest.raises(LoraLedgerError) as unknown:
            await service.replace_engine(cast(Any, type("E", (), {"engine_id": "e9"})()))
        assert unknown.value.code == Code.UNKNOWN_ENGINE
        assert unknown.value.message == "engine 'e9' is not in the fleet: add it instead"
        with pytest.raises(LoraLedgerError) as unknown_removed:
            await service.remove_engine("e9", "operator")
        assert unknown_removed.value.code == Code.UNKNOWN_ENGINE
        assert unknown_removed.value.message == "engine 'e9' is not in the fleet"

        assert await service.remove_engine("e1", "operator") == 0
        assert "e1" not in plane.fleet
        assert book_of(gcs)["e1"] is None  # a tombstone: a restart does not join it again
        left = [r.event for r in await service.ledger.store.read()]
        assert any(
            type(x).__name__ == "EngineLeft" and getattr(x, "cause", "") == "operator" for x in left
        )

        # a generation's failure on a fleet member reaches the reconciler, with its batch
        refused = AmbiguousReply("ENGINE_UNREACHABLE", "connection refused", dispatched=False)
        await service.engine_failed("e9", refused, TroubleBatch(reporter="gw-7"))  # not ours
        await service.engine_failed("e0", refused, TroubleBatch(reporter="gw-7"))

        async def outage_recorded() -> bool:
            return any(
                isinstance(r.event, EngineUnreachable)
                and (r.event.engine, r.event.reporter) == ("e0", "gw-7")
                for r in await service.ledger.store.read()
            )

        await wait_for("e0's outage, as gw-7 reported it", outage_recorded, timeout=30)


async def test_an_engine_down_when_the_plane_opened_is_the_fleets_to_replace_or_remove(
    tmp_path: Path, gcs: GcsKeyValueDouble
) -> None:
    """A configured engine that was down at start is in the fleet but not in the ledger (never
    joined): it is known, so its new process replaces it and an operator may remove it."""
    down = [LocalEngine(f"e{i}", limits=LIMITS) for i in (1, 2)]  # never started
    async with (
        local_engines(2) as (e0, e1),
        hosted_plane(tmp_path, [e0, *down]) as service,
    ):
        assert service.plane is not None
        assert "e1" in service.plane.fleet and "e1" not in service.ledger.state.engines
        assert isinstance(await service.replace_engine(cast(Any, e1)), ReconcileReport)
        assert service.plane.fleet["e1"] is e1 and "e1" in service.ledger.state.engines
        assert "e2" not in service.ledger.state.engines
        assert await service.remove_engine("e2", "operator") == 0
        assert "e2" not in service.plane.fleet


async def test_a_restarted_plane_opens_without_the_engines_removed_at_runtime(
    tmp_path: Path, gcs: GcsKeyValueDouble
) -> None:
    gcs.table[(NAMESPACE, b"engine-book/fleet/ledger/dep")] = b'{"e1": null}'
    async with local_engines(2) as (e0, e1), hosted_plane(tmp_path, [e0, e1]) as service:
        assert service.plane is not None
        assert [e.engine_id for e in service.plane.fleet] == ["e0"]


class ServiceSpy:
    """Test double of the hosted service's methods the actor forwards to (whose real bodies
    need a plane, an object store or time): records each call's arguments."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def method(self, name: str, answer: Any = None) -> Any:
        async def record(*args: Any) -> Any:
            self.calls.append((name, args))
            return answer

        return record


async def test_the_actor_forwards_each_call_in_order_with_its_defaults(
    actor: LedgerActor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Positional forwarding: a swapped or dropped argument reaches the service as another
    one. Defaults: a removal is an operator's, a publication no rollback, a report without a
    batch, a long poll of 5 s."""
    spy = ServiceSpy()
    for name in (
        "publish",
        "add_engine",
        "replace_engine",
        "remove_engine",
        "engine_failed",
        "wait_routing",
    ):
        monkeypatch.setattr(actor._service, name, spy.method(name))
    descriptor, engine, error, batch = object(), object(), object(), object()
    await actor.publish(descriptor, 7)  # type: ignore[arg-type]
    await actor.publish(descriptor, 8, True)  # type: ignore[arg-type]
    await actor.add_engine(engine)  # type: ignore[arg-type]
    await actor.replace_engine(engine)  # type: ignore[arg-type]
    await actor.remove_engine("e1")
    await actor.remove_engine("e1", "fleet")
    await actor.engine_failed("e0", error)  # type: ignore[arg-type]
    await actor.engine_failed("e0", error, batch)  # type: ignore[arg-type]
    await actor.wait_routing()
    await actor.wait_routing((1, 2), (1, 3), 0.5)
    assert spy.calls == [
        ("publish", (descriptor, 7, False)),
        ("publish", (descriptor, 8, True)),
        ("add_engine", (engine,)),
        ("replace_engine", (engine,)),
        ("remove_engine", ("e1", "operator")),
        ("remove_engine", ("e1", "fleet")),
        ("engine_failed", ("e0", error, None)),
        ("engine_failed", ("e0", error, batch)),
        ("wait_routing", (None, None, 5.0)),
        ("wait_routing", ((1, 2), (1, 3), 0.5)),
    ]


async def test_a_hosted_ledger_that_stops_on_its_own_ends_the_process(
    tmp_path: Path, unnamed_actor: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Crash-only: a hosted service that died unfenced (here its expiry loop stopped on a
    closed ledger, as on a writer that broke) ends the process at the next call, so Ray
    restarts the actor from the log, and the caller hears LEDGER_CLOSED."""
    exits: list[str] = []
    monkeypatch.setattr(ledger_actor, "exit_process", exits.append)
    hard_exits: list[int] = []  # any other way out would end the test process itself
    monkeypatch.setattr(os, "_exit", hard_exits.append)
    config = LedgerConfig(path=str(tmp_path / "ledger.db"), lease_check_s=0.01)
    made = await anyio.to_thread.run_sync(LedgerActor, config)
    try:

        async def closed() -> list[Any]:
            raise LedgerError(Code.LEDGER_CLOSED, "the writer stopped")

        monkeypatch.setattr(made._service.ledger, "expire_leases", closed)
        await wait_for("the hosted service to stop", lambda: made._host._stopped, timeout=30)
        with pytest.raises(LoraLedgerError) as dead:
            await made.status()
        assert dead.value.code == Code.LEDGER_CLOSED
        assert exits == ["the ledger stopped: its context exited on its own"]
        assert hard_exits == []
    finally:
        with contextlib.suppress(Exception):
            await made.close()


async def test_a_fenced_actor_reports_its_own_epoch_when_its_state_shows_the_rivals(
    tmp_path: Path, unnamed_actor: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fenced by a failed append, the ledger rebuilds its state from the log, whose epoch is
    the rival's: ``describe`` still names this actor's own epoch (the life that was fenced)."""
    monkeypatch.setattr(ledger_module, "WATCH_EVERY_S", 3600.0)  # fenced by the append only
    config = LedgerConfig(path=str(tmp_path / "ledger.db"), lease_check_s=3600.0)
    made = await anyio.to_thread.run_sync(LedgerActor, config)
    try:
        epoch = made._service.ledger.epoch
        async with SQLiteStore.open(config.path) as store, Ledger.open(store) as rival:
            rival_epoch = rival.epoch
            with contextlib.suppress(LoraLedgerError):
                await made.execute_many(
                    [c.CreateDeployment(deployment="d", prefix="p", capacity=1)]
                )
        await wait_for("the actor to be fenced", lambda: made._fenced() is not None, timeout=30)
        assert made._service.ledger.state.epoch == rival_epoch != epoch
        info = await made.describe()
        assert (info.epoch, bool(info.fenced)) == (epoch, True)
    finally:
        await made.close()


# --- a hosted plane's publications --------------------------------------------------------------


class ObjectRefDouble(ray.ObjectRef):  # type: ignore[misc]  # Ray's ref is untyped
    """Test double of a ref into Ray's object store, holding its object: awaited (an engine's
    pull) or passed to ``ray.get`` (the ledger's durable copy, :func:`object_store`), it
    answers the object, as the store would."""

    value: Any

    def __await__(self) -> Any:
        async def pulled() -> Any:
            return self.value

        return pulled().__await__()


@pytest.fixture
def object_store(monkeypatch: pytest.MonkeyPatch) -> None:
    real_get = ray.get

    def get(ref: Any, *, timeout: float | None = None) -> Any:
        if isinstance(ref, ObjectRefDouble):
            return ref.value
        return real_get(ref, timeout=timeout)

    monkeypatch.setattr(ray, "get", get)


def descriptor_of(seed: int) -> AdapterDescriptor:
    """What ``put_adapter`` makes of a trainer's adapter, its tensors in the store double."""
    copy = adapter_copy(seed)
    ref = ObjectRefDouble(os.urandom(28))
    ref.value = dict(copy.tensors)
    return AdapterDescriptor(manifest=copy.manifest, ref=ref)


@PEFT_WARNINGS
async def test_a_publication_pulls_once_and_rolls_back_only_when_asked(
    tmp_path: Path, gcs: GcsKeyValueDouble, object_store: None
) -> None:
    """The descriptor's adapter is published under its step; the ledger pulls its bytes once
    (the durable copy) and counts the descriptor; a step below the default is refused unless
    ``allow_rollback``."""
    async with local_engines(2) as engines, hosted_plane(tmp_path, engines) as service:
        three, two = descriptor_of(3), descriptor_of(2)
        published = await service.publish(three, 3)
        assert (published.status, published.version_id, published.digest) == (
            "PUBLISHED",
            3,
            three.digest,
        )
        assert service.pulls == PullStats(descriptors=1, pulled_bytes=three.size_bytes)
        with pytest.raises(LoraLedgerError) as regression:
            await service.publish(two, 2)
        assert regression.value.code == Code.VERSION_REGRESSION
        assert service.ledger.state.default == 3
        rolled_back = await service.publish(two, 2, True)
        assert (rolled_back.status, rolled_back.version_id) == ("PUBLISHED", 2)
        assert service.ledger.state.default == 2
        assert service.pulls.descriptors == 3


def fatal(version_id: Any, attempt: Any, **details: Any) -> PublicationError:
    """The driver's error for an attempt that ended FAILED_FATAL (an ambiguous reply)."""
    return PublicationError(
        PUBLICATION_FAILED,
        "an engine's reply was lost",
        kind=ErrorKind.FATAL,
        **{"state": "FAILED_FATAL", "version_id": version_id, "attempt": attempt, **details},
    )


async def test_a_fatal_attempt_is_answered_with_what_it_settles_as(
    tmp_path: Path, gcs: GcsKeyValueDouble
) -> None:
    """An attempt that ended FAILED_FATAL while every engine of it holds nothing: once one
    health check looked at the engines again it is FAILED_RETRYABLE, and the trainer is told
    so (RETRYABLE, its state, every other detail kept). Any other failure is answered as it
    came, and so is one whose version or attempt the ledger does not hold."""
    async with local_engines(2) as engines, hosted_plane(tmp_path, engines) as service:
        plane, ledger = service.plane, service.ledger
        assert plane is not None
        allocated = await ledger.execute(c.Allocate(version_id=1, digest=digest(1)))
        assert isinstance(allocated, Allocated)
        await ledger.fail_attempt(
            1, allocated.attempt, clean=False, code="AMBIGUOUS_REPLY", reason="lost reply"
        )
        assert ledger.state.versions[1].state == VersionState.FAILED_FATAL

        for unsettled in (
            PublicationError(PUBLICATION_FAILED, "x", kind=ErrorKind.RETRYABLE),
            fatal(1, allocated.attempt, state="FAILED_RETRYABLE"),
        ):
            assert await service._settled(plane, unsettled) is unsettled
        assert ledger.state.versions[1].state == VersionState.FAILED_FATAL  # nothing checked

        for unknown in (
            fatal(9, 1),
            fatal("1", allocated.attempt),
            fatal(1, allocated.attempt + 1),
        ):
            assert await service._settled(plane, unknown) is unknown

        failed = fatal(1, allocated.attempt, cause="AMBIGUOUS_REPLY")
        settled = await service._settled(plane, failed)
        assert ledger.state.versions[1].state == VersionState.FAILED_RETRYABLE
        assert (settled.code, settled.kind) == (PUBLICATION_FAILED, ErrorKind.RETRYABLE)
        assert settled.message.startswith("an engine's reply was lost; the engines were")
        assert settled.message.endswith(f"it is {VersionState.FAILED_RETRYABLE}")
        assert settled.details == {
            **failed.details,
            "kind": ErrorKind.RETRYABLE,
            "state": "FAILED_RETRYABLE",
        }


@PEFT_WARNINGS
async def test_a_failed_publication_is_answered_with_the_ledgers_word(
    tmp_path: Path, gcs: GcsKeyValueDouble, object_store: None
) -> None:
    """An engine's ambiguous answer (a 503 to a load it never saw) ends the attempt
    FAILED_FATAL; the trainer is told what it settles as once the engines were looked at again
    (every one proves it absent: RETRYABLE), not the word of the moment it ended."""
    async with faulty_engines(2) as engines, hosted_plane(tmp_path, engines) as service:
        engines[0].inject("load", ServerError(), times=10)
        with pytest.raises(PublicationError) as failed:
            await service.publish(descriptor_of(1), 1)
        assert failed.value.kind == ErrorKind.RETRYABLE
        assert failed.value.details["state"] == str(VersionState.FAILED_RETRYABLE)
        assert service.ledger.state.versions[1].state == VersionState.FAILED_RETRYABLE
        assert "the attempt is FAILED_FATAL; the engines were checked again" in str(failed.value)


# --- starting and stopping the actor ------------------------------------------------------------


class RemoteCallDouble:
    """Test double of an actor method: ``remote()`` answers what ``ray.get`` resolves."""

    def __init__(self, handle: LedgerHandleDouble, method: str) -> None:
        self.handle, self.method = handle, method

    def remote(self) -> tuple[LedgerHandleDouble, str]:
        return (self.handle, self.method)


class LedgerHandleDouble:
    """Test double of a ledger actor's handle: its ``describe`` and ``close`` methods."""

    def __init__(self, config: LedgerConfig) -> None:
        self.config = config
        self.describe = RemoteCallDouble(self, "describe")
        self.close = RemoteCallDouble(self, "close")


class RayActorsDouble:
    """Test double of Ray's actor calls as ``start_ledger`` and ``stop_ledger`` make them:
    ``ray.remote(cls).options(...).remote(config)`` creates (or finds) the named actor,
    ``ray.get`` resolves a ``describe`` (the answers scripted in ``answers``, then the info
    of an actor serving the config's log) or a ``close`` (``close_error`` raised, if any),
    ``ray.get_actor`` finds a named actor (ValueError when none), ``ray.kill`` records."""

    def __init__(self) -> None:
        self.options: list[dict[str, Any]] = []
        self.configs: list[LedgerConfig] = []
        self.answers: list[LedgerInfo | Exception] = []
        self.timeouts: list[float | None] = []
        self.named: dict[tuple[str, str], LedgerHandleDouble] = {}
        self.close_error: Exception | None = None
        self.closed: list[LedgerHandleDouble] = []
        self.killed: list[tuple[LedgerHandleDouble, bool]] = []

    def create(self, config: LedgerConfig) -> LedgerHandleDouble:
        self.configs.append(config)
        return LedgerHandleDouble(config)

    def get(self, call: tuple[LedgerHandleDouble, str], *, timeout: float | None = None) -> Any:
        self.timeouts.append(timeout)
        handle, method = call
        if method == "describe":
            answer = self.answers.pop(0) if self.answers else None
            if isinstance(answer, Exception):
                raise answer
            return answer or info_of(handle.config)
        self.closed.append(handle)
        if self.close_error is not None:
            raise self.close_error
        return None

    def get_actor(self, name: str, namespace: str | None = None) -> LedgerHandleDouble:
        try:
            return self.named[(name, namespace or "")]
        except KeyError:
            raise ValueError(f"Failed to look up actor with name '{name}'") from None

    def kill(self, handle: LedgerHandleDouble, *, no_restart: bool = True) -> None:
        self.killed.append((handle, no_restart))


def info_of(config: LedgerConfig, **changed: Any) -> LedgerInfo:
    fields: dict[str, Any] = {
        "path": describe(config.path),
        "node_id": NODE,
        "pid": 1234,
        "epoch": 2,
        "last_seq": 7,
        "plane": False,
        "bucket_bytes": None,
    }
    return LedgerInfo(**{**fields, **changed})


@pytest.fixture
def actors(monkeypatch: pytest.MonkeyPatch) -> RayActorsDouble:
    double = RayActorsDouble()

    class ActorClass:
        """``ray.remote(LedgerActor)``: ``options(...)``, then ``remote(config)``."""

        def options(self, **options: Any) -> ActorClass:
            double.options.append(options)
            return self

        def remote(self, config: LedgerConfig) -> LedgerHandleDouble:
            return double.create(config)

    def remote(cls: type) -> ActorClass:
        assert cls is LedgerActor
        return ActorClass()

    monkeypatch.setattr(ray, "remote", remote)
    monkeypatch.setattr(ray, "get", double.get)
    monkeypatch.setattr(ray, "get_actor", double.get_actor)
    monkeypatch.setattr(ray, "kill", double.kill)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: RuntimeContextDouble())
    return double


def placement(options: dict[str, Any]) -> Any:
    strategy = options["scheduling_strategy"]
    if isinstance(strategy, str):
        return strategy
    return (type(strategy).__name__, strategy.node_id, strategy.soft)


def test_a_sqlite_ledger_is_pinned_to_its_node_and_started_detached_and_named(
    actors: RayActorsDouble, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SQLite log lives on one node's disk: the actor is pinned there (hard affinity, this
    node by default), serves the file's absolute path, lives detached under its name, is
    restarted by Ray without limit, and never has a call resent by Ray (callers retry)."""
    monkeypatch.chdir(tmp_path)
    handle = start_ledger(LedgerConfig(path="ledger.db"), timeout=12.0)
    (options,) = actors.options
    assert options == {
        "name": "ledger",
        "namespace": "loraledger",
        "lifetime": "detached",
        "get_if_exists": True,
        "max_restarts": -1,
        "max_task_retries": 0,
        "max_concurrency": 1000,
        "num_cpus": 0,
        "resources": {},
        "scheduling_strategy": options["scheduling_strategy"],
    }
    assert placement(options) == ("NodeAffinitySchedulingStrategy", NODE, False)
    assert [config.path for config in actors.configs] == [str(tmp_path / "ledger.db")]
    assert actors.timeouts == [12.0]
    assert isinstance(handle, LedgerHandleDouble)

    other = "cd" * 28
    start_ledger(
        LedgerConfig(path=str(tmp_path / "b.db")),
        name="b",
        namespace="ns",
        node_id=other,
        resources={"zone": 0.5},
        max_restarts=3,
    )
    second = actors.options[1]
    assert (second["name"], second["namespace"], second["max_restarts"]) == ("b", "ns", 3)
    assert second["resources"] == {"zone": 0.5}
    assert placement(second) == ("NodeAffinitySchedulingStrategy", other, False)
    assert actors.timeouts[1] == 300.0  # the default wait for a replay


def test_a_postgres_ledger_is_placed_anywhere_unless_told(actors: RayActorsDouble) -> None:
    url = "postgresql://ledger:pw@db:5432/ledger"
    start_ledger(LedgerConfig(path=url))
    start_ledger(LedgerConfig(path=url), node_id="cd" * 28, resources={"zone": 1.0})
    assert placement(actors.options[0]) == "DEFAULT"
    assert placement(actors.options[1]) == ("NodeAffinitySchedulingStrategy", "cd" * 28, False)
    assert actors.options[1]["resources"] == {"zone": 1.0}
    assert [config.path for config in actors.configs] == [url, url]  # a URL as given


def test_start_asks_again_while_a_killed_actor_still_holds_the_name(
    actors: RayActorsDouble, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An actor killed a moment ago answers as dead while its name is still taken: asked
    again until the name is free, at most ``_DYING_RETRIES`` more times; an actor whose own
    start failed (a corrupt log) is reported at once."""
    monkeypatch.setattr(ledger_actor, "_DYING_WAIT_S", 0.001)
    config = LedgerConfig(path=str(tmp_path / "ledger.db"))
    actors.answers = [RayActorError(), RayActorError()]
    start_ledger(config)
    assert len(actors.configs) == 3

    actors.configs.clear()
    actors.answers = [RayActorError() for _ in range(ledger_actor._DYING_RETRIES + 1)]
    with pytest.raises(RayActorError):
        start_ledger(config)
    assert len(actors.configs) == ledger_actor._DYING_RETRIES + 1

    actors.configs.clear()
    actors.answers = [RayActorError(actor_init_failed=True), RayActorError()]
    with pytest.raises(RayActorError) as failed:
        start_ledger(config)
    assert failed.value.actor_init_failed and len(actors.configs) == 1


def test_start_refuses_an_actor_that_serves_another_log_or_is_fenced(
    actors: RayActorsDouble, tmp_path: Path
) -> None:
    config = LedgerConfig(path=str(tmp_path / "ledger.db"))
    actors.answers = [info_of(LedgerConfig(path="/elsewhere/other.db"))]
    with pytest.raises(LoraLedgerError) as another:
        start_ledger(config, name="l1")
    assert another.value.code == Code.ALREADY_INITIALIZED
    assert another.value.message == (
        f"ledger actor loraledger/l1 already serves /elsewhere/other.db, not {config.path}"
    )
    actors.answers = [info_of(config, fenced="another controller appended", epoch=5)]
    with pytest.raises(LoraLedgerError) as fenced:
        start_ledger(config, name="l1")
    assert fenced.value.code == Code.FENCED
    assert fenced.value.details["epoch"] == 5
    assert "is fenced (another controller appended)" in fenced.value.message


def test_stop_closes_then_kills_for_good_and_says_whether_one_ran(
    actors: RayActorsDouble, tmp_path: Path
) -> None:
    """Stopping closes the ledger (a snapshot, queued calls committed), then kills the actor
    without a restart, even when the close failed or timed out; no actor: False."""
    assert stop_ledger("l1", namespace="ns") is False
    assert actors.killed == []
    handle = LedgerHandleDouble(LedgerConfig(path=str(tmp_path / "l.db")))
    actors.named[("l1", "ns")] = handle
    assert stop_ledger("l1", namespace="ns", timeout=7.0) is True
    assert (actors.closed, actors.timeouts, actors.killed) == ([handle], [7.0], [(handle, True)])
    for error in (RayActorError(), GetTimeoutError()):
        actors.close_error = error
        assert stop_ledger("l1", namespace="ns") is True
        assert actors.killed[-1] == (handle, True) and actors.timeouts[-1] == 60.0
    actors.named[("ledger", "loraledger")] = handle
    assert stop_ledger() is True  # the default name and namespace
