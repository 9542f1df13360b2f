"""The operator's live page: ``GET /ui`` of ``loraledger serve``, updated as the log grows.

Nobody watches a terminal for a week-long run; a browser tab they leave open is what they
look at. The page is one static file (``ui.html``: plain HTML, CSS and a little JavaScript, no
build chain) that opens ``GET /ui/events``, a stream of server-sent events: one snapshot of the
ledger's state (:class:`UiSnapshot`) at once, then a fresh one each time a record is committed.

Why snapshots and not the events themselves: the page then needs no fold of its own (one
projection of the state, here, in Python) and a reconnecting browser is whole again with its
first message. Why it cannot become a polling storm: a stream waits on the ledger's commit
signal (``wait_committed``, one event shared by every waiter), sends at most one snapshot per
``min_interval_s`` however fast the log grows (a burst of commits is coalesced into the next
snapshot), at most ``max_streams`` streams are open at once (one more is told ``busy`` and
closed), and each ends after ``stream_s`` (the browser reconnects by itself, ``retry:``), so a
forgotten tab holds nothing forever. A client that goes away ends its stream: Starlette cancels
the generator when the connection closes (anyio cancellation; a ``finally`` frees the slot).

The timelines (``/ui/version/{id}``, ``/ui/engine/{name}``) are ``loraledger replay
--version``/``--engine``: the same replay over the log file and the same renderables
(:func:`tools.render.subject_views`), exported by rich as HTML. Everything taken from the log
(engine names, session ids: client text) is escaped: the page writes it with ``textContent``,
never as markup, and rich's HTML export escapes the timelines.
"""

from __future__ import annotations

import html
import io
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping
from importlib import resources
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from rich.console import Console
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response, StreamingResponse
from starlette.routing import Route

from evlog.store import EventStore
from projections.incidents import Incident
from projections.registry import RegistryState, VersionState
from projections.status import LedgerStatus, status_of

if TYPE_CHECKING:
    from publisher.core.ledger import Ledger
    from tools.replay import ReplayResult

Endpoint = Callable[[Request], Awaitable[Response]]
# tools.replay.replay over the log this service writes, its path given: (versions=,
# engines=, incidents=) -> ReplayResult
Replayer = Callable[..., Awaitable["ReplayResult"]]

INCIDENTS_SHOWN = 12  # the last ones, by time
SESSIONS_SHOWN = 20  # session ids named per version (the count is always whole)
_encoder = msgspec.json.Encoder()


class VersionProgress(msgspec.Struct, frozen=True, kw_only=True):
    """What the status does not say about a version: its publication's progress, why it
    stalled, and when it began and last changed (None where the log was not read)."""

    stall: str | None = None  # the last refusal of its allocation: code and what was in the way
    ready: int = 0  # engines that loaded the current attempt (a publication in progress)
    fleet: int = 0  # engines the current attempt targets
    allocated_at: float | None = None  # its first record (its age)
    changed_at: float | None = None  # its latest record (how long it has been as it is)


class EngineCondition(msgspec.Struct, frozen=True, kw_only=True):
    """What the status does not say about an engine: its suspension, the versions it lost."""

    suspended: bool = False
    suspend_cause: str = ""
    lacks: tuple[int, ...] = ()


class UiSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """One message of the page's stream: the status (:func:`projections.status.status_of`,
    the struct ``GET /status`` answers) and what the page shows beside it."""

    view: str  # "ledger" (serve) or "gateway" (a gateway process's own view)
    now: float  # the service's clock when it was made (the page measures ages against it)
    status: LedgerStatus
    held: int  # sessions bound in this view (a gateway: the ones this process holds)
    pinned: dict[int, tuple[str, ...]]  # version -> at most SESSIONS_SHOWN of its sessions
    progress: dict[int, VersionProgress] = msgspec.field(default_factory=dict)
    conditions: dict[str, EngineCondition] = msgspec.field(default_factory=dict)


def _pinned(bindings: Iterable[tuple[str, int]]) -> dict[int, tuple[str, ...]]:
    """version -> the first SESSIONS_SHOWN of its sessions (sorted), of (session, version)."""
    shown: dict[int, list[str]] = {}
    for session, vid in sorted(bindings):
        names = shown.setdefault(vid, [])
        if len(names) < SESSIONS_SHOWN:
            names.append(session)
    return {vid: tuple(names) for vid, names in shown.items()}


class VersionTimes:
    """When each version's stream began and last changed, read from the log as it grows.

    The state keeps no times (a fold of the log has no clock), and the page must show ages; the
    records carry ``recorded_at``. Each snapshot first reads what was committed since the last
    one (``catch_up``, one reader at a time), so the log is read once in all, not per page."""

    BATCH = 4096

    def __init__(self, store: EventStore) -> None:
        self.store = store
        self.read_to = 0
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self._lock = anyio.Lock()

    async def catch_up(self) -> None:
        async with self._lock:
            while batch := await self.store.read(after=self.read_to, limit=self.BATCH):
                for record in batch:
                    if record.stream.startswith(_VERSION_STREAM):
                        vid = int(record.stream[len(_VERSION_STREAM) :])
                        self.first.setdefault(vid, record.recorded_at)
                        self.last[vid] = record.recorded_at
                self.read_to = batch[-1].seq


