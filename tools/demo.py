"""``loraledger demo``: the whole system, end to end, in about a minute on 2 cores.

What runs (all real: a SQLite ledger on disk, two local engines running a tiny transformer with
peft adapters, each served over HTTP on loopback, the ``ControlPlane`` with its reclaim driver
and reconciler, and the OpenAI routes of the gateway, one loopback server per rollout worker
(each its own owner with a lease) writing provenance). The rollout workers are what users run:
the official ``openai`` client (``AsyncOpenAI``) with ``base_url`` on the gateway and the
session in ``x-session-id``; the embedded Python gateway (``SessionBinder.generate``) stays for
in-process use (docs/sessions.md):

1. a trainer publishes v1 through the trainer API;
2. waves of multi-turn sessions start on several rollout workers; each session binds on
   its first generation and keeps that version (and, by sticky routing, its engine and prefix
   cache) for every later turn (tool waits between turns);
3. while a wave generates, the trainer publishes the next version (generation never pauses):
   new sessions bind to it, running ones stay pinned to theirs;
4. in the middle, engine e1 is restarted: the reconciler notices the new incarnation, reloads
   the versions still needed and only then routes to it again (requests that were on it fail
   ``AMBIGUOUS_DISPATCH``, never resent by the gateway, and the rollout retries them as new
   requests);
5. as the last session of an old version is released (``POST /v1/sessions/{id}/release``), the
   reclaim driver unloads it everywhere;
6. the story is then told **from the log** (``tools/story.py``), with the commands to try on it.

``--quick`` is the same story, smaller (the CI test runs it). ``--engine vllm`` needs the real
vLLM CPU engine venv (``engines/vllm_env.sh``); see :func:`check_vllm`.
"""

from __future__ import annotations

import os
import random
import time
import warnings
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from tools.exitcodes import Exit, ToolError
from tools.logconfig import get_logger

if TYPE_CHECKING:
    from engines.testing import RestartableEngine
    from publisher.core.ledger import Ledger

log = get_logger("loraledger.demo")

# Refusals by the rules: a retry would only repeat them (anything else is retried as a new
# request: NO_ROUTE, AMBIGUOUS_DISPATCH, an engine's refusal during its restart).
NOT_RETRIED = frozenset(
    {
        "VERSION_NOT_BOUND",
        "SESSION_CLOSED",
        "LEASE_EXPIRED",
        "UNAUTHORIZED",
        "WRITES_DISABLED",
        "INVALID_INPUT",
    }
)
MAX_TRIES = 40
TOKEN = "demo-token"  # the gateways listen on loopback only; the OpenAI routes need one
WORDS = ("search", "read", "compute", "write", "check", "plan", "open", "list", "sum", "test")


class DemoConfig(msgspec.Struct, frozen=True, kw_only=True):
    workers: int  # rollout workers (owners)
    sessions: int  # sessions per worker per wave
    waves: int  # one wave per published version (the last version gets no wave)
    turns: int  # generations per session
    tokens: int  # tokens per generation
    think_s: float  # longest tool wait between two turns
    train_s: float  # the trainer's time between two publications
    capacity: int = 4
    seed: int = 7


FULL = DemoConfig(workers=4, sessions=4, waves=5, turns=6, tokens=16, think_s=2.0, train_s=5.0)
QUICK = DemoConfig(workers=2, sessions=3, waves=2, turns=3, tokens=4, think_s=0.4, train_s=0.2)


class DemoStats(msgspec.Struct, kw_only=True):
    """What the rollout side saw (not in the log: the log records decisions, not retries)."""

    generations: int = 0
    retried: dict[str, int] = msgspec.field(default_factory=dict)
    publications: list[dict[str, Any]] = msgspec.field(default_factory=list)
    wall_s: float = 0.0


class DemoRun(msgspec.Struct, frozen=True, kw_only=True):
    directory: str
    log: str
    provenance: str
    plot: str | None
    stats: DemoStats


def new_run_dir(base: Path = Path("demo-runs")) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    for n in range(1000):
        candidate = base / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            candidate.mkdir(parents=True)
            return candidate
        except FileExistsError:
            continue
    raise ToolError(Exit.FAILED, f"cannot create a fresh run folder under {base}")


