"""Provenance: which version produced which generation, as a table a trainer can join.

Pinning a session to its first version only pays off if the trainer can *prove* which
behaviour policy produced each sample (importance sampling, decoupled PPO, staleness
correction; docs/sessions.md). So every generation the gateway completes yields one
:class:`ProvenanceRow` -- session, turn, engine, version id, immutable adapter name, digest,
the revision the session bound at and the head revision when it was dispatched and when it
finished, request id, token counts, timestamps -- under a ``row_id`` of its own.

The gateway must never block on disk and must never silently drop a row (a missing row is a
sample whose policy nobody can vouch for). A :class:`ProvenanceRecorder` is therefore a
*bounded* buffer between the gateway and one writer task: ``record`` waits when the writer
falls behind (backpressure) instead of dropping, and closing the recorder drains every row
before it returns. Sinks are tiny so a trainer can plug in its own: the ledger's provenance
store (:class:`StoreSink`, in the ledger's process; every other process sends its rows there
through its remote ledger client, ``RemoteLedger.provenance_sink``), a JSON-lines file
(:class:`JsonlSink`), memory (:class:`MemorySink`), several at once (:class:`Tee`).

One place for every row: whichever face served a turn (``serve``'s own routes, a gateway
process, a Ray gateway actor, the Python face over a remote ledger), its row ends in the store
beside the log (``evlog/provenance_store.py``), where ``loraledger audit LOG`` finds it. A row
may be sent more than once (a reply lost on the way back is answered by sending again); its
``row_id`` makes the store keep it once.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import os
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Protocol, cast

import anyio
import msgspec
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from engines.contract import Generation
from evlog.errors import INVALID_INPUT, InvalidInput, StoreCode, StoreError
from evlog.provenance_store import ProvenanceStore, StoredRow
from projections.staleness import staleness
from publisher.core.errors import Code, LedgerError
from publisher.logs import get_logger

log = get_logger("loraledger.provenance")

# 2: ``staleness`` is a stored field (schema-1 files, which carry only the revisions, read
# with it computed from them: the same number). 3: ``row_id`` (older rows read with ``""``:
# their key in a store is then a digest of their content, :func:`stored_row`), and an engine's
# clean refusal is ``finish_reason`` ``refused`` with the engine's code in ``refusal_code`` (rows
# before say ``engine_error``, and read with no code).
SCHEMA = 3
# ``finish_reason`` of a request the engine refused cleanly before generating (a prompt over
# its context, a bad parameter, an adapter it does not hold): nothing ran, nothing to train on.
REFUSED = "refused"


class ProvenanceRow(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One completed generation. Every token of it came from ``version_id`` (a request is
    never switched between versions), so the token span is the whole completion.

    ``staleness`` (docs/sessions.md#staleness) is how many versions were published between
    the bound one and the default when this sample was dispatched: ``head_revision -
    bound_revision``, stored under that one name (``head_revision`` / ``head_revision_done``
    are the default's revision at dispatch and at completion, the raw inputs). Left out, it is
    computed from the revisions, so rows written before it existed read the same."""

    session: str
    turn: int | None
    engine: str
    incarnation: str
    version_id: int
    lora_name: str
    digest: str
    bound_revision: int
    head_revision: int
    head_revision_done: int
    request_id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str
    started_at: float
    finished_at: float
    gateway: str
    schema: int = SCHEMA
    # What the engine said it ran (None: the engine does not say). A value other than
    # ``lora_name`` means the sample is not from the bound policy.
    served_name: str | None = None
    staleness: int = -1  # -1: not given, computed from the revisions below
    # The id the engine saw, when it is not ``request_id`` (the OpenAI face makes a client's
    # x-request-id unique per request for the engine): joins the engine's own logs.
    engine_request_id: str | None = None
    # This row's key (made once, where the row is made): a row sent again is stored once.
    row_id: str = ""
    # The engine's code when it refused the request (``finish_reason`` ``refused``).
    refusal_code: str | None = None

    def __post_init__(self) -> None:
        if self.staleness < 0:
            msgspec.structs.force_setattr(
                self, "staleness", staleness(self.bound_revision, self.head_revision)
            )

    @property
    def attested(self) -> bool:
        """False when the engine named another adapter than the bound one."""
        return self.served_name is None or self.served_name == self.lora_name


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    """What the engine reported of one generation, for its provenance row: token counts, how
    it ended, the adapter it says it ran (None: it does not say), its process life (None:
    the ledger's record of it is used) and, for a refusal, the engine's code."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str = ""
    served_name: str | None = None
    incarnation: str | None = None
    refusal_code: str | None = None

    @classmethod
    def refused(cls, code: str) -> Usage:
        """A request the engine refused cleanly, with the engine's code: nothing generated."""
        return cls(finish_reason=REFUSED, refusal_code=code)

    @classmethod
    def of(cls, generation: Generation) -> Usage:
        """A :class:`~engines.contract.Generation`'s usage (every sample's tokens counted)."""
        return cls(
            prompt_tokens=generation.prompt_tokens,
            completion_tokens=sum(len(c.token_ids) for c in generation.choices)
            or len(generation.token_ids),
            cached_tokens=generation.cached_tokens,
            finish_reason=generation.finish_reason,
            served_name=generation.lora_name,
            incarnation=generation.incarnation,
        )


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(ProvenanceRow)


