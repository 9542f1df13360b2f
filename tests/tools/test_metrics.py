"""The metrics read from a real decided state at scrape time and fed from the log: staleness
(docs/sessions.md#staleness) of the sessions bound now and of served generations (fed through
``StalenessSink`` around a provenance sink), and the figures the alert rules of
``deploy/prometheus/`` fire on."""

from __future__ import annotations

from typing import cast

from prometheus_client import generate_latest

from evlog.events import AnyEvent
from evlog.record import Record
from publisher.core import commands as c
from publisher.gateway.provenance import MemorySink, ProvenanceRow
from tests.publisher.core.book import Book, digest_of
from tools.metrics import LedgerMetrics, StalenessSink


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in the scrape")


def test_bound_sessions_are_counted_by_their_staleness() -> None:
    book = Book().bootstrap(capacity=4)
    book.run(c.ConfigureDeployment(max_staleness=5))
    book.publish(1)
    book.run(c.Bind(session="old-1", owner="w1"))
    book.run(c.Bind(session="old-2", owner="w1"))
    book.publish(2)
    book.publish(3)
    book.run(c.Bind(session="new", owner="w1"))  # on the default: staleness 0
    scrape = generate_latest(LedgerMetrics(lambda: book.state).registry).decode()
    name = "loraledger_bound_session_staleness"
    assert _sample(scrape, f'{name}_bucket{{le="0.0"}}') == 1
    assert _sample(scrape, f'{name}_bucket{{le="1.0"}}') == 1
    assert _sample(scrape, f'{name}_bucket{{le="2.0"}}') == 3  # the two on v1 are 2 behind
    assert _sample(scrape, f"{name}_count") == 3
    assert _sample(scrape, f"{name}_sum") == 4
    assert _sample(scrape, "loraledger_max_staleness") == 5


def _row(staleness: int) -> ProvenanceRow:
    return ProvenanceRow(session="s", turn=0, engine="e0", incarnation="i", version_id=1,
                         lora_name="n", digest="d", bound_revision=1,
                         head_revision=1 + staleness, head_revision_done=1 + staleness,
                         request_id="r", prompt_tokens=1, completion_tokens=1, cached_tokens=0,
                         finish_reason="length", started_at=0.0, finished_at=1.0,
                         gateway="gw")  # fmt: skip


def test_served_generations_are_counted_and_passed_on() -> None:
    book = Book().bootstrap()
    metrics = LedgerMetrics(lambda: book.state)
    inner = MemorySink()
    sink = StalenessSink(inner, metrics)
    sink.write([_row(0), _row(0), _row(3)])
    assert [r.staleness for r in inner.rows] == [0, 0, 3]
    scrape = generate_latest(metrics.registry).decode()
    name = "loraledger_generation_staleness"
    assert _sample(scrape, f'{name}_bucket{{le="0.0"}}') == 2
    assert _sample(scrape, f'{name}_bucket{{le="3.0"}}') == 3
    assert _sample(scrape, f"{name}_sum") == 3