def prepare_dir(directory: Path | None) -> Path:
    """A fresh folder (absolute: engine servers read artifacts from it by path); a demo never
    appends to someone else's ledger."""
    if directory is None:
        return new_run_dir().resolve()
    if directory.exists() and not directory.is_dir():
        raise ToolError(Exit.USAGE, f"--dir {directory} is a file: give a new or empty folder")
    if directory.exists() and any(directory.iterdir()):
        raise ToolError(Exit.USAGE, f"{directory} is not empty: give a new or empty folder")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file on the way, no permission, a read-only mount
        raise ToolError(
            Exit.FAILED, f"cannot create --dir {directory}: {exc.strerror or exc}"
        ) from None
    return directory.resolve()


def check_vllm() -> Path:
    """The real vLLM engine venv's interpreter, checked by ``engines/vllm_env.sh`` (reused, not
    reimplemented: it pins the CPU build and verifies the install). Raises ``ToolError``
    (exit 12) with the way to install it when it was never installed here (that takes minutes
    and network access, which a demo should not start on its own) or is not usable."""
    from engines import vllm_server

    script = vllm_server.ENV_SCRIPT
    if not script.exists():
        raise ToolError(
            Exit.ENGINE_UNAVAILABLE,
            f"--engine vllm needs {script}, which builds the vLLM CPU engine venv: "
            "this installation of loraledger does not carry it",
        )
    venv = vllm_server.default_venv()
    marker = venv / ".loraledger-ready"
    if not marker.exists():
        raise ToolError(
            Exit.ENGINE_UNAVAILABLE,
            f"the vLLM engine venv is not installed ({venv}). Install it with: "
            f"bash {script}  (about 10 minutes, needs network access to PyPI; "
            "then run the demo again with --engine vllm)",
        )
    result = vllm_server.ensure_env(venv, timeout=None)
    if result.returncode != vllm_server.ENV_READY:
        raise ToolError(
            Exit.ENGINE_UNAVAILABLE, f"the vLLM engine venv is not usable: {result.line}"
        )
    return result.python


