"""The staleness metrics (docs/sessions.md#staleness): the sessions bound now by staleness,
read from a real decided state at scrape time, and the staleness of served generations, fed
through ``StalenessSink`` around a provenance sink."""

from __future__ import annotations

from prometheus_client import generate_latest

from publisher.core import commands as c
from publisher.gateway.provenance import MemorySink, ProvenanceRow
from tests.publisher.core.book import Book
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