def test_what_wakes_an_operator_is_read_from_the_state() -> None:
    """The gauges the alert rules (deploy/prometheus/) fire on: an engine suspended apart from
    one unreachable, the newest publication stalled (per refusal code; a stall a newer default
    passed is moot), owners per state, and bound sessions past the staleness bound."""
    book = Book().bootstrap(capacity=6)
    book.run(c.ConfigureDeployment(max_staleness=1))
    book.publish(1)
    book.run(c.Bind(session="old", owner="w1"))
    book.publish(2)
    book.publish(3)  # "old" is now 2 behind, over the bound of 1
    book.allocate(4)
    book.refuse(c.Allocate(version_id=5, digest=digest_of(5)), "PUBLICATION_IN_PROGRESS")
    book.run(c.SuspendEngine(engine="e0", cause="operator"))
    e1 = book.incarnation("e1")
    book.run(c.ReportUnreachable(engine="e1", incarnation=e1, at=1.0, error="refused",
                                 source="probe"))  # fmt: skip
    book.run(c.RegisterOwner(owner="w2", ttl_s=10.0, now=0.0))
    book.run(c.ExpireOwner(owner="w2", now=20.0, last_seen=0.0))
    scrape = generate_latest(LedgerMetrics(lambda: book.state).registry).decode()
    assert _sample(scrape, 'loraledger_engine_suspended{engine="e0"}') == 1
    assert _sample(scrape, 'loraledger_engine_suspended{engine="e1"}') == 0
    assert _sample(scrape, 'loraledger_engine_unreachable{engine="e0"}') == 0
    assert _sample(scrape, 'loraledger_engine_unreachable{engine="e1"}') == 1
    assert _sample(scrape, 'loraledger_publications_stalled{code="PUBLICATION_IN_PROGRESS"}') == 1
    assert _sample(scrape, 'loraledger_owners{state="live"}') == 1
    assert _sample(scrape, 'loraledger_owners{state="expired"}') == 1
    assert _sample(scrape, "loraledger_sessions_over_staleness_bound") == 1


def test_a_stall_a_newer_default_passed_is_not_counted() -> None:
    book = Book().bootstrap(capacity=4)
    book.allocate(1)
    book.refuse(c.Allocate(version_id=2, digest=digest_of(2)), "PUBLICATION_IN_PROGRESS")
    book.ready_all(1)
    book.run(c.Commit(version_id=1, attempt=book.state.versions[1].attempt))
    scrape = generate_latest(LedgerMetrics(lambda: book.state).registry).decode()
    assert 'loraledger_publications_stalled{code="PUBLICATION_IN_PROGRESS"} 1.0' in scrape
    book.publish(3)  # the trainer moved on: version 2's stall is moot
    scrape = generate_latest(LedgerMetrics(lambda: book.state).registry).decode()
    assert "loraledger_publications_stalled{" not in scrape


def test_skipped_publications_are_counted_per_code() -> None:
    """A publication dropped because every slot is held (after the first commit) is what the
    capacity alert fires on; a refused rollback is counted apart."""
    book = Book().bootstrap(capacity=1)
    book.publish(1)
    book.run(c.Bind(session="s", owner="w1"))
    book.run(c.Allocate(version_id=2, digest=digest_of(2)))  # the slot is v1's: skipped
    metrics = LedgerMetrics(lambda: book.state)
    for seq, event in enumerate(book.events, start=1):
        metrics.observe(Record(seq=seq, event_id=b"", stream="s", type=type(event).__name__,
                               schema=1, recorded_at=0.0, payload=b"", prev_hash=b"",
                               hash=b"", event=cast(AnyEvent, event)))  # fmt: skip
    scrape = generate_latest(metrics.registry).decode()
    assert _sample(scrape, 'loraledger_publications_skipped_total{code="CAPACITY_ERROR"}') == 1


def test_the_drivers_loop_counts_are_read_at_scrape_time() -> None:
    """The reclaim driver's sweeps and the health loop's wakes are read from the drivers at
    each scrape (nothing is incremented by hand), and a service without drivers has none."""
    book = Book().bootstrap()
    loops = {"sweeps": 3, "wakes": 7}
    metrics = LedgerMetrics(
        lambda: book.state,
        reclaim_sweeps=lambda: loops["sweeps"],
        health_wakes=lambda: loops["wakes"],
    )
    scrape = generate_latest(metrics.registry).decode()
    assert _sample(scrape, "loraledger_reclaim_sweeps_total") == 3
    assert _sample(scrape, "loraledger_health_wakes_total") == 7
    loops.update(sweeps=5, wakes=8)
    scrape = generate_latest(metrics.registry).decode()
    assert _sample(scrape, "loraledger_reclaim_sweeps_total") == 5
    assert _sample(scrape, "loraledger_health_wakes_total") == 8
    bare = generate_latest(LedgerMetrics(lambda: book.state).registry).decode()
    assert "loraledger_reclaim_sweeps" not in bare and "loraledger_health_wakes" not in bare
