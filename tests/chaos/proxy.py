"""The chaos run's network: one fault-injecting TCP proxy per link, switched at runtime.

Every link of the cluster (``client->gw0``, ``gw0->serve``, ``gw0->e1``, ``serve->e1``,
``serve->agent`` ...) goes through a :class:`Proxy`: the caller is given the proxy's port
instead of the server's. The proxy relays bytes both ways and keeps connections open as long
as both ends do (gateways pool keep-alive connections), so a fault set on a link reaches the
connections already open on it, as on a real network, and not only the next one.

A fault is decided per chunk from the link's current :class:`Fault`, read when the chunk
arrives, so the test's event loop switches it with a plain assignment, no locking:

* ``pass``: relay both ways;
* ``delay(seconds)``: each chunk, each direction, waits that long before it is sent on;
* ``drop``: a new connection is reset at once, before anything reaches the server (the caller
  sees its connection lost; the server never sees it). Open connections are left alone;
* ``reset_before``: a request's bytes arrive and the connection is reset before they are
  forwarded: the server never saw the request;
* ``reset_after``: the request is forwarded and the connection is reset when the server's
  first reply bytes come back, which are never delivered: the request ran, its answer is lost;
* ``black_hole``: bytes are read and thrown away, nothing is forwarded nor answered (a
  half-open connection); a new connection is accepted and swallowed the same way. A
  connection that lost bytes to it stays stuck after the link heals (the bytes are gone; only
  the caller's own timeout ends it), while connections that sent nothing meanwhile carry on.

A link mirrors its server's death: it holds one idle connection to the server, which the
kernel closes as the process dies, and while the server refuses connections the link stops
listening, so callers get the refusal they would get without it (see :meth:`Proxy.serve`);
a server sees that idle connection as one more client. A stopped process (SIGSTOP) still
accepts and answers nothing, through the link as without it.

A :class:`Network` names the links, applies faults by name, partitions a process (every link
with it at either end black-holed at once) and heals; it counts the faults it was told to
apply, by kind, for the run's summary. Each proxy also counts what its faults hit
(:attr:`Proxy.hits`) and the request lines it forwarded (:attr:`Proxy.forwarded`): evidence
of whether a request reached the server, independent of the code under test.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any, Literal

import anyio
import anyio.abc
import msgspec
from anyio.abc import TaskStatus

from tests.support.relay import listening, pipe, reset_on_close

FaultKind = Literal["pass", "delay", "drop", "reset_before", "reset_after", "black_hole"]
FAULT_KINDS: tuple[FaultKind, ...] = (
    "pass",
    "delay",
    "drop",
    "reset_before",
    "reset_after",
    "black_hole",
)
# How often a link whose server refused connections tries it again (then listens again).
REFUSING_POLL_S = 0.05
# The first bytes of an HTTP/1.1 request line: a chunk starting with one is a request's head.
_METHODS = (b"GET ", b"POST ", b"PUT ", b"DELETE ", b"HEAD ", b"PATCH ")


class Fault(msgspec.Struct, frozen=True):
    """What a link does to its traffic now (see the module docstring). ``seconds``: the
    added latency per chunk of a ``delay``, 0 for every other kind."""

    kind: FaultKind = "pass"
    seconds: float = 0.0

    @staticmethod
    def passing() -> Fault:
        return Fault()

    @staticmethod
    def delay(seconds: float) -> Fault:
        if not seconds >= 0:
            raise ValueError(f"a delay is a number of seconds >= 0, not {seconds!r}")
        return Fault("delay", seconds)

    @staticmethod
    def drop() -> Fault:
        return Fault("drop")

    @staticmethod
    def reset_before() -> Fault:
        return Fault("reset_before")

    @staticmethod
    def reset_after() -> Fault:
        return Fault("reset_after")

    @staticmethod
    def black_hole() -> Fault:
        return Fault("black_hole")


class _Connection:
    """One relayed connection's fault state: ``stuck`` once a black hole swallowed its bytes
    (for good: they are lost), ``armed`` once a ``reset_after`` forwarded a request (the
    reply's first bytes reset it)."""

    def __init__(self, client: anyio.abc.SocketStream, upstream: anyio.abc.SocketStream) -> None:
        self.client = client
        self.upstream = upstream
        self.stuck = False
        self.armed = False
        self.scope = anyio.CancelScope()

    def cut(self) -> None:
        """Reset both ends (each sees its connection lost, not a clean end) and stop relaying."""
        reset_on_close(self.client)
        reset_on_close(self.upstream)
        self.scope.cancel()


class Proxy:
    """One link's proxy: listens on a loopback port the OS picks, relays each connection to
    ``target`` (``(host, port)``, changed by :meth:`retarget` when the server restarts
    elsewhere) and applies :attr:`fault`.

    ``hits`` counts what the faults acted on, by kind: connections dropped, reset (before or
    after), swallowed by a black hole, chunks delayed, and ``refused``: the times the link
    stopped listening because its server refused (see :meth:`serve`). ``forwarded`` lists
    the request lines it sent on to the server (``b"POST /generate HTTP/1.1"``), read from
    chunks that start a request's head."""

    def __init__(self, name: str, host: str, port: int) -> None:
        self.name = name
        self.target = (host, port)
        self.fault = Fault()
        self.hits: Counter[str] = Counter()
        self.forwarded: list[bytes] = []
        self.port: int | None = None
        self._refusing = anyio.Event()  # set: the server refused, stop listening until it is up
        self._watch_scope = anyio.CancelScope()  # the current watch; cancelled by a retarget

    def retarget(self, host: str, port: int) -> None:
        """Later connections go to ``host:port``; open ones stay where they are. The watch
        of the server (:meth:`_watch_server`) moves there at once."""
        self.target = (host, port)
        self._watch_scope.cancel()

    async def serve(self, *, task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen, report the port through ``task_status``, relay until cancelled.

        While the server refuses connections (it died, or is restarting), so does the link:
        a caller must see the refusal a dead server gives (a connection refused provably sent
        nothing; gateways try the next holder), not an accepted connection reset, which reads
        as a request that may have run. The proxy cannot refuse a connection it already
        accepted, so it watches the server (:meth:`_watch_server`) and closes the listener
        the moment the server's process dies; a caller that comes in before it noticed (or
        finds the server refusing first) sees a reset. The listener stays closed until the
        server accepts again, and reopens on the same port (tried again while something else
        briefly holds it: an outgoing connection may be given that port)."""
        started = False
        while True:
            self._refusing = anyio.Event()
            try:
                async with listening(self._relay, self.port or 0) as port:
                    self.port = port
                    if not started:
                        task_status.started(port)
                        started = True
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(self._watch_server)
                        await self._refusing.wait()
                        tg.cancel_scope.cancel()
            except OSError:
                if not started:
                    raise
                await anyio.sleep(REFUSING_POLL_S)
                continue
            self.hits["refused"] += 1
            await self._until_the_server_accepts()

    async def _watch_server(self) -> None:
        """Hold one idle connection to the server: the kernel closes it as the server's
        process dies (SIGKILL included), long before a caller would find out. A closed one is
        the server dying or dropping an idle connection; a new connection tells which: it is
        refused (set :attr:`_refusing`) or it becomes the next watch. A stopped process
        (SIGSTOP) closes nothing and still accepts: the link stays open, as the network would."""
        while True:
            target = self.target
            try:
                watch = await anyio.connect_tcp(*target)
            except OSError:
                self._refusing.set()
                return
            async with watch:
                with (
                    anyio.CancelScope() as self._watch_scope,
                    contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError),
                ):
                    while target == self.target:  # else retargeted while connecting
                        await watch.receive()  # a server sends nothing unasked but its close

    async def _until_the_server_accepts(self) -> None:
        while True:
            try:
                probe = await anyio.connect_tcp(*self.target)
            except OSError:
                await anyio.sleep(REFUSING_POLL_S)
                continue
            await probe.aclose()
            return

    async def _relay(self, client: anyio.abc.SocketStream) -> None:
        async with client:
            fault = self.fault
            if fault.kind == "drop":
                self.hits["drop"] += 1
                reset_on_close(client)
                return
            if fault.kind == "black_hole":
                self.hits["black_hole"] += 1
                await pipe(client, client, _swallow)
                return
            try:
                upstream = await anyio.connect_tcp(*self.target)
            except OSError:  # the server is down: this caller sees a reset, later ones a refusal
                reset_on_close(client)
                self._refusing.set()
                return
            async with upstream:
                conn = _Connection(client, upstream)
                with conn.scope:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(self._one_way, conn, client, upstream, True)
                        tg.start_soon(self._one_way, conn, upstream, client, False)

    async def _one_way(
        self,
        conn: _Connection,
        source: anyio.abc.SocketStream,
        sink: anyio.abc.SocketStream,
        outbound: bool,
    ) -> None:
        async def before(chunk: bytes) -> bytes | None:
            return await self._apply(conn, chunk, outbound=outbound)

        await pipe(source, sink, before)
        conn.scope.cancel()  # one end closed: close the other (both are closed on the way out)

    async def _apply(self, conn: _Connection, chunk: bytes, *, outbound: bool) -> bytes | None:
        """The chunk to send on now (``None``: nothing), after the link's current fault."""
        if conn.stuck:
            return None
        fault = self.fault
        if fault.kind == "black_hole":
            conn.stuck = True
            self.hits["black_hole"] += 1
            return None
        if fault.kind == "delay":
            self.hits["delay"] += 1
            await anyio.sleep(fault.seconds)
        if outbound:
            if fault.kind == "reset_before":
                self.hits["reset_before"] += 1
                conn.cut()
                return None
            if fault.kind == "reset_after":
                conn.armed = True
            if chunk.startswith(_METHODS):
                self.forwarded.append(chunk.split(b"\r\n", 1)[0])
        elif conn.armed:
            self.hits["reset_after"] += 1
            conn.cut()
            return None
        return chunk


async def _swallow(chunk: bytes) -> None:
    """A black hole's answer to every chunk: nothing, ever."""
    return None


def link_ends(link: str) -> tuple[str, str]:
    """``(caller, server)`` of a link's name ``CALLER->SERVER``; a malformed name is refused."""
    caller, arrow, server = link.partition("->")
    if not arrow or not caller or not server or "->" in server:
        raise ValueError(f"a link is named CALLER->SERVER (e.g. gw0->serve), not {link!r}")
    return caller, server


class Network:
    """The named links of a run, each a :class:`Proxy`, all stopped on exit.

    ``counts`` are the faults applied through it, by kind (``{"delay": 3, "partition": 1}``):
    each :meth:`set` of a fault other than ``pass`` counts one, and each :meth:`partition`
    counts one ``partition`` (not one per link it cut). ``applied`` is every change of a
    link's fault, heals included, as ``(loop time, link, kind)``: the network's part of a
    run's history. Call its methods from the event loop
    that entered it; they take effect on the next chunk of every connection of the link."""

    def __init__(self) -> None:
        self.proxies: dict[str, Proxy] = {}
        self.counts: Counter[str] = Counter()
        self.applied: list[tuple[float, str, FaultKind]] = []
        self._tg: anyio.abc.TaskGroup | None = None

    async def __aenter__(self) -> Network:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        return await self._tg.__aexit__(*exc)

    async def link(self, name: str, host: str, port: int) -> int:
        """A proxy for link ``name`` (``CALLER->SERVER``) in front of ``host:port``; returns
        the port the caller must be given instead."""
        link_ends(name)
        if name in self.proxies:
            raise ValueError(f"link {name} exists already (retarget it instead)")
        if self._tg is None:
            raise RuntimeError("a Network makes links only inside `async with Network()`")
        proxy = Proxy(name, host, port)
        self.proxies[name] = proxy
        started: int = await self._tg.start(proxy.serve)
        return started

    def retarget(self, name: str, host: str, port: int) -> None:
        """Link ``name``'s server restarted at ``host:port``: later connections go there."""
        self.proxies[name].retarget(host, port)

    def set(self, name: str, fault: Fault) -> None:
        self._apply(name, fault)
        if fault.kind != "pass":
            self.counts[fault.kind] += 1

    def heal(self, name: str) -> None:
        self.set(name, Fault.passing())

    def links_of(self, process: str) -> list[str]:
        """The links with ``process`` at either end, in the order they were made."""
        return [name for name in self.proxies if process in link_ends(name)]

    def partition(self, process: str, fault: Fault | None = None) -> list[str]:
        """Cut ``process`` off from the rest: every link of it gets ``fault`` (a black hole
        unless told: half-open, the way a partition looks to both sides) at once. Returns the
        links cut; :meth:`heal_all` (or :meth:`heal` of each) ends it."""
        cut = self.links_of(process)
        if not cut:
            raise ValueError(f"no link has {process!r} at either end: nothing to partition")
        fault = fault or Fault.black_hole()
        if fault.kind == "pass":
            raise ValueError("a partition needs a fault that cuts (black_hole or drop)")
        for name in cut:
            self._apply(name, fault)
        self.counts["partition"] += 1
        return cut

    def heal_all(self) -> None:
        for name in self.proxies:
            self._apply(name, Fault.passing())

    def _apply(self, name: str, fault: Fault) -> None:
        self.proxies[name].fault = fault
        self.applied.append((anyio.current_time(), name, fault.kind))