async def run_demo(
    directory: Path,
    cfg: DemoConfig,
    *,
    engine: str = "local",
    vllm_python: Path | None = None,
    on_progress: Callable[[str, int, int], None] | None = None,
) -> DemoRun:
    """Run the story into ``directory`` (a fresh folder); returns where everything is."""
    import httpx
    import openai

    from engines.local.admission import ServingLimits
    from engines.local.client import LocalHTTPEngine
    from engines.local.tinymodel import make_adapter
    from engines.testing import RestartableEngine
    from evlog.provenance_store import open_provenance
    from evlog.sqlite import SQLiteStore
    from publisher.drivers.fleet import Fleet
    from publisher.drivers.plane import ControlPlane
    from publisher.drivers.trainer import PublicationError, TrainerClient
    from publisher.gateway import Gateway, LocalView
    from publisher.gateway.provenance import JsonlSink, ProvenanceRecorder, StoreSink, Tee
    from publisher.openai import OpenAIGateway, OpenAIOptions, engine_routes
    from publisher.sessions import RolloutWorker

    # peft warns each time the adapter it last applied is freed: its bookkeeping, not news.
    warnings.filterwarnings("ignore", message="Adapter .* was active which is now deleted")
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
    log_path = directory / "ledger.db"
    prov_path = directory / "provenance.jsonl"
    stats = DemoStats()
    progress = on_progress or (lambda *_: None)
    started = time.monotonic()
    limits = ServingLimits(max_lora_rank=16)
    total_sessions = cfg.workers * cfg.sessions * cfg.waves
    finished = [0]

    async with AsyncExitStack() as stack:
        store = await stack.enter_async_context(SQLiteStore.open(log_path))
        members: list[Any] = []
        if engine == "vllm":
            members.append(await _vllm_engine(stack, directory, vllm_python))
        hosts = []
        for i in range(len(members), 2):
            port: dict[str, int] = {}

            def factory(i: int = i, port: dict[str, int] = port) -> Any:
                return _served_local_engine(f"e{i}", limits, port)

            hosts.append(await stack.enter_async_context(RestartableEngine(factory)))
            member = LocalHTTPEngine(f"http://127.0.0.1:{port['port']}", f"e{i}")
            stack.push_async_callback(member.aclose)
            members.append(member)
        plane = await stack.enter_async_context(
            ControlPlane.open(
                store,
                Fleet(members),
                deployment="demo",
                prefix="policy",
                capacity=cfg.capacity,
                artifact_root=directory / "artifacts",
                probe_interval_s=0.2,
                reclaim_tick_s=0.1,
                lease_check_s=0.5,
            )
        )
        # The rows go where every face's go, the store beside the log (so `audit LOG` needs no
        # file), and to a JSON-lines copy the story reads.
        beside = await stack.enter_async_context(open_provenance(log_path))
        recorder = await stack.enter_async_context(
            ProvenanceRecorder(Tee(StoreSink(beside), JsonlSink(prov_path)))
        )
        ledger = plane.ledger
        gateway = Gateway(
            plane.fleet,
            LocalView(ledger),
            gateway_id="demo-gateway",
            recorder=recorder,
            on_engine_trouble=plane.reconciler.engine_trouble,
        )
        plane.add_inflight_source(gateway)
        trainer = TrainerClient(plane)
        rng = random.Random(cfg.seed)
        retried: Counter[str] = Counter()

        # One OpenAI gateway face per rollout worker (each its own owner and lease, as separate
        # gateway processes would be), all over one Gateway: one set of in-flight counts.
        routes = engine_routes(plane.fleet)
        clients: list[openai.AsyncOpenAI] = []
        releasers: list[httpx.AsyncClient] = []
        for k in range(cfg.workers):
            worker = await stack.enter_async_context(
                RolloutWorker.open(ledger, gateway, owner=f"worker-{k}", ttl_s=10.0)
            )
            face = OpenAIGateway(worker, routes, OpenAIOptions(token=TOKEN))
            stack.push_async_callback(face.aclose)
            url = await stack.enter_async_context(_loopback(face))
            # The client's own retries are off: the rollout below retries, and counts.
            clients.append(
                await stack.enter_async_context(
                    openai.AsyncOpenAI(base_url=url + "/v1", api_key=TOKEN, max_retries=0)
                )
            )
            releasers.append(
                await stack.enter_async_context(
                    httpx.AsyncClient(
                        base_url=url, headers={"authorization": f"Bearer {TOKEN}"}, timeout=60
                    )
                )
            )

        async def publish(step: int) -> None:
            config, tensors = make_adapter(step, r=8)
            t = time.monotonic()
            try:
                outcome = await trainer.publish(tensors, config=config, step=step)
                status = str(outcome.status)
            except PublicationError as exc:  # a real trainer logs it and trains on
                status = f"FAILED ({exc.code})"
            result = {"version_id": step, "status": status, "seconds": time.monotonic() - t}
            stats.publications.append(result)
            log.info("demo.published", **result)

        async def turn(client: openai.AsyncOpenAI, sid: str, prompt: str) -> str:
            """One turn through the OpenAI route, retried as a NEW request after a refusal
            that may pass (the gateway never resends anything itself). ``/v1/completions``
            on the conversation so far: every engine kind serves it (the tiny model has no
            chat template of its own, which vLLM's chat route would need)."""
            for attempt in range(MAX_TRIES):
                try:
                    reply = await client.completions.create(
                        model="policy",
                        prompt=prompt,
                        max_tokens=cfg.tokens,
                        temperature=0.0,
                        extra_body={"ignore_eos": True},
                        extra_headers={"x-session-id": sid},
                    )
                    return reply.choices[0].text
                except openai.APIStatusError as exc:
                    code = str(exc.code or exc.status_code)
                    if code in NOT_RETRIED or attempt == MAX_TRIES - 1:
                        raise ToolError(
                            Exit.FAILED, f"session {sid}: {exc.status_code} {code}: {exc.message}"
                        ) from None
                    retried[code] += 1
                    await anyio.sleep(0.05 * (attempt + 1))
            raise AssertionError("unreachable")

        async def session(k: int, sid: str, bound: anyio.Event, seed: int) -> None:
            own = random.Random(seed)
            task = " ".join(own.choice(WORDS) for _ in range(6))
            prompt = f"task {seed % 997}: {task}\n"  # the conversation so far: a growing prefix
            for number in range(cfg.turns):
                answer = await turn(clients[k], sid, prompt)
                stats.generations += 1
                if number == 0:
                    bound.set()
                await anyio.sleep(own.uniform(0.0, cfg.think_s))  # a tool call
                prompt += f"{answer}\ntool: {own.choice(WORDS)} ok\n"
            reply = await releasers[k].post(f"/v1/sessions/{sid}/release")
            if reply.status_code != 200:
                raise ToolError(Exit.FAILED, f"release of {sid}: {reply.text}")
            finished[0] += 1
            progress("sessions", finished[0], total_sessions)

        async def wave(number: int, tg: Any) -> list[anyio.Event]:
            """Sessions started right after version ``number`` was published."""
            flags = []
            for k in range(cfg.workers):
                for i in range(cfg.sessions):
                    flag = anyio.Event()
                    flags.append(flag)
                    sid = f"wave{number}-worker{k}-s{i}"
                    tg.start_soon(session, k, sid, flag, rng.randrange(1 << 30))
            return flags

        restart_wave = cfg.waves // 2
        async with anyio.create_task_group() as tg:
            for step in range(1, cfg.waves + 1):
                await publish(step)
                flags = await wave(step, tg)
                for flag in flags:  # every session of the wave has bound (first turn done)
                    await flag.wait()
                if step - 1 == restart_wave:
                    await _restart(hosts[-1], ledger)
                await anyio.sleep(cfg.train_s)  # the next training step
            await publish(cfg.waves + 1)  # while the last waves are still generating
        progress("sessions", total_sessions, total_sessions)
        await _settle(ledger)  # every old version reclaimed as its last session left
        if any(p["status"] == "SKIPPED" for p in stats.publications):
            # Training went on after the skip: the next step publishes into the slots that
            # reclaim freed, and the version it replaces (no session on it) is reclaimed.
            await publish(cfg.waves + 2)
            await _settle(ledger)
        stats.retried = dict(retried)
    stats.wall_s = time.monotonic() - started
    plot = await _plot(log_path, directory / "lifetimes.png")
    return DemoRun(
        directory=str(directory),
        log=str(log_path),
        provenance=str(prov_path),
        plot=plot,
        stats=stats,
    )


