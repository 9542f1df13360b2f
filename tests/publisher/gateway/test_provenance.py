"""Provenance rows: JSON-lines round trip, export of a set of sessions, a bounded buffer that
waits instead of dropping, and a failing sink that fails loudly."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import anyio
import pytest

from evlog.errors import LoraLedgerError, StoreCode
from publisher.gateway.provenance import (
    JsonlSink,
    MemorySink,
    ProvenanceRecorder,
    ProvenanceRow,
    encode_rows,
    export,
    iter_rows,
    read_rows,
    select,
)

pytestmark = pytest.mark.anyio


def row(session: str, turn: int, version_id: int = 1, at: float = 0.0) -> ProvenanceRow:
    return ProvenanceRow(
        session=session,
        turn=turn,
        engine="e0",
        incarnation="i",
        version_id=version_id,
        lora_name=f"agent@dep-{version_id}-0123456789abcdef",
        digest="ab" * 32,
        bound_revision=1,
        head_revision=3,
        head_revision_done=4,
        request_id=f"{session}-{turn}",
        prompt_tokens=4,
        completion_tokens=2,
        cached_tokens=0,
        finish_reason="length",
        started_at=at,
        finished_at=at + 1,
        gateway="gw",
    )


async def test_rows_reach_a_jsonl_file_in_order_and_read_back_equal(tmp_path: Path) -> None:
    path = tmp_path / "prov.jsonl"
    rows = [row(f"s{i % 7}", i) for i in range(500)]
    async with ProvenanceRecorder(JsonlSink(path), capacity=16, batch=8) as recorder:
        for r in rows:
            await recorder.record(r)
    assert recorder.written == recorder.recorded == 500
    back = read_rows(path)
    assert back == rows
    assert back[0].staleness == 2


def test_export_selects_a_set_of_sessions_in_trajectory_order(tmp_path: Path) -> None:
    rows = [row("b", 1, at=5), row("a", 2, at=1), row("c", 0), row("a", 0, at=9), row("b", 0)]
    out = tmp_path / "out.jsonl"
    assert export(rows, out, sessions={"a", "b"}) == 4
    assert [(r.session, r.turn) for r in read_rows(out)] == [("a", 0), ("a", 2), ("b", 0), ("b", 1)]
    assert len(select(rows)) == 5
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically, nothing left behind


def test_a_torn_line_is_refused_not_skipped() -> None:
    blob = encode_rows([row("a", 0), row("a", 1)])
    with pytest.raises(LoraLedgerError) as info:
        list(iter_rows(blob[:-10]))
    assert info.value.code == StoreCode.CORRUPT_RECORD


class GatedSink(MemorySink):
    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def write(self, rows):  # type: ignore[no-untyped-def]
        self.gate.wait(10)
        super().write(rows)


async def test_a_full_buffer_waits_instead_of_dropping() -> None:
    sink = GatedSink()
    async with ProvenanceRecorder(sink, capacity=2, batch=1) as recorder:
        for i in range(3):  # one taken by the blocked writer, two buffered
            with anyio.fail_after(10):  # only a hang fails: the writer takes row 0 when it runs
                await recorder.record(row("s", i))
        with anyio.move_on_after(0.2) as blocked:
            await recorder.record(row("s", 3))
        assert blocked.cancelled_caught  # backpressure, not a drop
        sink.gate.set()
        await recorder.record(row("s", 3))
    assert [r.turn for r in sink.rows] == [0, 1, 2, 3]


class BrokenSink:
    def write(self, rows):  # type: ignore[no-untyped-def]
        raise OSError("disk full")


async def record_into_a_broken_sink() -> None:
    async with ProvenanceRecorder(BrokenSink()) as recorder:
        await recorder.record(row("s", 0))
        await anyio.sleep_forever()  # the writer's failure cancels this block


async def test_a_failing_sink_fails_loudly() -> None:
    # A bound for a hang only: the failure comes when the writer's thread runs, however late.
    with anyio.fail_after(60), pytest.raises(BaseExceptionGroup) as info:
        await record_into_a_broken_sink()
    assert info.group_contains(OSError)


def test_rows_written_before_served_name_existed_still_read() -> None:
    older = json.loads(encode_rows([row("a", 0)]))
    del older["served_name"]
    (back,) = iter_rows(json.dumps(older).encode())
    assert back.served_name is None and back.attested


def test_a_refusal_written_before_refusal_codes_still_reads_as_a_failed_request() -> None:
    """Rows before schema 3 recorded an engine's clean refusal as ``engine_error`` with no
    code: they still read, with no code, and still count as a request that did not complete."""
    from tools.story import FAILED_OUTCOMES

    older = json.loads(encode_rows([row("a", 0)]))
    older.update(schema=2, finish_reason="engine_error", prompt_tokens=0, completion_tokens=0)
    del older["refusal_code"]
    (back,) = iter_rows(json.dumps(older).encode())
    assert (back.finish_reason, back.refusal_code, back.schema) == ("engine_error", None, 2)
    assert {"engine_error", "refused"} <= FAILED_OUTCOMES