def encode_rows(rows: Iterable[ProvenanceRow]) -> bytes:
    """JSON lines: one row per line, newline-terminated."""
    return b"".join(_encoder.encode(row) + b"\n" for row in rows)


def read_rows(path: str | os.PathLike[str]) -> list[ProvenanceRow]:
    """Every row of a JSON-lines provenance file (a torn last line, from a crash mid-write,
    is refused loudly rather than skipped)."""
    return list(iter_rows(Path(path).read_bytes()))


def iter_rows(blob: bytes) -> Iterator[ProvenanceRow]:
    for number, line in enumerate(blob.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield _decoder.decode(line)
        except msgspec.DecodeError as exc:
            raise StoreError(
                StoreCode.CORRUPT_RECORD,
                f"provenance line {number} is not a row: {exc}",
                line=number,
            ) from exc


def stored_row(row: ProvenanceRow) -> StoredRow:
    """``row`` as the provenance store keeps it. A row made before rows had ids (``row_id``
    ``""``) is keyed by a digest of its content, so sending it twice still stores it once."""
    body = _encoder.encode(row)
    row_id = row.row_id or "sha256:" + hashlib.sha256(body).hexdigest()
    return StoredRow(row_id=row_id, session=row.session, started_at=row.started_at, body=body)


def decode_stored(bodies: Iterable[bytes]) -> list[ProvenanceRow]:
    """Rows read back from the provenance store (a body that is not a row is refused loudly,
    as a torn file line is)."""
    rows: list[ProvenanceRow] = []
    for number, body in enumerate(bodies, start=1):
        try:
            rows.append(_decoder.decode(body))
        except msgspec.DecodeError as exc:
            raise StoreError(
                StoreCode.CORRUPT_RECORD, f"provenance row {number} is not a row: {exc}"
            ) from exc
    return rows


def select(
    rows: Iterable[ProvenanceRow], sessions: Collection[str] | None = None
) -> list[ProvenanceRow]:
    """The rows of ``sessions`` (all rows when None), ordered by session, turn, start time --
    the order a trainer joins trajectories in."""
    wanted = None if sessions is None else set(sessions)
    chosen = [r for r in rows if wanted is None or r.session in wanted]
    chosen.sort(key=lambda r: (r.session, -1 if r.turn is None else r.turn, r.started_at))
    return chosen


def export(
    rows: Iterable[ProvenanceRow],
    path: str | os.PathLike[str],
    sessions: Collection[str] | None = None,
) -> int:
    """Write the table of ``sessions`` to ``path`` as JSON lines, atomically (temp + rename).
    Returns the number of rows written."""
    chosen = select(rows, sessions)
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(encode_rows(chosen))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(target)
    return len(chosen)


# --- sinks -------------------------------------------------------------------------------------


class Sink(Protocol):
    """Where drained rows go. ``write`` runs in a worker thread: it may block on I/O."""

    def write(self, rows: Sequence[ProvenanceRow]) -> None: ...


class AsyncSink(Protocol):
    """Where drained rows go, awaited on the recorder's loop (a store, a remote ledger): it
    returns once the rows are kept, and it may wait (back-pressure) but must not drop them."""

    async def write(self, rows: Sequence[ProvenanceRow]) -> None: ...


AnySink = Sink | AsyncSink


async def write_to(sink: AnySink, rows: Sequence[ProvenanceRow]) -> None:
    """Hand ``rows`` to ``sink``: awaited when it is an :class:`AsyncSink`, in a worker thread
    otherwise (a plain sink may block on I/O)."""
    if inspect.iscoroutinefunction(sink.write):
        await cast(AsyncSink, sink).write(rows)
    else:
        write: Callable[[Sequence[ProvenanceRow]], object] = sink.write
        await anyio.to_thread.run_sync(write, rows)


class StoreSink:
    """Rows into the ledger's provenance store (``evlog/provenance_store.py``): the sink of
    the faces in the ledger's own process, and what the ledger service stores remote rows
    through (``LedgerService.store_provenance``)."""

    def __init__(self, store: ProvenanceStore) -> None:
        self.store = store

    async def write(self, rows: Sequence[ProvenanceRow]) -> None:
        await self.store.add([stored_row(row) for row in rows])


class Tee:
    """Every row to each of ``sinks`` in turn (the store, and a JSON-lines copy someone asked
    for): a batch is written once every sink has it."""

    def __init__(self, *sinks: AnySink) -> None:
        self.sinks = sinks

    async def write(self, rows: Sequence[ProvenanceRow]) -> None:
        for sink in self.sinks:
            await write_to(sink, rows)


class JsonlSink:
    """Appends rows to a JSON-lines file, flushed after every batch (the file is readable at
    any time; ``fsync`` is left to :func:`export`, a crash loses at most the page cache)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def write(self, rows: Sequence[ProvenanceRow]) -> None:
        with open(self.path, "ab") as f:
            f.write(encode_rows(rows))


class MemorySink:
    """Keeps every row in memory (tests, and trainers that join in-process)."""

    def __init__(self) -> None:
        self.rows: list[ProvenanceRow] = []

    def write(self, rows: Sequence[ProvenanceRow]) -> None:
        self.rows.extend(rows)


# --- the recorder ------------------------------------------------------------------------------


class ProvenanceRecorder:
    """A bounded buffer drained by one writer task into a :class:`Sink` or an
    :class:`AsyncSink`.

    Use as ``async with ProvenanceRecorder(sink) as recorder:``; the writer lives in that
    block, and leaving it waits until every recorded row reached the sink. ``record`` waits
    while ``capacity`` rows are pending (never drops). ``recorded``/``written`` count rows in
    and out, so a test or an operator can see the lag.

    ``drain_timeout_s`` bounds that last wait, for a sink that may wait forever (a remote
    ledger that is down keeps its rows and sends them again until it answers): once the block
    is left, the sink has that long to take what is buffered; rows it did not take by then
    are counted in ``abandoned`` and logged as an error with their ids (``provenance.unsent``),
    never dropped silently. None (the default): wait for every row.
    """

    def __init__(
        self,
        sink: AnySink,
        *,
        capacity: int = 8192,
        batch: int = 1024,
        drain_timeout_s: float | None = None,
    ) -> None:
        if capacity < 1 or batch < 1:
            raise InvalidInput(INVALID_INPUT, "capacity and batch must be >= 1")
        if drain_timeout_s is not None and not drain_timeout_s >= 0:
            raise InvalidInput(INVALID_INPUT, "drain_timeout_s must be >= 0")
        self.sink = sink
        self.capacity = capacity
        self.batch = batch
        self.drain_timeout_s = drain_timeout_s
        self.recorded = 0
        self.written = 0
        self.abandoned = 0
        self._deadline = math.inf  # set when the block is left with a drain timeout
        self._writing: anyio.CancelScope | None = None
        self._send: MemoryObjectSendStream[ProvenanceRow] | None = None
        self._receive: MemoryObjectReceiveStream[ProvenanceRow] | None = None
        self._tg: TaskGroup | None = None
        self._failure: BaseException | None = None

    async def __aenter__(self) -> ProvenanceRecorder:
        send, receive = anyio.create_memory_object_stream[ProvenanceRow](self.capacity)
        self._send, self._receive = send, receive
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._writer, receive)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        if self._send is not None:
            send, self._send = self._send, None
            await send.aclose()  # the writer drains what is buffered, then returns
        if self.drain_timeout_s is not None:
            self._deadline = anyio.current_time() + self.drain_timeout_s
            if self._writing is not None:
                self._writing.deadline = self._deadline
        assert self._tg is not None
        return await self._tg.__aexit__(exc_type, exc, tb)

    async def record(self, row: ProvenanceRow) -> None:
        """Buffer one row; waits (backpressure) while the buffer is full."""
        if self._failure is not None:
            raise StoreError(
                StoreCode.STORE_FAILED, f"the provenance writer failed: {self._failure!r}"
            )
        if self._send is None:
            raise LedgerError(Code.LEDGER_CLOSED, "the provenance recorder is not running")
        try:
            self._send.send_nowait(row)
        except anyio.WouldBlock:
            await self._send.send(row)
        self.recorded += 1

    @property
    def pending(self) -> int:
        return self.recorded - self.written - self.abandoned

    async def _writer(self, receive: MemoryObjectReceiveStream[ProvenanceRow]) -> None:
        async with receive:
            while True:
                try:
                    rows = [await receive.receive()]
                except anyio.EndOfStream:
                    return
                while len(rows) < self.batch:
                    try:
                        rows.append(receive.receive_nowait())
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
                try:
                    # No await between reading the deadline and publishing the scope: a
                    # close that sets the deadline sees this write or the next one.
                    with anyio.CancelScope(deadline=self._deadline) as writing:
                        self._writing = writing
                        await write_to(self.sink, rows)
                    self._writing = None
                except Exception as exc:
                    # Refuse later rows loudly instead of buffering into a dead sink.
                    self._failure = exc
                    log.error("provenance.write_failed", error=repr(exc), rows=len(rows))
                    raise
                if writing.cancelled_caught:  # the drain timeout ran out: not taken
                    self.abandoned += len(rows)
                    log.error(
                        "provenance.unsent",
                        rows=len(rows),
                        row_ids=[row.row_id for row in rows],
                        drain_timeout_s=self.drain_timeout_s,
                    )
                    continue
                self.written += len(rows)
