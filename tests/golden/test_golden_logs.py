"""Logs written by every released event schema, read by today's code (tests/golden/README.md).

Each ``*.db`` here was written by an older commit (``write_golden_log.py`` run on that commit's
code), so it stores its events in the schemas of that day. Today's code must verify it (the
hash chain, and every invariant at every seq), replay it to the state its story ends in, read
each old payload through its upcaster to the value that schema meant, and keep writing to it --
as Temporal's replayer checks old histories against new workers. A schema bumped without an
upcaster, an upcaster that reads the wrong default, or a fold that no longer accepts an old
event fails here.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import NamedTuple

import pytest

from evlog.events import (
    EngineLeft,
    EngineRestarted,
    Event,
    OwnerRegistered,
    PublicationSkipped,
    SessionReleased,
    VersionPublished,
)
from evlog.record import Record
from evlog.sqlite import SQLiteStore
from projections.recovery import recover
from projections.registry import RegistryState, VersionState, encode_state
from publisher.core.ledger import Ledger
from tools.verify import verify_log

pytestmark = pytest.mark.anyio

HERE = Path(__file__).parent

# The seven event types that moved past schema 1, in the order their schema 2 arrived.
BUMPED = (
    "VersionPublished",
    "PublicationSkipped",
    "EngineLeft",
    "FatalResolved",
    "VersionReclaimed",
    "OwnerRegistered",
    "EngineRestarted",
)


class Golden(NamedTuple):
    """A golden log: the schema its writer stored for each of :data:`BUMPED` (the last type at
    schema 2, every type after it at schema 1), and what that commit could record at all."""

    at_schema_2: int  # how many of BUMPED were at schema 2 when it was written
    staleness: bool  # ``ConfigureDeployment`` (max_staleness) existed
    health: bool  # engine suspension and lost adapters existed
    lives: bool  # owner incarnations and clean exits existed
    moved: bool  # a restart could record the engine's new address


GOLDEN = {
    "01-7c7572b.db": Golden(0, staleness=False, health=False, lives=False, moved=False),
    "02-d5334da.db": Golden(1, staleness=False, health=False, lives=False, moved=False),
    "03-beff057.db": Golden(2, staleness=True, health=False, lives=False, moved=False),
    "04-b760e03.db": Golden(5, staleness=True, health=True, lives=False, moved=False),
    "05-c5cecd9.db": Golden(6, staleness=True, health=True, lives=True, moved=False),
    "06-8b165d5.db": Golden(7, staleness=True, health=True, lives=True, moved=True),
}
LOGS = sorted(GOLDEN)


@pytest.fixture(params=LOGS)
def golden(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, Golden]:
    """A private copy of one golden log (the committed file is never opened), and its entry."""
    name: str = request.param
    copy = tmp_path / name
    shutil.copyfile(HERE / name, copy)
    return copy, GOLDEN[name]


def test_every_golden_log_here_is_described() -> None:
    """A log added without its entry (or an entry whose log is gone) would go unchecked."""
    assert sorted(p.name for p in HERE.glob("*.db")) == LOGS


async def test_today_s_verify_finds_the_chain_intact_and_every_invariant_held(
    golden: tuple[Path, Golden],
) -> None:
    path, _ = golden
    result = await verify_log(path, deep=True)
    assert (result.ok, result.stage, result.first_bad_seq) == (True, "done", None), result.problem
    assert result.records > 70


async def _read(path: Path) -> tuple[list[Record], RegistryState, RegistryState]:
    """The records (decoded by today's code), the state a full checked replay reaches, and
    the state recovered through the log's own snapshot (where today's code accepts it)."""
    async with SQLiteStore.open(path) as store:
        records = await store.read()
        replayed = await recover(store, use_snapshot=False, check=True)
        recovered = await recover(store)
    return records, replayed, recovered


def _only(records: list[Record], kind: type[Event], **fields: object) -> Event:
    (event,) = [
        r.event
        for r in records
        if isinstance(r.event, kind) and all(getattr(r.event, k) == v for k, v in fields.items())
    ]
    return event


async def test_each_log_stores_the_schemas_of_its_day(golden: tuple[Path, Golden]) -> None:
    """What makes the log golden: its old payloads really are old (so the upcasters run)."""
    path, g = golden
    records, _, _ = await _read(path)
    stored = {(r.type, r.schema) for r in records if r.type in BUMPED}
    assert stored == {(t, 2 if i < g.at_schema_2 else 1) for i, t in enumerate(BUMPED)}


async def test_the_replayed_state_is_the_end_of_the_story(golden: tuple[Path, Golden]) -> None:
    path, g = golden
    _, state, recovered = await _read(path)
    assert encode_state(recovered) == encode_state(state)  # a snapshot changes nothing
    assert (state.deployment, state.capacity, state.epoch) == ("golden", 3, 1)
    assert state.max_staleness == (2 if g.staleness else None)
    assert (state.default, state.default_revision, state.skipped) == (4, 4, 1)
    assert {v: (r.state, r.revision) for v, r in state.versions.items()} == {
        1: (VersionState.RECLAIMED, 1),
        2: (VersionState.RETIRED, 2),  # s-d still pins it
        3: (VersionState.RECLAIMED, 3),  # after an ambiguous unload, by inventory
        4: (VersionState.PUBLISHED, 4),
    }
    assert {s: (b.owner, b.version_id) for s, b in state.sessions.items()} == {"s-d": ("w1", 2)}
    released = {"s-a": "w1", "s-b": "w1", "s-c": "w2"} | ({"s-e": "w4"} if g.lives else {})
    assert state.tombstones == released
    engines = {e: (m.incarnation, m.routable, m.suspended) for e, m in state.engines.items()}
    assert engines == {"e0": ("e0-i1", True, False), "e1": ("e1-i2", True, False)}
    owners = {o: (w.expired, w.exited, w.incarnation) for o, w in state.owners.items()}
    assert owners == {
        "w1": (False, False, ""),
        "w2": (True, False, ""),  # its lease expired at 1040
        "w3": (False, False, "w3-a" if g.lives else ""),
    } | ({"w4": (False, True, "w4-a")} if g.lives else {})


async def test_old_payloads_read_as_what_their_schema_meant(golden: tuple[Path, Golden]) -> None:
    """Each upcaster fills the field its schema lacked with what an old record meant; a
    record written after the bump keeps what was written."""
    path, g = golden
    records, state, _ = await _read(path)
    published = [r.event for r in records if isinstance(r.event, VersionPublished)]
    assert [(e.version_id, e.rollback) for e in published] == [(v, False) for v in (1, 2, 3, 4)]
    skipped = _only(records, PublicationSkipped, version_id=5)
    assert isinstance(skipped, PublicationSkipped) and skipped.code == "CAPACITY_ERROR"
    holders = [h.version_id for h in skipped.holders]
    assert holders == ([2, 3, 4] if g.at_schema_2 >= 2 else [])
    left = _only(records, EngineLeft, engine="e2")
    assert isinstance(left, EngineLeft) and left.cause == ("operator" if g.health else "fleet")
    restarted = _only(records, EngineRestarted, engine="e1")
    assert isinstance(restarted, EngineRestarted)
    assert (restarted.old, restarted.new) == ("e1-i1", "e1-i2")
    assert restarted.endpoint == ("http://e1:30001" if g.moved else None)
    assert state.engines["e1"].endpoint == ("http://e1:30001" if g.moved else "http://e1:30000")
    w3 = _only(records, OwnerRegistered, owner="w3")
    assert isinstance(w3, OwnerRegistered) and w3.replaced is None
    assert w3.incarnation == ("w3-a" if g.lives else "")
    # no golden log knew client-held sessions: every owner held its own, no release was the
    # ledger's idle release
    registered = [r.event for r in records if isinstance(r.event, OwnerRegistered)]
    assert registered and all(e.sessions_idle_s is None for e in registered)
    assert all(o.sessions_idle_s is None for o in state.owners.values())
    # schema 4 added the digest of a life's secret: every life before had none
    assert all(e.secret_digest == "" for e in registered)
    assert all(o.secret_digest == "" for o in state.owners.values())
    assert all(b.idle_s is None for b in state.sessions.values())
    releases = [r.event for r in records if isinstance(r.event, SessionReleased)]
    assert releases and all((e.last_turn, e.idle_s, e.at) == (None,) * 3 for e in releases)
    assert state.idle_released == {}


async def test_today_s_ledger_opens_a_golden_log_and_writes_on(
    golden: tuple[Path, Golden],
) -> None:
    """The ledger of today starts a new controller epoch on an old log and keeps deciding on
    it: a new session binds to the story's default, and the log still verifies."""
    path, _ = golden
    async with SQLiteStore.open(path) as store, Ledger.open(store) as ledger:
        assert (ledger.state.epoch, ledger.state.default) == (2, 4)
        await ledger.register_owner("today", ttl_s=60.0)
        bound = await ledger.bind("s-today", "today")
        assert (bound.version_id, bound.revision) == (4, 4)
    result = await verify_log(path, deep=True)
    assert result.ok, result.problem