_VERSION_STREAM = "version-"


def snapshot(
    state: RegistryState,
    *,
    now: float,
    times: VersionTimes | None = None,
) -> UiSnapshot:
    """What the page shows of ``state`` (a pure read; ``times``: when each version began and
    last changed, if known)."""
    first = times.first if times is not None else {}
    last = times.last if times is not None else {}
    progress = {}
    for v in state.versions.values():
        stall = state.stalls.get(v.version_id) if v.state is VersionState.LOADING else None
        progress[v.version_id] = VersionProgress(
            stall=None if stall is None else _stall_text(stall.code, stall.blocked_by),
            ready=len(v.ready),
            fleet=len(v.fleet),
            allocated_at=first.get(v.version_id),
            changed_at=last.get(v.version_id),
        )
    return UiSnapshot(
        view="ledger",
        now=now,
        status=status_of(state),
        held=len(state.sessions),
        pinned=_pinned((s, b.version_id) for s, b in state.sessions.items()),
        progress=progress,
        conditions={
            e.engine: EngineCondition(
                suspended=e.suspended,
                suspend_cause=e.suspend_cause,
                lacks=tuple(sorted(e.lacks.values())),
            )
            for e in state.engines.values()
        },
    )


def _stall_text(code: str, blocked_by: tuple[int, ...]) -> str:
    in_the_way = ", ".join(f"v{b}" for b in blocked_by)
    return f"{code} (in the way: {in_the_way})" if in_the_way else code


def page_html() -> str:
    return resources.files("tools").joinpath("ui.html").read_text(encoding="utf-8")


def _rich_html(title: str, renderables: list[Any], *, back: str = "") -> str:
    """``renderables`` as the CLI prints them, as a standalone HTML page (rich escapes text);
    ``back``: a relative link to the live page, and a heading (a full page, not a fragment)."""
    console = Console(record=True, width=160, file=io.StringIO(), color_system="truecolor")
    for r in renderables:
        console.print(r)
    body = console.export_html(inline_styles=True, code_format="<pre>{code}</pre>")
    head = (
        f'<p><a href="{back}">&larr; live page</a></p><h1>{html.escape(title)}</h1>' if back else ""
    )
    return (
        f'<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f'</head><body style="font: 12px monospace">{head}{body}</body></html>'
    )


# the view now (a snapshot of what the page shows), and a wait until a newer one than the seq
# given exists
Snapshots = Callable[[], Awaitable[UiSnapshot]]
Changed = Callable[[int], Awaitable[None]]


def ledger_pages(ledger: Ledger, replayer: Replayer | None = None) -> UiPages:
    """The page of ``serve``: the ledger's state, a snapshot per commit, ages from its log."""
    times = VersionTimes(ledger.store)

    async def now() -> UiSnapshot:
        await times.catch_up()
        return snapshot(ledger.state, now=ledger.clock(), times=times)

    return UiPages(
        now, ledger.wait_committed, replayer=replayer, log_seq=lambda: ledger.store.last_seq
    )


def gateway_pages(
    status: Callable[[], LedgerStatus],
    bindings: Callable[[], Mapping[str, int]],
    *,
    look_every_s: float = 0.25,
) -> UiPages:
    """The page of a ``loraledger gateway`` process: its own view, the ledger's status as it
    last read it (refreshed every ``--refresh-s``; it routes by the same) and the sessions it
    holds (session -> version). A new status read is noticed within ``look_every_s``: a look
    at this process's memory, never a request to the ledger. No timelines: the log is not
    here (they are on serve's page)."""

    async def now() -> UiSnapshot:
        return gateway_snapshot(status(), bindings(), now=time.time())

    async def changed(seq: int) -> None:
        # the remote view has no change signal to wait on; this reads memory, not the network
        while status().last_seq <= seq:  # noqa: ASYNC110
            await anyio.sleep(look_every_s)

    return UiPages(now, changed)


def gateway_snapshot(
    status: LedgerStatus, bindings: Mapping[str, int], *, now: float
) -> UiSnapshot:
    """A gateway's view: ``status`` as it last read it, and the sessions this process holds
    (``bindings``) pinned per version; what the status does not carry (stalls, suspensions,
    ages) is left out."""
    return UiSnapshot(
        view="gateway",
        now=now,
        status=status,
        held=len(bindings),
        pinned=_pinned(bindings.items()),
    )


