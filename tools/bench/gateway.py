"""Benchmark: what the OpenAI-compatible pinning gateway adds in front of an engine.

Three cases, driven the same way, in one run, against one stub engine that answers at once in
a process of its own (``tools/bench/stub_engine.py``: vLLM's OpenAI and LoRA API, no torch):

* **(a) direct** -- the client talks to the stub: the reference of every ratio;
* **(b) bare proxy** -- ``tools/bench/proxy.py`` in its own process: Starlette + uvicorn + an
  httpx streaming pass-through, the stack the gateway is built on, doing nothing else;
* **(c) gateway** -- ``loraledger serve`` in its own process with the stub as its vLLM engine,
  one adapter version published through it (``POST /versions``), driven on its OpenAI routes
  with ``model: "policy"`` (the deployment's alias) and an ``x-session-id`` per session, so
  every session's first turn binds durably and its later turns ride the binding. Every reply
  must carry ``x-loraledger-version``, the same one for every turn of a session. When serve has
  no OpenAI route (``GET /v1/models`` is 404) the case is reported as not available and (a) and
  (b) still run.

The workload is multi-turn chat sessions (3, 4 or 5 turns; each turn resends the conversation
so far, as an agent loop does), ``POST /v1/chat/completions``, for every case. Measures:

* *closed loop* at each concurrency (1, 32, 256 clients): N tasks, each running sessions one
  turn after another; throughput and time to first byte (from sending the request to the first
  body byte), p50/p99, and what (b) and (c) add over (a);
* *paced* ("at the load (b) sustains"): the three cases at one fixed arrival rate, a fraction
  (0.8) of the lowest closed-loop throughput (b) reached at any concurrency, turns of sessions
  arriving open-loop (a session's next turn becomes eligible when its previous one answered),
  sent by single-connection httpx clients reused from a free list. Closed-loop latency at high
  concurrency is mostly queueing (Little's law), so the latency targets are judged here;
* *SSE*: ``stream: true`` with a fixed number of chunks spaced by the stub; each chunk's text is
  the stub's monotonic clock when it wrote it, so the client measures every chunk's delivery
  latency; per-chunk p99 of (b)/(c) minus (a). Usage is not asked for, so no usage chunk may
  arrive (the gateway asks the engine for it and must strip it).

CPU seconds of every process (client included, from ``/proc``) are reported per request: on a
small machine the client competes with the servers, and its cost against (a) says how much of
the measurement is the client's.

Run ``loraledger bench gateway`` (``python -m tools.bench.gateway``; ``--json``).

One module past 800 lines because it is one measurement: the processes it starts, the workload
and the figures are read together to see that the three cases are driven alike. What runs in a
process of its own (the stub engine, the bare proxy) has a module of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec

from tools.exitcodes import Exit, ToolError

CHAT = "/v1/chat/completions"
ALIAS = "policy"  # serve's default --prefix: the deployment's alias on the OpenAI routes
TOKEN = "bench-gateway-token"
UNAVAILABLE = "(c) not available: serve has no OpenAI route"
TARGETS = {
    "throughput_c_over_b": 0.8,
    "added_p50_ms": 2.0,
    "added_p99_ms": 13.0,
    "sse_added_p99_ms": 1.0,
}
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_decode = msgspec.json.decode


# --- processes ------------------------------------------------------------------------------


@dataclass
class Started:
    role: str
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid


class Processes:
    """Every process the benchmark starts, stopped by PID (SIGTERM, then SIGKILL after a grace
    period) and reaped on exit, whatever happened in between."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.started: list[Started] = []
        self.exits: dict[int, int | None] = {}

    def start(self, role: str, argv: Sequence[str], env: dict[str, str] | None = None) -> Started:
        log = self.workdir / f"{role}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                cwd=str(Path(__file__).resolve().parents[1]),
            )
        started = Started(role, proc, log)
        self.started.append(started)
        return started

    def stop_all(self) -> None:
        for s in reversed(self.started):
            if s.proc.poll() is None:
                s.proc.send_signal(signal.SIGTERM)
        for s in reversed(self.started):
            try:
                s.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                s.proc.kill()
                s.proc.wait()
            self.exits[s.pid] = s.proc.returncode

    def report(self) -> list[dict[str, Any]]:
        return [
            {"role": s.role, "pid": s.pid, "exit": self.exits.get(s.pid, s.proc.poll())}
            for s in self.started
        ]


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` so far (Linux ``/proc``; ``None`` elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK
    except (OSError, IndexError, ValueError):
        return None


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system


async def _port_url(started: Started, port_file: Path, timeout: float = 60) -> str:
    with anyio.fail_after(timeout):
        while not await anyio.Path(port_file).exists():
            if started.proc.poll() is not None:
                raise ToolError(Exit.FAILED, f"{started.role} exited: {_tail(started.log)}")
            await anyio.sleep(0.05)
    port = (await anyio.Path(port_file).read_text()).strip()
    return f"http://127.0.0.1:{port}"


async def _serve_url(started: Started, timeout: float = 120) -> str:
    """The URL from serve's ``--json`` listening line (its stdout and log share the file)."""
    with anyio.fail_after(timeout):
        while True:
            text = await anyio.Path(started.log).read_text(errors="replace")
            for line in text.splitlines():
                if line.startswith("{") and '"listening"' in line:
                    return str(json.loads(line)["url"])
            if started.proc.poll() is not None:
                raise ToolError(Exit.FAILED, f"serve exited: {_tail(started.log)}")
            await anyio.sleep(0.1)


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"


# --- the workload ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """Where a case sends its requests and what it must see in every reply."""

    case: str
    url: str
    model: str
    headers: dict[str, str] = field(default_factory=dict)
    pinned: bool = False  # replies must carry x-loraledger-version, fixed per session


@dataclass(eq=False)  # identity: a session is a CapacityLimiter borrower
class Session:
    sid: str
    turns: int
    done: int = 0
    messages: list[dict[str, str]] = field(default_factory=list)
    version: str | None = None

    def __post_init__(self) -> None:
        self.messages.append({"role": "user", "content": f"session {self.sid}: turn 0"})


@dataclass
class Samples:
    """What one arm measured (times in ns)."""

    ttfb: list[int] = field(default_factory=list)
    ttfb_first_turn: list[int] = field(default_factory=list)
    chunk_latency: list[int] = field(default_factory=list)
    requests: int = 0
    errors: int = 0
    first_error: str | None = None
    unpinned: int = 0  # replies of a session that changed version (or named none)
    usage_chunks: int = 0  # usage chunks nobody asked for
    lag: list[int] = field(default_factory=list)  # paced: how late each request went out
    wall: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)


class Workload:
    def __init__(self, target: Target, tag: str, *, max_tokens: int, stream: bool) -> None:
        self.target = target
        self.tag = tag
        self.max_tokens = max_tokens
        self.stream = stream
        self.sessions = 0
        self.samples = Samples()

    def new_session(self) -> Session:
        self.sessions += 1
        return Session(f"{self.tag}-{self.sessions}", turns=3 + self.sessions % 3)

    async def turn(self, client: httpx.AsyncClient, session: Session) -> None:
        """One turn of ``session``: send, time the first body byte (and every SSE chunk),
        check the reply, extend the conversation."""
        t = self.target
        body = {"model": t.model, "messages": session.messages, "max_tokens": self.max_tokens}
        if self.stream:
            body["stream"] = True
        headers = {"x-session-id": session.sid, **t.headers}
        s = self.samples
        buf = bytearray()
        first = 0
        t0 = time.monotonic_ns()
        try:
            async with client.stream("POST", CHAT, json=body, headers=headers) as r:
                async for chunk in r.aiter_raw():
                    now = time.monotonic_ns()
                    if not first:
                        first = now
                    buf += chunk
                    if self.stream and r.status_code == 200:
                        self._chunks(buf, now)
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {bytes(buf[:300])!r}")
            if t.pinned:
                version = r.headers.get("x-loraledger-version")
                if version is None or (session.version not in (None, version)):
                    s.unpinned += 1
                session.version = version
            reply = "ok" if self.stream else _decode(bytes(buf))["choices"][0]["message"]["content"]
        except (httpx.HTTPError, RuntimeError, ValueError, KeyError, IndexError) as exc:
            s.errors += 1
            s.first_error = s.first_error or f"{t.case}: {exc!r}"[:400]
            session.done = session.turns  # abandon the session
            return
        s.requests += 1
        (s.ttfb_first_turn if session.done == 0 else s.ttfb).append(first - t0)
        session.done += 1
        session.messages.append({"role": "assistant", "content": reply})
        session.messages.append({"role": "user", "content": f"turn {session.done}"})

    def _chunks(self, buf: bytearray, now: int) -> None:
        """Consume the complete SSE events in ``buf``: each content chunk's latency is
        ``now`` minus the stub's clock written in it."""
        while (end := buf.find(b"\n\n")) >= 0:
            event = bytes(buf[:end])
            del buf[: end + 2]
            if not event.startswith(b"data: ") or event == b"data: [DONE]":
                continue
            chunk = _decode(event[6:])
            choices = chunk.get("choices") or []
            if not choices:
                if "usage" in chunk:
                    self.samples.usage_chunks += 1
                continue
            content = (choices[0].get("delta") or {}).get("content")
            if content and content.isdigit():
                self.samples.chunk_latency.append(now - int(content))


def _client(target: Target, pool: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=target.url,
        trust_env=False,
        timeout=httpx.Timeout(120.0),
        limits=httpx.Limits(max_connections=pool, max_keepalive_connections=pool),
    )


@contextmanager
def _cpu_meter(samples: Samples, pids: dict[str, int]) -> Iterator[None]:
    before = {role: cpu_seconds(pid) for role, pid in pids.items()}
    own = _own_cpu()
    t0 = time.perf_counter()
    yield
    samples.wall = time.perf_counter() - t0
    samples.cpu["client"] = _own_cpu() - own
    for role, pid in pids.items():
        b, a = before[role], cpu_seconds(pid)
        if a is not None and b is not None:
            samples.cpu[role] = a - b


async def closed_loop(
    target: Target,
    tag: str,
    *,
    concurrency: int,
    requests: int,
    max_tokens: int,
    stream: bool,
    pids: dict[str, int],
) -> Samples:
    """``concurrency`` tasks, each running sessions turn after turn, ``requests`` turns in all."""
    work = Workload(target, tag, max_tokens=max_tokens, stream=stream)
    left = requests

    async def task(client: httpx.AsyncClient) -> None:
        nonlocal left
        session = work.new_session()
        while left > 0:
            left -= 1
            if session.done >= session.turns:
                session = work.new_session()
            await work.turn(client, session)

    async with AsyncExitStack() as stack:
        # One client (one kept-alive connection) per simulated client: a shared pool of N
        # connections costs httpx several times more CPU per request at N = 256 (measured),
        # which would make the load generator, not the servers, the thing measured.
        clients = [await stack.enter_async_context(_client(target, 1)) for _ in range(concurrency)]
        with _cpu_meter(work.samples, pids):
            async with anyio.create_task_group() as tg:
                for client in clients:
                    tg.start_soon(task, client)
    return work.samples


async def paced(
    target: Target,
    tag: str,
    *,
    rate: float,
    requests: int,
    max_tokens: int,
    pids: dict[str, int],
    max_outstanding: int = 1024,
) -> Samples:
    """Open loop: turn ``i`` goes out at ``i / rate`` s, on a session whose previous turn has
    answered (a new session when none is waiting)."""
    work = Workload(target, tag, max_tokens=max_tokens, stream=False)
    ready: deque[Session] = deque()
    limiter = anyio.CapacityLimiter(max_outstanding)
    idle: list[httpx.AsyncClient] = []  # single-connection clients, reused (no shared pool)

    async def one(stack: AsyncExitStack, session: Session) -> None:
        client = idle.pop() if idle else await stack.enter_async_context(_client(target, 1))
        try:
            await work.turn(client, session)
        finally:
            idle.append(client)
            limiter.release_on_behalf_of(session)
        if session.done < session.turns:
            ready.append(session)

    async with AsyncExitStack() as stack:
        with _cpu_meter(work.samples, pids):
            async with anyio.create_task_group() as tg:
                start = time.monotonic()
                for i in range(requests):
                    due = start + i / rate
                    delay = due - time.monotonic()
                    if delay > 0:
                        await anyio.sleep(delay)
                    session = ready.popleft() if ready else work.new_session()
                    await limiter.acquire_on_behalf_of(session)
                    work.samples.lag.append(int((time.monotonic() - due) * 1e9))
                    tg.start_soon(one, stack, session)
    return work.samples


# --- figures --------------------------------------------------------------------------------


def _pct(values: Sequence[int], q: float) -> float | None:
    """The ``q``-quantile in ms (nearest rank), ``None`` without samples."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))] / 1e6


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _minus(x: float | None, y: float | None) -> float | None:
    return None if x is None or y is None else round(x - y, 3)


def _merge(rounds: list[Samples]) -> tuple[Samples, float]:
    """All rounds' samples pooled, and the median throughput of the rounds."""
    out = Samples()
    for r in rounds:
        out.ttfb += r.ttfb
        out.ttfb_first_turn += r.ttfb_first_turn
        out.chunk_latency += r.chunk_latency
        out.lag += r.lag
        out.requests += r.requests
        out.errors += r.errors
        out.first_error = out.first_error or r.first_error
        out.unpinned += r.unpinned
        out.usage_chunks += r.usage_chunks
        out.wall += r.wall
        for k, v in r.cpu.items():
            out.cpu[k] = out.cpu.get(k, 0.0) + v
    rps = statistics.median(r.requests / r.wall for r in rounds if r.wall > 0)
    return out, rps


def _cpu_us(s: Samples) -> dict[str, int]:
    n = max(s.requests + s.errors, 1)
    return {f"cpu_us_per_req_{k}": round(v / n * 1e6) for k, v in sorted(s.cpu.items())}


# --- the run --------------------------------------------------------------------------------


@asynccontextmanager
async def _fleet(
    workdir: Path, *, chunk_interval_ms: float, want_gateway: bool
) -> AsyncIterator[tuple[Processes, dict[str, str], dict[str, Any]]]:
    """Start the stub, the proxy and serve (each in its own process); publish one version
    through serve. Yields the processes, the URLs by role and what the publication did."""
    procs = Processes(workdir)
    try:
        stub_port = workdir / "stub.port"
        stub = procs.start(
            "stub",
            [
                "-m",
                "tools.bench.stub_engine",
                "--port-file",
                str(stub_port),
                "--chunk-interval-ms",
                str(chunk_interval_ms),
            ],
        )
        urls = {"stub": await _port_url(stub, stub_port)}
        proxy_port = workdir / "proxy.port"
        proxy = procs.start(
            "proxy",
            ["-m", "tools.bench.proxy", "--upstream", urls["stub"], "--port-file", str(proxy_port)],
        )
        urls["proxy"] = await _port_url(proxy, proxy_port)
        publish: dict[str, Any] = {}
        if want_gateway:
            serve = procs.start(
                "serve",
                [
                    "-m",
                    "tools.cli",
                    "serve",
                    "--db",
                    str(workdir / "ledger.db"),
                    "--port",
                    "0",
                    "--engine",
                    f"e0=vllm:{urls['stub']}",
                    "--served-model",
                    "tiny",
                    "--deployment",
                    "bench",
                    "--prefix",
                    ALIAS,
                    "--json",
                ],
                env={"LORALEDGER_TOKEN": TOKEN},
            )
            urls["serve"] = await _serve_url(serve)
            publish = await _publish(urls["serve"], urls["stub"], workdir)
        yield procs, urls, publish
    finally:
        procs.stop_all()


async def _publish(serve_url: str, stub_url: str, workdir: Path) -> dict[str, Any]:
    """One version through serve's ``POST /versions`` (the stub holds it after), and whether
    serve has the OpenAI routes."""
    from engines.artifacts import serialize_safetensors
    from engines.local.tinymodel import make_adapter

    config, tensors = make_adapter(1)
    adapter = workdir / "adapter-v1"
    adapter.mkdir(exist_ok=True)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    (adapter / "adapter_model.safetensors").write_bytes(serialize_safetensors(tensors))
    auth = {"authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(trust_env=False, timeout=120) as http:
        t0 = time.perf_counter()
        r = await http.post(
            f"{serve_url}/versions",
            headers=auth,
            json={"version_id": 1, "adapter_dir": str(adapter)},
        )
        seconds = time.perf_counter() - t0
        if r.status_code != 200:
            raise ToolError(Exit.FAILED, f"publishing through serve failed: {r.text[:500]}")
        held = [
            c["id"]
            for c in (await http.get(f"{stub_url}/v1/models")).json()["data"]
            if c.get("parent")
        ]
        models = await http.get(f"{serve_url}/v1/models", headers=auth)
    return {
        "version_id": 1,
        "status": r.json().get("status"),
        "publish_ms": round(seconds * 1e3, 1),
        "stub_holds": held,
        "openai_routes": models.status_code not in (404, 405),
    }


@dataclass(frozen=True)
class Settings:
    concurrencies: tuple[int, ...] = (1, 32, 256)
    requests: tuple[tuple[int, int], ...] = ((1, 500), (32, 2000), (256, 2000))
    rounds: int = 3
    paced_seconds: float = 5.0
    paced_fraction: float = 0.8
    sse_concurrencies: tuple[int, ...] = (1, 32)
    sse_requests: int = 400
    sse_chunks: int = 16
    chunk_interval_ms: float = 20.0  # a decode step of a mid-sized model
    max_tokens: int = 16
    gateway: bool = True

    def requests_at(self, concurrency: int) -> int:
        return dict(self.requests).get(concurrency, 1000)


async def bench_gateway(*, workdir: str | None = None, **options: Any) -> dict[str, Any]:
    """Run every measure (options: the fields of :class:`Settings`; ``requests`` may be a
    ``{concurrency: turns}`` mapping). ``gateway=False`` skips (c) altogether."""
    if isinstance(options.get("requests"), dict):
        options["requests"] = tuple(sorted(options["requests"].items()))
    settings = Settings(**options)
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
            return await _run(Path(tmp), settings)
    return await _run(Path(workdir), settings)


async def _run(workdir: Path, p: Settings) -> dict[str, Any]:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    async with _fleet(workdir, chunk_interval_ms=p.chunk_interval_ms, want_gateway=p.gateway) as (
        procs,
        urls,
        publish,
    ):
        pids = {s.role: s.pid for s in procs.started}
        targets = {
            "a": Target("a", urls["stub"], "tiny"),
            "b": Target("b", urls["proxy"], "tiny"),
        }
        c_status = "not run (--no-gateway)"
        if p.gateway:
            c_status = "available" if publish["openai_routes"] else UNAVAILABLE
            if publish["openai_routes"]:
                targets["c"] = Target(
                    "c",
                    urls["serve"],
                    ALIAS,
                    pinned=True,
                    headers={"authorization": f"Bearer {TOKEN}"},
                )
        # Warm-up, untimed: imports, first connections, first binds.
        for t in targets.values():
            await closed_loop(
                t,
                f"warm-{t.case}",
                concurrency=4,
                requests=40,
                max_tokens=p.max_tokens,
                stream=False,
                pids={},
            )
        closed: list[dict[str, Any]] = []
        sustained_b = float("inf")
        for conc in p.concurrencies:
            runs: dict[str, list[Samples]] = {k: [] for k in targets}
            for rnd in range(p.rounds):
                for k, t in targets.items():
                    runs[k].append(
                        await closed_loop(
                            t,
                            f"cl{conc}-r{rnd}-{k}",
                            concurrency=conc,
                            requests=p.requests_at(conc),
                            max_tokens=p.max_tokens,
                            stream=False,
                            pids=pids,
                        )
                    )
            merged = {k: _merge(v) for k, v in runs.items()}
            ref_s, ref_rps = merged["a"]
            sustained_b = min(sustained_b, merged["b"][1])
            for k, (s, rps) in merged.items():
                row: dict[str, Any] = {
                    "concurrency": conc,
                    "case": k,
                    "req_per_s": round(rps),
                    "x_of_a": round(rps / ref_rps, 3),
                    "x_of_b": round(rps / merged["b"][1], 3) if k == "c" else None,
                    "ttfb_p50_ms": _ms(_pct(s.ttfb, 0.5)),
                    "ttfb_p99_ms": _ms(_pct(s.ttfb, 0.99)),
                    "added_p50_ms": _minus(_pct(s.ttfb, 0.5), _pct(ref_s.ttfb, 0.5)),
                    "added_p99_ms": _minus(_pct(s.ttfb, 0.99), _pct(ref_s.ttfb, 0.99)),
                    "first_turn_p50_ms": _ms(_pct(s.ttfb_first_turn, 0.5)),
                    "errors": s.errors,
                    **_cpu_us(s),
                }
                if k == "c":
                    row["unpinned"] = s.unpinned
                closed.append(row)
        # Paced, at a fraction of what (b) sustained at every concurrency.
        rate = max(sustained_b * p.paced_fraction, 1.0)
        n_paced = max(int(rate * p.paced_seconds), 20)
        paced_rows: list[dict[str, Any]] = []
        paced_s: dict[str, Samples] = {}
        for k, t in targets.items():
            paced_s[k] = await paced(
                t, f"paced-{k}", rate=rate, requests=n_paced, max_tokens=p.max_tokens, pids=pids
            )
        for k, s in paced_s.items():
            all_ttfb = s.ttfb + s.ttfb_first_turn
            ref = paced_s["a"].ttfb + paced_s["a"].ttfb_first_turn
            paced_rows.append(
                {
                    "case": k,
                    "offered_req_per_s": round(rate),
                    "achieved_req_per_s": round(s.requests / s.wall) if s.wall else None,
                    "ttfb_p50_ms": _ms(_pct(all_ttfb, 0.5)),
                    "ttfb_p99_ms": _ms(_pct(all_ttfb, 0.99)),
                    "added_p50_ms": _minus(_pct(all_ttfb, 0.5), _pct(ref, 0.5)),
                    "added_p99_ms": _minus(_pct(all_ttfb, 0.99), _pct(ref, 0.99)),
                    "send_lag_p99_ms": _ms(_pct(s.lag, 0.99)),
                    "errors": s.errors,
                    **_cpu_us(s),
                }
            )
        # SSE: per-chunk delivery latency.
        sse_rows: list[dict[str, Any]] = []
        for conc in p.sse_concurrencies:
            sse_s = {
                k: await closed_loop(
                    t,
                    f"sse{conc}-{k}",
                    concurrency=conc,
                    requests=p.sse_requests,
                    max_tokens=p.sse_chunks,
                    stream=True,
                    pids=pids,
                )
                for k, t in targets.items()
            }
            ref_c = sse_s["a"].chunk_latency
            for k, s in sse_s.items():
                sse_rows.append(
                    {
                        "concurrency": conc,
                        "case": k,
                        "streams": s.requests,
                        "chunks": len(s.chunk_latency),
                        "chunk_p50_ms": _ms(_pct(s.chunk_latency, 0.5)),
                        "chunk_p99_ms": _ms(_pct(s.chunk_latency, 0.99)),
                        "added_chunk_p50_ms": _minus(_pct(s.chunk_latency, 0.5), _pct(ref_c, 0.5)),
                        "added_chunk_p99_ms": _minus(
                            _pct(s.chunk_latency, 0.99), _pct(ref_c, 0.99)
                        ),
                        "unasked_usage_chunks": s.usage_chunks,
                        "errors": s.errors,
                    }
                )
    errors = [r for r in closed + paced_rows + sse_rows if r["errors"]]
    return {
        "load_average_at_start": load,
        "settings": {
            "concurrencies": list(p.concurrencies),
            "requests_per_arm": {str(k): v for k, v in p.requests},
            "rounds": p.rounds,
            "max_tokens": p.max_tokens,
            "paced": f"{p.paced_fraction} x the lowest (b) closed-loop throughput, "
            f"{p.paced_seconds} s per case",
            "sse": f"{p.sse_chunks} chunks {p.chunk_interval_ms} ms apart, "
            f"{p.sse_requests} streams per arm",
            "client": "one process; closed loop: one httpx.AsyncClient (one kept-alive "
            "connection) per simulated client; paced: such clients reused from a free list",
        },
        "cases": {
            "a": f"direct to the stub ({urls['stub']})",
            "b": "bare pass-through proxy: Starlette + uvicorn + httpx streaming",
            "c": c_status
            if c_status != "available"
            else "loraledger serve, OpenAI routes, pinned multi-turn sessions",
        },
        "gateway": c_status,
        "publish": publish or None,
        "closed_loop": closed,
        "paced": paced_rows,
        "sse": sse_rows,
        "verdicts": _verdicts(closed, paced_rows, sse_rows, c_status),
        "errors": [f"{r['case']}: {r['errors']}" for r in errors] or None,
        "processes": procs.report(),
    }


def _verdicts(
    closed: list[dict[str, Any]],
    paced_rows: list[dict[str, Any]],
    sse_rows: list[dict[str, Any]],
    c_status: str,
) -> list[dict[str, Any]]:
    """One row per target; (b)'s figures against the same targets say what the stack alone
    costs (the floor the gateway cannot go under)."""
    out: list[dict[str, Any]] = []

    def verdict(case: str, ok: bool | None) -> str:
        if case == "c" and c_status != "available":
            return "pending: " + c_status
        if case == "b":
            return "reference" if ok is None else ("within" if ok else "over")
        return "met" if ok else "missed"

    def add(target: str, case: str, measured: Any, ok: bool | None) -> None:
        out.append(
            {"target": target, "case": case, "measured": measured, "verdict": verdict(case, ok)}
        )

    c_closed = [r for r in closed if r["case"] == "c"]
    ratios = [r["x_of_b"] for r in c_closed]
    add(
        f"throughput (c) >= {TARGETS['throughput_c_over_b']}x (b), every concurrency",
        "c",
        ", ".join(f"{r['concurrency']}: {r['x_of_b']}x" for r in c_closed) or None,
        bool(ratios) and min(ratios) >= TARGETS["throughput_c_over_b"],
    )
    for case in ("b", "c"):
        row = next((r for r in paced_rows if r["case"] == case), None)
        p50 = row["added_p50_ms"] if row else None
        p99 = row["added_p99_ms"] if row else None
        add(
            f"added TTFB p50 <= {TARGETS['added_p50_ms']} ms over (a), paced",
            case,
            p50,
            p50 is not None and p50 <= TARGETS["added_p50_ms"],
        )
        add(
            f"added TTFB p99 <= {TARGETS['added_p99_ms']} ms over (a), paced",
            case,
            p99,
            p99 is not None and p99 <= TARGETS["added_p99_ms"],
        )
        sse = [r["added_chunk_p99_ms"] for r in sse_rows if r["case"] == case]
        worst = max((x for x in sse if x is not None), default=None)
        add(
            f"SSE added p99 per chunk <= {TARGETS['sse_added_p99_ms']} ms, worst concurrency",
            case,
            worst,
            worst is not None and worst <= TARGETS["sse_added_p99_ms"],
        )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.gateway", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print every figure as JSON")
    args = parser.parse_args(argv)
    from tools.bench.runner import BENCHES, machine, view
    from tools.output import emit, stdout_console

    kwargs: dict[str, Any] = dict(BENCHES["gateway"][3]) if args.quick else {"rounds": args.rounds}
    result = {
        "bench": "gateway",
        "quick": args.quick,
        **anyio.run(lambda: bench_gateway(**kwargs)),
        "machine": machine(),
    }
    if args.json:
        emit(result)
    else:
        stdout_console().print(view(result))


if __name__ == "__main__":
    main()