@asynccontextmanager
async def _served_local_engine(
    engine_id: str, limits: Any, port: dict[str, int]
) -> AsyncIterator[Any]:
    """One life of a local engine, served over HTTP on loopback. Every life listens on the
    port of the first (``port``), so a restarted engine is found at the same URL with a new
    incarnation, as a restarted engine process would be."""
    from engines.local.engine import LocalEngine
    from engines.local.server import serve

    async with (
        LocalEngine(engine_id, limits=limits) as engine,
        serve(engine, port=port.get("port", 0)) as url,
    ):
        port["port"] = int(url.rsplit(":", 1)[1])
        yield engine


@asynccontextmanager
async def _loopback(face: Any) -> AsyncIterator[str]:
    """The OpenAI routes of ``face`` on a free loopback port (uvicorn); yields the URL."""
    import socket

    import uvicorn

    from engines.guard import uvicorn_limits
    from publisher.openai import openai_app

    class Quiet(uvicorn.Server):
        @contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield  # the demo's signals are the CLI's

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    server = Quiet(
        uvicorn.Config(
            openai_app(face),
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=2,
            **uvicorn_limits(),
        )
    )
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve, [sock])
            with anyio.fail_after(20):
                while not server.started:  # noqa: ASYNC110 -- uvicorn has only the flag
                    await anyio.sleep(0.005)
            try:
                yield f"http://127.0.0.1:{sock.getsockname()[1]}"
            finally:
                server.should_exit = True
    finally:
        sock.close()