class UiPages:
    """The page's routes over a live view. ``snapshots`` makes the view now, ``changed``
    waits until a view newer than the given seq exists (``Ledger.wait_committed`` for serve);
    ``replayer`` (serve's, over its log) enables the incidents and timelines (404 without);
    ``log_seq`` says where the log ends now (a replay of the same log is not made twice)."""

    def __init__(
        self,
        snapshots: Snapshots,
        changed: Changed,
        *,
        replayer: Replayer | None = None,
        log_seq: Callable[[], int] = lambda: 0,
        max_streams: int = 32,
        stream_s: float = 300.0,
        min_interval_s: float = 0.1,
        keepalive_s: float = 15.0,
    ) -> None:
        self.snapshots = snapshots
        self.changed = changed
        self.replayer = replayer
        self.log_seq = log_seq
        self.max_streams = max_streams
        self.stream_s = stream_s
        self.min_interval_s = min_interval_s
        self.keepalive_s = keepalive_s
        self.open_streams = 0
        self.closed = False
        self._streams: set[anyio.CancelScope] = set()
        self._incidents_lock = anyio.Lock()
        self._incidents: tuple[int, str | None] = (0, None)  # (the log's last seq, page)

    def routes(self, reader: Callable[[str, Endpoint], Endpoint]) -> list[Route]:
        """``reader`` wraps each route, named as in ``tools/roles.py``, with the service's
        rule for reads (``--private-reads``)."""
        return [
            Route("/ui", reader("GET /ui", self.page), methods=["GET"]),
            Route("/ui/events", reader("GET /ui/events", self.events), methods=["GET"]),
            Route("/ui/incidents", reader("GET /ui/incidents", self.incidents), methods=["GET"]),
            Route(
                "/ui/version/{version:int}",
                reader("GET /ui/version/{version}", self.version),
                methods=["GET"],
            ),
            Route(
                "/ui/engine/{engine}",
                reader("GET /ui/engine/{engine}", self.engine),
                methods=["GET"],
            ),
        ]

    async def page(self, request: Request) -> Response:
        return HTMLResponse(page_html(), headers={"Cache-Control": "no-store"})

    async def events(self, request: Request) -> Response:
        return StreamingResponse(
            self._stream(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    async def _stream(self) -> AsyncGenerator[str, None]:
        # The slot is taken and released inside the generator: one never started (its client
        # left at once) holds none.
        self.open_streams += 1
        try:
            if self.open_streams > self.max_streams:
                busy = f"{self.max_streams} live pages are open already"
                yield f"retry: 5000\nevent: busy\ndata: {_encoder.encode(busy).decode()}\n\n"
                return
            yield "retry: 1000\n\n"
            with anyio.move_on_after(self.stream_s) as scope:
                self._streams.add(scope)
                try:
                    while not self.closed:
                        snap = await self.snapshots()
                        seq = snap.status.last_seq
                        yield f"id: {seq}\ndata: {_encoder.encode(snap).decode()}\n\n"
                        while True:
                            with anyio.move_on_after(self.keepalive_s) as waited:
                                await self.changed(seq)
                            if not waited.cancelled_caught:
                                break
                            yield ": keepalive\n\n"  # proxies keep it open; a gone client shows
                        await anyio.sleep(self.min_interval_s)  # coalesce a burst of commits
                finally:
                    self._streams.discard(scope)
        finally:
            self.open_streams -= 1

    def close(self) -> None:
        """End every stream now, and any opened after: the server is stopping, and an open
        tab must not hold its stop up (uvicorn waits for open responses, then cancels them)."""
        self.closed = True
        for scope in self._streams:
            scope.cancel()

    async def incidents(self, request: Request) -> Response:
        """The last incidents: a replay of the whole log, so made once per state of the log
        whatever the number of open tabs (one at a time; the others get the same page)."""
        if self.replayer is None:
            return _no_log()
        async with self._incidents_lock:
            seq, page = self._incidents
            if page is None or seq != self.log_seq():
                result = await self.replayer(incidents=True)
                page = _incidents_page(result.incidents or [])
                self._incidents = (result.log_last_seq, page)
        return HTMLResponse(page)

    async def version(self, request: Request) -> Response:
        vid: int = request.path_params["version"]
        return await self._timeline(f"timeline of v{vid}", [vid], [])

    async def engine(self, request: Request) -> Response:
        name: str = request.path_params["engine"]
        return await self._timeline(f"timeline of engine {name}", [], [name])

    async def _timeline(self, title: str, versions: list[int], engines: list[str]) -> Response:
        from tools.render import subject_views

        if self.replayer is None:
            return _no_log()
        result = await self.replayer(versions=versions, engines=engines)
        subjects: list[int | str] = [*versions, *engines]
        views = [view for subject in subjects for view in subject_views(result, subject)]
        return HTMLResponse(_rich_html(title, views, back="../../ui"))


def _incidents_page(found: list[Incident]) -> str:
    from tools.render import incidents_view

    last = sorted(found, key=lambda i: (i.at, i.seqs))[-INCIDENTS_SHOWN:]
    title = f"the last {len(last)} of {len(found)} incidents" if found else "incidents"
    return _rich_html(title, [incidents_view(last, title=title)])


def _no_log() -> Response:
    return HTMLResponse("<p>no log here: the timelines are served by loraledger serve</p>", 404)