async def _vllm_engine(stack: AsyncExitStack, directory: Path, python: Path | None) -> Any:
    """A real vLLM CPU server on loopback (fleet member e0), stopped by its PID at the end.

    The server is the integration tests' own (:mod:`engines.vllm_server`: command line,
    environment, health wait, stop by process group). It is spawned from this, the event
    loop's, thread: the server dies with the thread that started it (parent death signal),
    and a worker thread would be retired by anyio after 10 idle seconds, mid-demo."""
    from engines.local.tinymodel import SERVED_NAME, default_cache_dir, ensure_tiny_model
    from engines.vllm import VLLMEngine
    from engines.vllm_server import VLLMServer, VLLMServerError, default_venv

    model_dir = await anyio.to_thread.run_sync(ensure_tiny_model, default_cache_dir())
    workdir = directory / "vllm"
    workdir.mkdir()
    server = VLLMServer(
        python=python or default_venv() / "bin" / "python", model_dir=model_dir, workdir=workdir
    )
    stack.push_async_callback(anyio.to_thread.run_sync, server.stop)
    log.info("demo.vllm_starting", workdir=str(workdir))
    try:
        await server.start_async()
    except VLLMServerError as exc:
        raise ToolError(
            Exit.ENGINE_UNAVAILABLE, f"the vLLM server did not start: {exc}\n{server.log_tail(20)}"
        ) from None
    log.info("demo.vllm_ready", url=server.base_url, pid=server.pid)
    member = VLLMEngine(server.base_url, "e0", served_model=SERVED_NAME)
    stack.push_async_callback(member.aclose)
    return member


async def _restart(host: RestartableEngine, ledger: Ledger) -> None:
    """Restart engine e1 and wait until the reconciler repaired it (routable, new incarnation)."""
    engine = host.engine_id
    old = ledger.state.engines[engine].incarnation
    log.info("demo.restarting", engine=engine, incarnation=old)
    await host.restart()

    def repaired() -> bool:
        member = ledger.state.engines.get(engine)
        return member is not None and member.incarnation != old and member.routable

    await until(ledger, repaired, timeout=60.0)
    log.info("demo.repaired", engine=engine, incarnation=ledger.state.engines[engine].incarnation)


async def _settle(ledger: Ledger, timeout: float = 60.0) -> None:
    """Wait until every retired version is reclaimed (the reclaim driver runs on its own)."""
    from projections.registry import VersionState

    def settled() -> bool:
        return not any(
            v.state in (VersionState.RETIRED, VersionState.RECLAIMING)
            for v in ledger.state.versions.values()
        )

    await until(ledger, settled, timeout=timeout)


async def until(ledger: Ledger, predicate: Callable[[], bool], *, timeout: float) -> None:
    """Wait until ``predicate`` (of the ledger's state) holds: re-checked at every committed
    record, since every state change is one (no polling)."""
    with anyio.fail_after(timeout):
        if predicate():
            return
        async for _record in ledger.subscribe():
            if predicate():
                return


async def _plot(log_path: Path, png: Path) -> str | None:
    """Draw the run's lifetimes when matplotlib is installed (the plot extra)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    from tools.plot import plot_lifetimes
    from tools.replay import replay

    result = await replay(log_path, lifetimes=True)
    assert result.lifetimes is not None
    return plot_lifetimes(result.lifetimes, png, title="demo: version lifetimes and bound sessions")


async def read_story(run: DemoRun) -> Any:
    """The story of a finished run, from its log and provenance file."""
    from publisher.gateway.provenance import read_rows
    from tools.logfile import open_log
    from tools.story import tell

    async with open_log(run.log) as store:
        records = await store.read()
    return tell(records, read_rows(run.provenance))


def suggestions(run: DemoRun, story: Any) -> list[str]:
    """The commands worth trying on this run's log, filled in with its paths and moments."""
    from tools.timefmt import iso

    log_path = run.log
    out = [
        f"loraledger verify {log_path}",
        f"loraledger replay {log_path} --incidents --stuck-after 2s",
        f"loraledger replay {log_path} --version 1",
    ]
    if story.restarts:
        r = story.restarts[0]
        out.append(f"loraledger replay {log_path} --engine {r.engine}")
        out.append(f"loraledger replay {log_path} --at {iso(story.started_at + r.at)}")
    if story.example_session:
        out.append(f"loraledger audit {log_path} --session {story.example_session}")
    out.append(f"loraledger replay {log_path} --plot {Path(run.directory) / 'replayed.png'}")
    return out


def fleet_description(engine: str) -> str:
    if engine == "vllm":
        return "a vLLM server (e0) and a local engine (e1)"
    return "2 local engines (e0, e1)"


def quiet_libraries() -> None:
    """No third-party progress bars on the demo's terminal (transformers' weight loading)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
