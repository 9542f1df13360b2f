"""The engine-host agent's rules, each stated on the agent itself (in process, a real local
engine on loopback behind it): which candidates ``prepare`` refuses, how staging is kept per
attempt, what ``load`` writes and reuses, which unloads are fenced, how a refusal is answered
over HTTP, and what the control-plane members send where."""

from __future__ import annotations

import io
import os
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import pytest

from engines import agent as agent_module
from engines.agent import (
    AGENT_TOKEN_ENV,
    DEFAULT_STAGING_BYTES,
    DEFAULT_STAGING_IDLE_S,
    DRAIN_REFUSES,
    ENGINE_TOKEN_ENV,
    EXIT_AFTER_WRITE,
    MAX_BODY_BYTES,
    MAX_BUCKET_BYTES,
    Agent,
    AgentEngine,
    HostedAgentEngine,
    UnsafeConfiguration,
    check_configuration,
    create_app,
    engine_adapter,
    hosted_agent,
    main,
    run,
    serve_agent,
)
from engines.artifacts import ArtifactStore, StagedWeights
from engines.contract import (
    AmbiguousReply,
    CleanRefusal,
    EngineCapabilities,
    ErrorCode,
    Inventory,
    UnloadReceipt,
)
from engines.drain import DEFAULT_DRAIN_TIMEOUT_S, Drain
from engines.local import wire
from engines.local.client import LocalHTTPEngine
from engines.local.engine import LocalEngine
from engines.local.server import running_server
from engines.manifest import compute_digest
from engines.sglang import SGLangEngine
from engines.vllm import VLLMEngine
from tests.engines.contract import (
    GREEDY,
    PROMPT,
    Published,
    aiter_list,
    buckets_of,
    candidate_for,
    expect_refusal,
    publish,
)
from tests.engines.test_contract_local import LIMITS
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
]

ENGINE_TOKEN = "engine-secret-0123"
AGENT_TOKEN = "agent-secret-4567"


@dataclass
class OnEngine:
    """An agent in process in front of a real local engine on loopback."""

    agent: Agent
    engine: LocalEngine  # the engine itself, to read what it holds
    engine_url: str
    host: Path  # the agent's store, the only directory the engine reads
    trainer: ArtifactStore  # the publisher's side

    def published(self, seed: int, **options: Any) -> Published:
        return candidate_for(self.trainer, seed, **options)


@asynccontextmanager
async def on_engine(tmp_path: Path, **options: Any) -> AsyncIterator[OnEngine]:
    host = tmp_path / "host"
    host.mkdir()
    async with running_server("h0", limits=LIMITS, artifact_root=host) as (engine, url):
        agent = Agent(SGLangEngine(url, "h0"), ArtifactStore(host), **options)
        try:
            yield OnEngine(agent, engine, url, host, ArtifactStore(tmp_path / "trainer"))
        finally:
            await agent.engine.aclose()


@asynccontextmanager
async def over_http(
    a: OnEngine, *, token: str | None = None, drain: Drain | None = None
) -> AsyncIterator[tuple[str, LocalHTTPEngine]]:
    """The agent's app served on loopback, and the control plane's client of it."""
    async with serve_agent(a.agent, token=token, drain=drain) as url:
        client = LocalHTTPEngine(url, "h0", api_key=token)
        try:
            yield url, client
        finally:
            await client.aclose()


async def upload(a: OnEngine, p: Published, *, max_bytes: int = 64 * 1024) -> None:
    """Every bucket of ``p`` into the agent, as the HTTP face hands them over."""
    for bucket in buckets_of(p.tensors, max_bytes):
        await a.agent.receive_bucket(
            wire.BucketUpload(
                lora_name=p.name,
                attempt=p.candidate.attempt,
                digest=p.candidate.digest,
                bucket=bucket,
            )
        )


async def held(engine: LocalEngine) -> set[str]:
    return {a.lora_name for a in (await engine.inventory()).adapters}


# --- whom the agent starts for ------------------------------------------------------------------


def test_an_agent_holding_the_engine_token_needs_its_own() -> None:
    with pytest.raises(UnsafeConfiguration) as refused:
        check_configuration("127.0.0.1", None, ENGINE_TOKEN)
    assert str(refused.value) == (
        "refusing to start: the agent holds the engine's token ($LORALEDGER_ENGINE_TOKEN) and "
        "would forward any caller's request with it. Give the agent its own token "
        "(--token-file FILE or $LORALEDGER_AGENT_TOKEN) and the control plane the same one."
    )
    check_configuration("127.0.0.1", AGENT_TOKEN, ENGINE_TOKEN)  # its own token: starts
    check_configuration("127.0.0.1", None, None)  # loopback, no engine token: starts
    check_configuration("127.0.0.1", None, "")  # an empty engine token is none


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "engine-host.example"])
def test_beyond_loopback_the_agent_needs_a_token(host: str) -> None:
    with pytest.raises(UnsafeConfiguration) as refused:
        check_configuration(host, None, None)
    assert str(refused.value) == (
        f"refusing to listen on {host!r} without a token (--token-file FILE or "
        "$LORALEDGER_AGENT_TOKEN)"
    )
    check_configuration(host, AGENT_TOKEN, None)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_on_loopback_the_agent_starts_without_a_token(host: str) -> None:
    check_configuration(host, None, None)


async def test_serve_agent_refuses_a_host_beyond_loopback_without_a_token(tmp_path: Path) -> None:
    agent = Agent(SGLangEngine("http://127.0.0.1:9", "h0"), ArtifactStore(tmp_path))
    with pytest.raises(UnsafeConfiguration):
        async with serve_agent(agent, host="0.0.0.0"):
            pytest.fail("it listened")
    await agent.engine.aclose()


def test_the_command_refuses_an_unsafe_configuration_with_exit_11(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(AGENT_TOKEN_ENV, raising=False)
    monkeypatch.setenv(ENGINE_TOKEN_ENV, ENGINE_TOKEN)
    started: list[dict[str, Any]] = []

    async def never(**options: Any) -> None:
        started.append(options)

    monkeypatch.setattr(agent_module, "run", never)
    with pytest.raises(SystemExit) as exited:
        main(["--engine", "sglang:http://127.0.0.1:9", "--artifacts", "/nowhere"])
    assert exited.value.code == 11
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.startswith("engines.agent: refusing to start") and AGENT_TOKEN_ENV in out.err
    assert started == []


def test_the_command_runs_the_agent_with_what_it_was_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every option reaches the agent, the tokens come from the environment (never argv),
    and the port is the first line on stdout."""
    monkeypatch.setenv(AGENT_TOKEN_ENV, AGENT_TOKEN)
    monkeypatch.setenv(ENGINE_TOKEN_ENV, ENGINE_TOKEN)
    ran: list[dict[str, Any]] = []
    out = io.BytesIO()  # stdout as a pipe holds it: block-buffered
    announced: list[bytes] = []

    async def recorded(**options: Any) -> None:
        ran.append(options)
        options["on_ready"]("http://127.0.0.1:43210")
        announced.append(out.getvalue())  # what a parent waiting for the port has read

    monkeypatch.setattr(agent_module, "run", recorded)
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(out, write_through=False))
    main(
        [
            "--engine",
            "vllm:http://127.0.0.1:9",
            "--artifacts",
            "/srv/adapters",
            "--id",
            "h7",
            "--host",
            "0.0.0.0",
            "--port",
            "4321",
            "--served-model",
            "base",
            "--exit-after-write",
            "--drain-timeout",
            "2.5",
            "--staging-bytes",
            "1000",
            "--staging-idle",
            "7.5",
        ]
    )
    assert announced == [b"43210\n"]  # flushed at once, while the agent runs on
    (options,) = ran
    options.pop("on_ready")
    assert options == {
        "engine": "vllm:http://127.0.0.1:9",
        "artifacts": "/srv/adapters",
        "engine_id": "h7",
        "host": "0.0.0.0",
        "port": 4321,
        "token": AGENT_TOKEN,
        "engine_token": ENGINE_TOKEN,
        "exit_after_write": True,
        "served_model": "base",
        "drain_timeout": 2.5,
        "staging_bytes": 1000,
        "staging_idle_s": 7.5,
    }


def test_the_commands_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(AGENT_TOKEN_ENV, raising=False)
    monkeypatch.delenv(ENGINE_TOKEN_ENV, raising=False)
    ran: list[dict[str, Any]] = []

    async def recorded(**options: Any) -> None:
        ran.append(options)

    monkeypatch.setattr(agent_module, "run", recorded)
    main(["--engine", "sglang:http://127.0.0.1:9", "--artifacts", "/srv/adapters"])
    (options,) = ran
    options.pop("on_ready")
    assert options == {
        "engine": "sglang:http://127.0.0.1:9",
        "artifacts": "/srv/adapters",
        "engine_id": "agent",
        "host": "127.0.0.1",
        "port": 0,
        "token": None,
        "engine_token": None,
        "exit_after_write": False,
        "served_model": "tiny",
        "drain_timeout": DEFAULT_DRAIN_TIMEOUT_S,
        "staging_bytes": DEFAULT_STAGING_BYTES,
        "staging_idle_s": DEFAULT_STAGING_IDLE_S,
    }
    assert (DEFAULT_STAGING_BYTES, DEFAULT_STAGING_IDLE_S) == (4 * 1024**3, 600.0)


@pytest.mark.parametrize("missing", ["--engine", "--artifacts"])
def test_the_command_needs_an_engine_and_a_store(missing: str) -> None:
    argv = ["--engine", "sglang:http://127.0.0.1:9", "--artifacts", "/srv/adapters"]
    at = argv.index(missing)
    with pytest.raises(SystemExit) as exited:
        main(argv[:at] + argv[at + 2 :])
    assert exited.value.code == 2


# --- the process: run() until SIGTERM, then drain -------------------------------------------


class _Gates(list[Drain]):
    """Every drain gate ``run`` creates (engines.agent.Drain patched to record them)."""

    def make(self, engine_id: str = "") -> Drain:
        gate = Drain(engine_id)
        self.append(gate)
        return gate


@asynccontextmanager
async def running_agent(
    monkeypatch: pytest.MonkeyPatch, engine_url: str, store: Path, **options: Any
) -> AsyncIterator[tuple[str, Drain, anyio.Event]]:
    """``run`` in a task of this process (the agent's process without its CLI): yields its URL,
    its drain gate and the event set when ``run`` returned; on exit, SIGTERM if still running."""
    gates = _Gates()
    monkeypatch.setattr(agent_module, "Drain", gates.make)
    urls: list[str] = []
    ready, returned = anyio.Event(), anyio.Event()

    def on_ready(url: str) -> None:
        urls.append(url)
        ready.set()

    async def process() -> None:
        await run(
            engine=f"sglang:{engine_url}",
            artifacts=str(store),
            on_ready=on_ready,
            **options,
        )
        returned.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(process)
        with anyio.fail_after(30):
            await ready.wait()
        try:
            yield urls[0], gates[0], returned
        finally:
            if not returned.is_set():
                sigterm()
            with anyio.fail_after(30):
                await returned.wait()


def sigterm(signum: int = signal.SIGTERM) -> None:
    """``signum`` to this process, which ``run`` receives (never sent unless its handler is
    in: Python's own SIGINT handler would interrupt the test session)."""
    default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
    assert signal.getsignal(signum) not in (default, signal.SIG_IGN, None)
    os.kill(os.getpid(), signum)


async def _held_step(url: str, release: anyio.Event, answers: list[int]) -> None:
    """A bucket upload whose body is held until ``release``: a publication step in flight."""

    async def body() -> AsyncIterator[bytes]:
        yield b"\x80"
        await release.wait()

    async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
        try:
            response = await client.post(
                f"{url}{wire.PREFIX}/bucket",
                content=body(),
                headers={"Authorization": f"Bearer {AGENT_TOKEN}"},
            )
        except httpx.HTTPError:
            answers.append(0)  # cut when the server stopped
        else:
            answers.append(response.status_code)


async def test_run_serves_with_its_options_until_sigterm_then_drains_what_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = tmp_path / "host"
    host.mkdir()
    trainer = ArtifactStore(tmp_path / "trainer")
    published = candidate_for(trainer, 81)
    cap = published.candidate.manifest.total_bytes
    adapters: list[tuple[Any, ...]] = []

    def recorded_adapter(kind: str, url: str, engine_id: str, **options: Any) -> Any:
        adapters.append((kind, url, engine_id, options))
        return engine_adapter(kind, url, engine_id, **options)

    monkeypatch.setattr(agent_module, "engine_adapter", recorded_adapter)
    async with AsyncExitStack() as stack:
        _, engine_url = await stack.enter_async_context(
            running_server("h0", limits=LIMITS, artifact_root=host, token=ENGINE_TOKEN)
        )
        url, gate, returned = await stack.enter_async_context(
            running_agent(
                monkeypatch,
                engine_url,
                host,
                engine_id="h0",
                token=AGENT_TOKEN,
                engine_token=ENGINE_TOKEN,
                staging_bytes=cap,
                staging_idle_s=0.5,
            )
        )
        assert gate.engine_id == "h0"
        assert int(url.rsplit(":", 1)[1]) > 1023  # a free port the OS chose (port 0)
        assert adapters == [
            ("sglang", engine_url, "h0", {"api_key": ENGINE_TOKEN, "served_model": "tiny"})
        ]
        async with httpx.AsyncClient(trust_env=False) as anonymous:
            knock = await anonymous.get(f"{url}{wire.PREFIX}/inventory")
            assert knock.status_code == 401  # the agent's own token guards it
        engine = SGLangEngine(engine_url, "h0", api_key=ENGINE_TOKEN)
        member = AgentEngine(url, engine, api_key=AGENT_TOKEN)
        stack.push_async_callback(member.aclose)
        # the agent forwards with the engine's token (the engine refuses every other caller)
        await publish(member, published)
        assert published.name in {a.lora_name for a in (await engine.inventory()).adapters}
        # its staging cap and idle bound are the ones given
        bigger = candidate_for(trainer, 82, r=16)
        await expect_refusal(ErrorCode.STAGING_FULL, member.prepare(bigger.candidate))
        left = candidate_for(trainer, 83)
        await member.prepare(left.candidate)
        assert (await member.agent.inventory()).staged == (left.name,)

        async def expired() -> bool:
            return (await member.agent.inventory()).staged == ()

        await wait_for("the idle staging to expire", expired, every=0.05)
        # SIGTERM while a step runs: new steps are refused, the running one finishes
        release, answers = anyio.Event(), list[int]()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_held_step, url, release, answers)
            await wait_for("the held step admitted", lambda: gate.in_flight == 1)
            sigterm()
            await wait_for("the drain begun", lambda: gate.draining)
            await expect_refusal(ErrorCode.ENGINE_DRAINING, member.prepare(left.candidate))
            assert (await member.agent.inventory()).adapters  # reads stay open
            assert not returned.is_set()
            release.set()
        assert answers == [400]  # it ran to its end (a bad body, answered)
        with anyio.fail_after(30):
            await returned.wait()


class _Died(Exception):
    """``os._exit`` in this process, recorded instead (the fault mode's exit)."""


async def test_run_in_fault_mode_exits_71_after_the_write_and_cuts_a_drain_at_its_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    host = tmp_path / "host"
    host.mkdir()
    published = candidate_for(ArtifactStore(tmp_path / "trainer"), 84)
    exits: list[tuple[int, bytes]] = []
    said = io.BytesIO()  # stderr's bytes as the process would leave them at its exit

    def exit_now(status: int) -> None:
        exits.append((status, said.getvalue()))
        raise _Died(status)

    with socket.socket() as probe:  # a port the OS says is free
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async with AsyncExitStack() as stack:
        engine, engine_url = await stack.enter_async_context(
            running_server("h0", limits=LIMITS, artifact_root=host)
        )
        url, gate, returned = await stack.enter_async_context(
            running_agent(
                monkeypatch,
                engine_url,
                host,
                host="localhost",
                port=port,
                token=AGENT_TOKEN,
                exit_after_write=True,
                drain_timeout=0.3,
            )
        )
        assert url == f"http://localhost:{port}"
        assert gate.engine_id == "agent"  # the default fleet id
        client = LocalHTTPEngine(url, "h0", api_key=AGENT_TOKEN)
        stack.push_async_callback(client.aclose)
        await client.prepare(published.candidate)
        await client.transfer(published.candidate, aiter_list(buckets_of(published.tensors)))
        monkeypatch.setattr(os, "_exit", exit_now)
        monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(said, write_through=False))
        with pytest.raises(AmbiguousReply):
            await client.load(published.candidate)
        monkeypatch.undo()
        words = b"engines.agent: exiting after the write (fault mode)\n"
        assert exits == [(EXIT_AFTER_WRITE, words)] and EXIT_AFTER_WRITE == 71
        assert ArtifactStore(host).contains(published.candidate.digest)  # written
        assert published.name not in await held(engine)  # never loaded

        release, answers = anyio.Event(), list[int]()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_held_step, url, release, answers)
            await wait_for("the held step admitted", lambda: gate.in_flight == 1)
            sigterm(signal.SIGINT)  # Ctrl-C stops it the same way
            with anyio.fail_after(30):
                await returned.wait()  # cut at the drain timeout, the step still held
            release.set()
        assert "drain timed out after 0.3s with 1 step(s) still running" in capfd.readouterr().err


# --- the fleet members: publication to the agent, the rest to the engine ------------------------


class RecordingEngine:
    """Test double of an engine adapter: records what reaches it, answers fixed values."""

    transport = "artifact"

    def __init__(self, *, confirms_end: bool = True) -> None:
        self.engine_id = "e9"
        self.kind = "sglang"
        self.capabilities = EngineCapabilities(
            extra_body=True, endpoint="http://10.0.0.9:30000", confirms_end=confirms_end
        )
        self.calls: list[tuple[Any, ...]] = []
        self.inventory_answer = Inventory(engine_id="e9", incarnation="life-1", adapters=())

    down = False  # every read fails, as on an engine that is not reachable

    async def incarnation(self) -> str:
        self.calls.append(("incarnation",))
        if self.down:
            raise AmbiguousReply(ErrorCode.ENGINE_UNREACHABLE, "the engine is down")
        return "life-1"

    async def inventory(self) -> Inventory:
        self.calls.append(("inventory",))
        return self.inventory_answer

    async def abort_request(self, request_id: str, lora_name: str | None) -> bool:
        self.calls.append(("abort_request", request_id, lora_name))
        return True

    async def generate(self, prompt: Any, lora_name: Any, params: Any, **options: Any) -> Any:
        self.calls.append(("generate", prompt, lora_name, params, options))
        return "generated"

    async def unload(self, lora_name: str, *, attempt: int | None = None) -> UnloadReceipt:
        self.calls.append(("unload", lora_name, attempt))
        return UnloadReceipt(
            engine_id="e9", incarnation="life-1", lora_name=lora_name, was_loaded=True
        )

    async def aclose(self) -> None:
        self.calls.append(("aclose",))


class SlowInventoryEngine(RecordingEngine):
    """Its inventory answers only once ``release`` is set (a slow engine); or fails."""

    def __init__(self, *, fails: bool = False) -> None:
        super().__init__()
        self.asked = anyio.Event()
        self.release = anyio.Event()
        self.fails = fails

    async def inventory(self) -> Inventory:
        self.calls.append(("inventory",))
        if self.fails:
            raise AmbiguousReply(ErrorCode.ENGINE_UNREACHABLE, "the engine is down")
        self.asked.set()
        await self.release.wait()
        return self.inventory_answer


DEAD_AGENT = "http://127.0.0.1:9"  # nothing listens: the calls below never reach an agent


def _members(engine: RecordingEngine, tmp_path: Path) -> list[Any]:
    return [
        AgentEngine(DEAD_AGENT, engine),  # type: ignore[arg-type]
        HostedAgentEngine(Agent(engine, ArtifactStore(tmp_path))),  # type: ignore[arg-type]
    ]


@pytest.mark.parametrize("which", [0, 1], ids=["agent", "hosted"])
async def test_a_member_is_its_engine_for_identity_reads_and_generation(
    tmp_path: Path, which: int
) -> None:
    engine = RecordingEngine()
    member = _members(engine, tmp_path)[which]
    assert (member.engine_id, member.kind, member.transport) == ("e9", "sglang", "staged")
    # the engine's address and end confirmation; no extra body (it forwards the contract only)
    assert member.capabilities == EngineCapabilities(
        endpoint="http://10.0.0.9:30000", confirms_end=True
    )
    assert await member.incarnation() == "life-1"
    assert await member.inventory() is engine.inventory_answer
    assert await member.abort_request("r-1", "lora-a") is True
    out = await member.generate(PROMPT, "lora-a", GREEDY, request_id="r-2", cache_salt="salt-3")
    assert out == "generated"
    assert engine.calls == [
        ("incarnation",),
        ("inventory",),
        ("abort_request", "r-1", "lora-a"),
        ("generate", PROMPT, "lora-a", GREEDY, {"request_id": "r-2", "cache_salt": "salt-3"}),
    ]
    await member.aclose()
    assert engine.calls[-1] == ("aclose",)


@pytest.mark.parametrize("which", [0, 1], ids=["agent", "hosted"])
async def test_a_member_never_aborts_on_an_engine_that_does_not_confirm_ends(
    tmp_path: Path, which: int
) -> None:
    engine = RecordingEngine(confirms_end=False)
    member = _members(engine, tmp_path)[which]
    assert member.capabilities.confirms_end is False
    assert await member.abort_request("r-1", None) is False
    assert engine.calls == []


async def test_the_agent_member_closes_its_agent_client_and_its_engine(tmp_path: Path) -> None:
    engine = RecordingEngine()
    member = AgentEngine(DEAD_AGENT, engine, api_key=AGENT_TOKEN)  # type: ignore[arg-type]
    assert member.agent.engine_id == "e9" and member.agent.base_url == DEAD_AGENT
    await member.aclose()
    assert engine.calls == [("aclose",)]
    assert member.agent._client.is_closed


async def test_the_hosted_member_names_its_engine_in_every_refusal(tmp_path: Path) -> None:
    async with on_engine(tmp_path) as a:
        async with HostedAgentEngine(a.agent) as member:
            p = a.published(85)
            unprepared = [
                member.load(p.candidate),
                member.transfer(p.candidate, aiter_list(buckets_of(p.tensors))),
                member.unload("bad/name"),
                member.prepare(msgspec.structs.replace(p.candidate, attempt=0)),
            ]
            for step in unprepared:
                refusal = await expect_refusal(
                    {ErrorCode.NOT_PREPARED, ErrorCode.INVALID_NAME, ErrorCode.BAD_REQUEST}, step
                )
                assert refusal.engine_id == "h0", refusal
            await publish(member, p)
            assert (await member.unload(p.name, attempt=1)).was_loaded is True
        assert a.agent.engine._client.is_closed  # type: ignore[attr-defined]


def test_engine_adapter_builds_the_path_loading_adapter_of_its_kind() -> None:
    sglang = engine_adapter("sglang", "http://127.0.0.1:30000", "e1", api_key=ENGINE_TOKEN)
    assert type(sglang) is SGLangEngine
    assert (sglang.base_url, sglang.engine_id) == ("http://127.0.0.1:30000", "e1")
    assert sglang._client.headers["authorization"] == f"Bearer {ENGINE_TOKEN}"
    vllm = engine_adapter("vllm", "http://127.0.0.1:8000", "e2", served_model="base")
    assert type(vllm) is VLLMEngine
    assert (vllm.base_url, vllm.engine_id, vllm.served_model) == (
        "http://127.0.0.1:8000",
        "e2",
        "base",
    )
    assert "authorization" not in vllm._client.headers
    with_token = engine_adapter("vllm", "http://127.0.0.1:8000", "e2", api_key=ENGINE_TOKEN)
    assert with_token._client.headers["authorization"] == f"Bearer {ENGINE_TOKEN}"
    assert engine_adapter("vllm", "http://127.0.0.1:8000", "e3").served_model == "tiny"
    with pytest.raises(ValueError, match="'local'"):
        engine_adapter("local", "http://127.0.0.1:1", "e4")


def test_hosted_agent_writes_into_its_store_for_its_engine(tmp_path: Path) -> None:
    member = hosted_agent("vllm:http://127.0.0.1:8000", str(tmp_path), "e5", served_model="base")
    engine = member.agent.engine
    assert type(engine) is VLLMEngine
    assert (engine.base_url, engine.engine_id, engine.served_model) == (
        "http://127.0.0.1:8000",
        "e5",
        "base",
    )
    assert member.agent.store.root == tmp_path
    default = hosted_agent("vllm:http://127.0.0.1:8000", str(tmp_path), "e6").agent.engine
    assert isinstance(default, VLLMEngine) and default.served_model == "tiny"


# --- unload: fenced by attempt, told to the engine, managed names ------------------------------


def _agent_over(engine: RecordingEngine, tmp_path: Path) -> Agent:
    return Agent(engine, ArtifactStore(tmp_path / "host"))  # type: ignore[arg-type]


async def test_a_cleanup_names_its_attempt_to_the_engine_and_fences_older_cleanups(
    tmp_path: Path,
) -> None:
    engine = RecordingEngine()
    agent = _agent_over(engine, tmp_path)
    receipt = await agent.unload("lora-a", 3)
    assert receipt.was_loaded is True
    assert engine.calls == [("unload", "lora-a", 3)]
    # a late cleanup of an older attempt never reaches the engine
    refusal = await expect_refusal(ErrorCode.STALE_ATTEMPT, agent.unload("lora-a", 2))
    assert "lora-a" in refusal.message and refusal.engine_id == "e9"  # its engine's id
    assert engine.calls == [("unload", "lora-a", 3)]


async def test_a_cleanup_older_than_the_prepared_attempt_leaves_its_staging(
    tmp_path: Path,
) -> None:
    engine = RecordingEngine()
    agent = _agent_over(engine, tmp_path)
    p = candidate_for(ArtifactStore(tmp_path / "trainer"), 86, attempt=2)
    await agent.prepare(p.candidate)
    refusal = await expect_refusal(ErrorCode.STALE_ATTEMPT, agent.unload(p.name, 1))
    assert p.name in refusal.message
    assert agent.staged_names() == (p.name,)
    assert ("unload", p.name, 1) not in engine.calls


async def test_an_unfenced_unload_of_a_managed_name_is_refused_only_on_the_http_face(
    tmp_path: Path,
) -> None:
    engine = RecordingEngine()
    agent = _agent_over(engine, tmp_path)
    p = candidate_for(ArtifactStore(tmp_path / "trainer"), 87)
    await agent.prepare(p.candidate)
    refusal = await expect_refusal(
        ErrorCode.ATTEMPT_REQUIRED, agent.unload(p.name, None, fenced_only=True)
    )
    assert p.name in refusal.message
    assert agent.staged_names() == (p.name,)
    # in process (the hosted member) the caller is the control plane itself
    await agent.unload(p.name, None)
    assert engine.calls[-1] == ("unload", p.name, None)
    assert agent.staged_names() == ()


async def test_a_name_this_agent_cleaned_up_is_managed_without_asking_the_engine(
    tmp_path: Path,
) -> None:
    """Refusing an unfenced unload of a name the agent knows needs no engine (it may be down)."""
    engine = SlowInventoryEngine(fails=True)
    agent = _agent_over(engine, tmp_path)
    await agent.unload("lora-a", 1)
    await expect_refusal(ErrorCode.ATTEMPT_REQUIRED, agent.unload("lora-a", None, fenced_only=True))
    assert engine.calls == [("unload", "lora-a", 1)]


async def test_a_name_prepared_while_the_inventory_was_read_is_managed(tmp_path: Path) -> None:
    engine = SlowInventoryEngine()
    agent = _agent_over(engine, tmp_path)
    p = candidate_for(ArtifactStore(tmp_path / "trainer"), 88)
    outcome: list[BaseException] = []

    async def unfenced() -> None:
        try:
            await agent.unload(p.name, None, fenced_only=True)
        except CleanRefusal as exc:
            outcome.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(unfenced)
        await engine.asked.wait()
        await agent.prepare(p.candidate)
        engine.release.set()
    assert [getattr(e, "code", e) for e in outcome] == [ErrorCode.ATTEMPT_REQUIRED]
    assert agent.staged_names() == (p.name,)
    assert not [c for c in engine.calls if c[0] == "unload"]


# --- the HTTP face: routes, answers, caps, the drain gate --------------------------------------


@asynccontextmanager
async def agent_app(
    tmp_path: Path, engine: RecordingEngine, **options: Any
) -> AsyncIterator[tuple[Agent, httpx.AsyncClient]]:
    """The agent's app on loopback in front of ``engine`` (a test double), and a raw client."""
    agent = _agent_over(engine, tmp_path)
    async with (
        serve_agent(agent, **options) as url,
        httpx.AsyncClient(base_url=url, trust_env=False, timeout=30) as client,
    ):
        yield agent, client


def _error(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}, body
    assert body["error"]["code"] == code, body
    message = body["error"]["message"]
    assert isinstance(message, str) and message, body  # it names the problem
    return message


_BEARER = {"Authorization": f"Bearer {AGENT_TOKEN}"}


async def test_each_route_answers_json_in_its_shape(tmp_path: Path) -> None:
    p = candidate_for(ArtifactStore(tmp_path / "trainer"), 89)
    async with agent_app(tmp_path, RecordingEngine(), token=AGENT_TOKEN) as (agent, http):
        info = await http.get("/server_info")  # open: the engine's identity, no token
        assert info.status_code == 200
        assert info.headers["content-type"] == "application/json"
        assert info.json() == {"startup_time": 0, "incarnation": "life-1", "agent": True}
        for method, path in [
            ("POST", "/prepare"),
            ("POST", "/bucket"),
            ("POST", "/load"),
            ("POST", "/unload"),
            ("GET", "/inventory"),
        ]:
            knock = await http.request(method, f"{wire.PREFIX}{path}", content=b"{}")
            _error(knock, 401, "UNAUTHORIZED")
        prepared = await http.post(
            f"{wire.PREFIX}/prepare", content=msgspec.json.encode(p.candidate), headers=_BEARER
        )
        assert prepared.status_code == 200, prepared.text
        assert prepared.headers["content-type"] == "application/json"
        assert prepared.json()["phase"] == "prepared"
        inventory = await http.get(f"{wire.PREFIX}/inventory", headers=_BEARER)
        assert inventory.status_code == 200
        assert inventory.json()["staged"] == [p.name]  # the engine's, plus what the agent stages
        assert inventory.json()["incarnation"] == "life-1"
        bucket = buckets_of(p.tensors)[0]
        upload = wire.BucketUpload(
            lora_name=p.name, attempt=1, digest=p.candidate.digest, bucket=bucket
        )
        ack = await http.post(
            f"{wire.PREFIX}/bucket",
            content=wire.bucket_encoder.encode(upload),
            headers={**_BEARER, "content-type": wire.MSGPACK},
        )
        assert ack.status_code == 200, ack.text
        assert ack.json() == {"index": bucket.index, "received_tensors": len(bucket.tensors)}
        bad = await http.post(f"{wire.PREFIX}/bucket", content=b"\x80", headers=_BEARER)
        assert _error(bad, 400, ErrorCode.BAD_REQUEST).startswith("bad bucket body")
        for path in ("/prepare", "/load", "/unload"):
            _error(
                await http.post(f"{wire.PREFIX}{path}", content=b"{", headers=_BEARER),
                400,
                ErrorCode.BAD_REQUEST,
            )
        unfenced = await http.post(
            f"{wire.PREFIX}/unload", json={"lora_name": p.name}, headers=_BEARER
        )
        assert p.name in _error(unfenced, 400, ErrorCode.ATTEMPT_REQUIRED)
        fenced = await http.post(
            f"{wire.PREFIX}/unload", json={"lora_name": p.name, "attempt": 1}, headers=_BEARER
        )
        assert fenced.status_code == 200 and fenced.json()["was_loaded"] is True
        assert agent.staged_names() == ()
        wrong_method = await http.get(f"{wire.PREFIX}/prepare", headers=_BEARER)
        assert wrong_method.status_code == 405


async def test_an_engine_that_does_not_answer_is_an_ambiguous_503(tmp_path: Path) -> None:
    engine = RecordingEngine()
    engine.down = True
    p = candidate_for(ArtifactStore(tmp_path / "trainer"), 90)
    async with agent_app(tmp_path, engine) as (_, http):
        prepared = await http.post(
            f"{wire.PREFIX}/prepare", content=msgspec.json.encode(p.candidate)
        )
        assert "down" in _error(prepared, 503, ErrorCode.ENGINE_UNREACHABLE)
        assert "down" in _error(await http.get("/server_info"), 503, ErrorCode.ENGINE_UNREACHABLE)


async def test_a_bucket_may_be_larger_than_any_other_body(tmp_path: Path) -> None:
    body = b"\x80" * (MAX_BODY_BYTES + 1)
    assert MAX_BODY_BYTES == 4 * 1024 * 1024 and MAX_BUCKET_BYTES == 256 * 1024 * 1024
    app = create_app(_agent_over(RecordingEngine(), tmp_path))
    transport = httpx.ASGITransport(app=app)  # the whole body in one message: no reset
    async with httpx.AsyncClient(transport=transport, base_url="http://agent") as http:
        too_large = await http.post(f"{wire.PREFIX}/prepare", content=body)
        assert too_large.status_code == 413, too_large.text
        bucket = await http.post(f"{wire.PREFIX}/bucket", content=body)
        _error(bucket, 400, ErrorCode.BAD_REQUEST)  # read whole, then refused as no bucket

        async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: counted as it comes
            for _ in range(5):
                yield b"\x80" * (MAX_BODY_BYTES // 4)

        unannounced = await http.post(f"{wire.PREFIX}/prepare", content=chunked())
        # the app's own handler answers it (the guard's fallback would name the path)
        assert _error(unannounced, 413, "BODY_TOO_LARGE") == "request body over 4194304 bytes"


async def test_a_draining_agent_refuses_publication_steps_and_keeps_cleanup_and_reads_open(
    tmp_path: Path,
) -> None:
    assert {f"{wire.PREFIX}/{step}" for step in ("prepare", "bucket", "load")} == DRAIN_REFUSES
    drain = Drain("h0")
    async with agent_app(tmp_path, RecordingEngine(), drain=drain) as (_, http):
        drain.begin()
        for step in ("prepare", "bucket", "load"):
            refused = await http.post(f"{wire.PREFIX}/{step}", content=b"{}")
            assert refused.status_code == 503, (step, refused.text)
            assert refused.json()["error"]["code"] == ErrorCode.ENGINE_DRAINING
        unload = await http.post(
            f"{wire.PREFIX}/unload", json={"lora_name": "lora-a", "attempt": 1}
        )
        assert unload.status_code == 200, unload.text
        assert (await http.get(f"{wire.PREFIX}/inventory")).status_code == 200
        assert (await http.get("/server_info")).status_code == 200
        assert drain.refused_count == 3


@pytest.mark.parametrize(
    ("idle_s", "every_s"), [(0.1, 0.05), (2.0, 0.5), (120.0, 30.0), (1000.0, 30.0)]
)
async def test_idle_staging_is_swept_a_few_times_per_idle_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, idle_s: float, every_s: float
) -> None:
    """A quarter of the bound, at least 50 ms apart, at most 30 s."""
    slept: list[float] = []

    class Stop(Exception):
        pass

    async def sleep(delay: float) -> None:
        slept.append(delay)
        raise Stop

    agent = Agent(RecordingEngine(), ArtifactStore(tmp_path), staging_idle_s=idle_s)  # type: ignore[arg-type]
    monkeypatch.setattr(anyio, "sleep", sleep)
    with pytest.raises(Stop):
        await agent.expire_idle_forever()
    assert slept == [every_s]


# --- prepare: which candidates, staging per attempt, the idle clock ----------------------------


def _clocked_agent(tmp_path: Path) -> tuple[Agent, list[float]]:
    """An agent over a test double whose clock reads ``now[0]``; idle after 10 s."""
    now = [0.0]
    agent = Agent(
        RecordingEngine(),  # type: ignore[arg-type]
        ArtifactStore(tmp_path / "host"),
        staging_idle_s=10.0,
        clock=lambda: now[0],
    )
    return agent, now


def _published(tmp_path: Path, seed: int, **options: Any) -> Published:
    return candidate_for(ArtifactStore(tmp_path / "trainer"), seed, **options)


def _upload(p: Published, bucket: Any, *, attempt: int | None = None, digest: str = "") -> Any:
    return wire.BucketUpload(
        lora_name=p.name,
        attempt=p.candidate.attempt if attempt is None else attempt,
        digest=digest or p.candidate.digest,
        bucket=bucket,
    )


@pytest.mark.parametrize("attempt", [0, -1, True])
async def test_prepare_refuses_an_attempt_below_one(tmp_path: Path, attempt: Any) -> None:
    engine = RecordingEngine()
    agent = _agent_over(engine, tmp_path)
    p = _published(tmp_path, 91)
    bad = msgspec.structs.replace(p.candidate, attempt=attempt)
    refusal = await expect_refusal(ErrorCode.BAD_REQUEST, agent.prepare(bad))
    assert refusal.message == f"attempt {attempt!r} must be >= 1"
    assert agent.staged_names() == () and engine.calls == []
    assert (await agent.prepare(p.candidate)).phase == "prepared"  # attempt 1 is the first


async def test_prepare_refuses_a_digest_its_manifest_does_not_give(tmp_path: Path) -> None:
    agent = _agent_over(RecordingEngine(), tmp_path)
    p = _published(tmp_path, 92)
    c, other = p.candidate, "f" * 64
    forged = [
        msgspec.structs.replace(c, digest=other),  # the manifest gives another digest
        # a manifest claiming the digest its tensors do not give
        msgspec.structs.replace(
            c, digest=other, manifest=msgspec.structs.replace(c.manifest, digest=other)
        ),
        # the manifest's own digest field alone altered
        msgspec.structs.replace(c, manifest=msgspec.structs.replace(c.manifest, digest=other)),
    ]
    for candidate in forged:
        refusal = await expect_refusal(ErrorCode.DIGEST_MISMATCH, agent.prepare(candidate))
        assert refusal.message == (
            f"candidate digest {candidate.digest[:16]} does not match its manifest"
        )
    twice = msgspec.structs.replace(
        c.manifest, tensors=(c.manifest.tensors[0], c.manifest.tensors[0])
    )
    refusal = await expect_refusal(
        ErrorCode.INVALID_ADAPTER, agent.prepare(msgspec.structs.replace(c, manifest=twice))
    )
    assert refusal.message == "duplicate tensor names"
    assert agent.staged_names() == ()


async def test_an_adapter_larger_than_all_staging_is_refused_at_prepare(tmp_path: Path) -> None:
    p = _published(tmp_path, 93)
    size = p.candidate.manifest.total_bytes
    fits = _agent_over(RecordingEngine(), tmp_path / "a")
    fits.staging_bytes = size
    assert (await fits.prepare(p.candidate)).phase == "prepared"  # exactly the cap fits
    over = _agent_over(RecordingEngine(), tmp_path / "b")
    over.staging_bytes = size - 1
    refusal = await expect_refusal(ErrorCode.STAGING_FULL, over.prepare(p.candidate))
    assert refusal.message == (
        f"{p.name}: {size} bytes can never fit this agent's staging cap of {size - 1} bytes "
        "(--staging-bytes)"
    )
    assert over.staged_names() == ()


async def test_prepare_answers_the_engines_life_and_its_own_receipt(tmp_path: Path) -> None:
    engine = RecordingEngine()
    agent = _agent_over(engine, tmp_path)
    p = _published(tmp_path, 94, attempt=3)
    receipt = await agent.prepare(p.candidate)
    assert (
        receipt.engine_id,
        receipt.incarnation,
        receipt.lora_name,
        receipt.digest,
        receipt.attempt,
        receipt.phase,
    ) == ("e9", "life-1", p.name, p.candidate.digest, 3, "prepared")


async def test_staging_is_per_attempt_and_each_step_resets_its_idle_clock(
    tmp_path: Path,
) -> None:
    agent, now = _clocked_agent(tmp_path)
    p = _published(tmp_path, 95)
    buckets = buckets_of(p.tensors, max_bytes=1)  # one tensor per bucket
    assert len(buckets) >= 3
    await agent.prepare(p.candidate)
    now[0] = 9.0
    assert await agent.receive_bucket(_upload(p, buckets[0])) == 1
    received = agent.staged_bytes()
    assert received == buckets[0].tensors[0].tensor.nbytes
    # a step of another attempt, digest or name is NOT_PREPARED and touches nothing
    for upload in (
        _upload(p, buckets[1], attempt=2),
        _upload(p, buckets[1], digest="e" * 64),
        msgspec.structs.replace(_upload(p, buckets[1]), lora_name="agent@ct-0-other"),
    ):
        refusal = await expect_refusal(ErrorCode.NOT_PREPARED, agent.receive_bucket(upload))
        assert refusal.message == f"{upload.lora_name} attempt {upload.attempt} is not prepared"
    await expect_refusal(
        ErrorCode.NOT_PREPARED, agent.load(msgspec.structs.replace(p.candidate, digest="e" * 64))
    )
    # a retried prepare keeps what arrived, and restarts the clock
    now[0] = 18.0
    await agent.prepare(p.candidate)
    assert agent.staged_bytes() == received
    # the same attempt with another digest needs a new attempt; the staging stays
    other = _published(tmp_path, 96)
    imposter = msgspec.structs.replace(other.candidate, lora_name=p.name)
    refusal = await expect_refusal(ErrorCode.BAD_REQUEST, agent.prepare(imposter))
    assert refusal.message == (
        f"{p.name} attempt 1 is staging digest {p.candidate.digest[:16]}: another digest needs "
        "a new attempt"
    )
    assert agent.staged_bytes() == received
    now[0] = 27.9
    assert agent.expire_idle() == []
    now[0] = 28.0  # exactly the idle bound after the last step
    assert agent.expire_idle() == [p.name]
    assert agent.staged_bytes() == 0


async def test_a_bucket_resets_the_idle_clock(tmp_path: Path) -> None:
    agent, now = _clocked_agent(tmp_path)
    p = _published(tmp_path, 97)
    await agent.prepare(p.candidate)
    now[0] = 9.0
    await agent.receive_bucket(_upload(p, buckets_of(p.tensors, max_bytes=1)[0]))
    now[0] = 18.9
    assert agent.expire_idle() == []
    # any step sweeps what went idle first: a bucket that comes too late is not prepared
    now[0] = 19.0
    await expect_refusal(
        ErrorCode.NOT_PREPARED,
        agent.receive_bucket(_upload(p, buckets_of(p.tensors, max_bytes=1)[1])),
    )
    assert agent.staged_names() == ()


async def test_a_prepare_sweeps_idle_staging_of_other_names(tmp_path: Path) -> None:
    agent, now = _clocked_agent(tmp_path)
    first, second = _published(tmp_path, 98), _published(tmp_path, 99)
    await agent.prepare(first.candidate)
    now[0] = 10.0
    await agent.prepare(second.candidate)
    assert agent.staged_names() == (second.name,)


async def test_room_is_counted_once_per_tensor_up_to_exactly_the_cap(tmp_path: Path) -> None:
    p = _published(tmp_path, 100)
    agent = _agent_over(RecordingEngine(), tmp_path)
    agent.staging_bytes = p.candidate.manifest.total_bytes
    buckets = buckets_of(p.tensors, max_bytes=1)
    await agent.prepare(p.candidate)
    for bucket in buckets:
        await agent.receive_bucket(_upload(p, bucket))
    assert agent.staged_bytes() == agent.staging_bytes
    # a bucket sent again adds nothing: it fits although the staging is full
    assert await agent.receive_bucket(_upload(p, buckets[0])) == len(p.tensors)
    other = _published(tmp_path, 101)
    await agent.prepare(other.candidate)  # fits alone; but no byte is left
    first = buckets_of(other.tensors, max_bytes=1)[0]
    refusal = await expect_refusal(
        ErrorCode.STAGING_FULL, agent.receive_bucket(_upload(other, first))
    )
    grown = agent.staging_bytes + first.tensors[0].tensor.nbytes
    assert refusal.message == (
        f"{other.name}: bucket {first.index} would make the staged bytes {grown}, over this "
        f"agent's cap of {agent.staging_bytes} (--staging-bytes); retry once other "
        "publications loaded or expired"
    )


# --- load: every tensor, written once before the engine is asked, a stored digest reused -------


async def test_load_needs_every_tensor_of_its_manifest(tmp_path: Path) -> None:
    async with on_engine(tmp_path) as a:
        p = a.published(102)
        buckets = buckets_of(p.tensors, max_bytes=1)
        await a.agent.prepare(p.candidate)
        for bucket in buckets[:-1]:
            await a.agent.receive_bucket(_upload(p, bucket))
        last = buckets[-1].tensors[0].name
        refusal = await expect_refusal(ErrorCode.INVALID_ADAPTER, a.agent.load(p.candidate))
        assert refusal.message == f"1 manifest tensors never arrived, e.g. {[last]}"
        assert a.agent.staged_names() == (p.name,)
        assert p.name not in await held(a.engine)
        await a.agent.receive_bucket(_upload(p, buckets[-1]))
        assert (await a.agent.load(p.candidate)).phase == "ready"


async def test_load_writes_the_directory_before_the_engine_is_asked(tmp_path: Path) -> None:
    seen: list[tuple[bool, bool]] = []
    async with on_engine(tmp_path) as a:
        p = a.published(103)

        def after_write() -> None:  # the fault hook: the process may die right here
            store = ArtifactStore(a.host)
            seen.append((store.contains(p.candidate.digest), p.name in a.engine.loaded_adapters()))

        a.agent.after_write = after_write
        await a.agent.prepare(p.candidate)
        await upload(a, p)
        receipt = await a.agent.load(p.candidate)
        assert seen == [(True, False)]
        assert (receipt.phase, receipt.lora_name, receipt.attempt) == ("ready", p.name, 1)
        assert a.agent.staged_names() == ()
        entries = [e for e in (await a.engine.inventory()).adapters if e.lora_name == p.name]
        assert [Path(e.path or "").parent for e in entries] == [a.host]


async def test_a_digest_already_stored_is_reused_without_buckets(tmp_path: Path) -> None:
    async with on_engine(tmp_path) as a:
        p = a.published(104)
        await a.agent.prepare(p.candidate)
        await upload(a, p)
        await a.agent.load(p.candidate)
        await a.agent.unload(p.name, 1)
        assert p.name not in await held(a.engine)
        again = msgspec.structs.replace(p.candidate, attempt=2)
        await a.agent.prepare(again)
        receipt = await a.agent.load(again)  # a repair: no byte sent
        assert (receipt.phase, receipt.attempt) == ("ready", 2)
        assert p.name in await held(a.engine)
        assert a.agent.staged_names() == ()
        # a stale step of the first attempt never resurrects it
        await expect_refusal(ErrorCode.STALE_ATTEMPT, a.agent.load(p.candidate))


async def test_a_stored_digest_with_some_buckets_sent_needs_them_all(tmp_path: Path) -> None:
    async with on_engine(tmp_path) as a:
        p = a.published(105)
        ArtifactStore(a.host).put(p.candidate.manifest, p.tensors)  # stored already
        await a.agent.prepare(p.candidate)
        buckets = buckets_of(p.tensors, max_bytes=1)
        await a.agent.receive_bucket(_upload(p, buckets[0]))
        await expect_refusal(ErrorCode.INVALID_ADAPTER, a.agent.load(p.candidate))
        for bucket in buckets[1:]:
            await a.agent.receive_bucket(_upload(p, bucket))
        assert (await a.agent.load(p.candidate)).phase == "ready"
        assert _temp_dirs(a.host) == []  # the staged copy was dropped, the stored one reused


def _temp_dirs(host: Path) -> list[str]:
    return sorted(p.name for p in host.iterdir() if p.name.startswith("."))


# --- receive_bucket under concurrency: forced, not hoped for -----------------------------------


async def test_two_first_buckets_at_once_stage_into_one_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both begin a directory (held at a barrier until both are in): one is kept, the other is
    dropped, and both buckets land in the one kept."""
    agent = _agent_over(RecordingEngine(), tmp_path)
    p = _published(tmp_path, 106)
    first, second = buckets_of(p.tensors, max_bytes=1)[:2]
    both_in = threading.Barrier(2, timeout=30)
    begin = ArtifactStore.begin

    def held_begin(store: ArtifactStore, manifest: Any) -> StagedWeights:
        both_in.wait()
        return begin(store, manifest)

    monkeypatch.setattr(ArtifactStore, "begin", held_begin)
    await agent.prepare(p.candidate)
    counts: list[int] = []

    async def send(bucket: Any) -> None:
        counts.append(await agent.receive_bucket(_upload(p, bucket)))

    async with anyio.create_task_group() as tg:
        tg.start_soon(send, first)
        tg.start_soon(send, second)
    # The one to finish last counts both; the other counts 1, or 2 when both writes ended
    # before either task resumed (the threads' order is the scheduler's).
    assert len(counts) == 2 and counts[-1] == 2 and counts[0] in (1, 2)
    assert agent.staged_bytes() == sum(b.tensors[0].tensor.nbytes for b in (first, second))
    assert len(_temp_dirs(tmp_path / "host")) == 1  # the other directory was dropped


@pytest.mark.parametrize("how", ["prepared again", "unloaded"])
async def test_a_bucket_whose_staging_went_while_it_was_checked_is_not_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    agent = _agent_over(RecordingEngine(), tmp_path)
    p = _published(tmp_path, 107)
    checking, go_on = threading.Event(), threading.Event()
    held_step = StagedWeights.check if how == "prepared again" else StagedWeights.write
    name = "check" if how == "prepared again" else "write"

    def held(weights: StagedWeights, *args: Any) -> Any:
        checking.set()
        assert go_on.wait(30)
        return held_step(weights, *args)

    monkeypatch.setattr(StagedWeights, name, held)
    await agent.prepare(p.candidate)
    outcome: list[BaseException] = []

    async def send() -> None:
        try:
            await agent.receive_bucket(_upload(p, buckets_of(p.tensors, max_bytes=1)[0]))
        except CleanRefusal as exc:
            outcome.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(send)
        await anyio.to_thread.run_sync(checking.wait)
        if how == "prepared again":
            await agent.prepare(msgspec.structs.replace(p.candidate, attempt=2))
        else:
            await agent.unload(p.name, 1)
        go_on.set()
    (refusal,) = outcome
    assert isinstance(refusal, CleanRefusal) and refusal.code == ErrorCode.NOT_PREPARED
    words = "was prepared again meanwhile" if how == "prepared again" else "was dropped meanwhile"
    assert refusal.message == f"{p.name} {words}"
    assert agent.staged_bytes() == 0
    assert _temp_dirs(tmp_path / "host") == []


async def test_a_bucket_is_refused_when_others_filled_the_staging_while_it_was_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Room is counted again once a bucket's checksums are taken: another publication's
    buckets may have filled the staging meanwhile. The refusal names the late bucket, and
    none of its tensors is kept."""
    agent = _agent_over(RecordingEngine(), tmp_path)
    late, other = _published(tmp_path, 108), _published(tmp_path, 109)
    agent.staging_bytes = other.candidate.manifest.total_bytes
    checking, go_on = threading.Event(), threading.Event()
    check = StagedWeights.check

    def first_check_held(weights: StagedWeights, *args: Any) -> Any:
        if not checking.is_set():  # only the late bucket's, the first to be checked
            checking.set()
            assert go_on.wait(30)
        return check(weights, *args)

    monkeypatch.setattr(StagedWeights, "check", first_check_held)
    await agent.prepare(late.candidate)
    await agent.prepare(other.candidate)
    bucket = buckets_of(late.tensors, max_bytes=1)[0]
    outcome: list[BaseException] = []

    async def send() -> None:
        try:
            await agent.receive_bucket(_upload(late, bucket))
        except CleanRefusal as exc:
            outcome.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(send)
        await anyio.to_thread.run_sync(checking.wait)  # its room was counted: it fitted then
        for other_bucket in buckets_of(other.tensors):
            await agent.receive_bucket(_upload(other, other_bucket))
        go_on.set()
    (refusal,) = outcome
    assert isinstance(refusal, CleanRefusal) and refusal.code == ErrorCode.STAGING_FULL
    grown = agent.staging_bytes + bucket.tensors[0].tensor.nbytes
    assert refusal.message == (
        f"{late.name}: bucket {bucket.index} would make the staged bytes {grown}, over this "
        f"agent's cap of {agent.staging_bytes} (--staging-bytes); retry once other "
        "publications loaded or expired"
    )
    assert agent.staged_bytes() == agent.staging_bytes  # the other publication's, whole


async def test_run_refuses_an_unsafe_configuration_before_it_starts(tmp_path: Path) -> None:
    with pytest.raises(UnsafeConfiguration), anyio.fail_after(10):  # not: serves until killed
        await run(
            engine="sglang:http://127.0.0.1:9",
            artifacts=str(tmp_path),
            engine_token=ENGINE_TOKEN,
        )


def test_the_commands_help_names_it_and_each_option(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    usage = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal
    assert usage.startswith("usage: python -m engines.agent ")
    assert "The engine-host agent: publication to a path-loading engine without a shared " in usage
    assert "SGLang and vLLM" not in usage  # the docstring's first line only
    for words in (
        "--engine ENGINE KIND:URL, e.g. sglang:http://127.0.0.1:30000",
        "--artifacts ARTIFACTS this host's artifact directory",
        "--id ID the fleet member's engine id",
        "--served-model SERVED_MODEL vLLM's --served-model-name",
        "--exit-after-write fault mode (tests)",
        "--drain-timeout DRAIN_TIMEOUT on SIGTERM, how long the steps already running may "
        "take (seconds)",
    ):
        assert words in usage, words


async def test_a_bucket_counts_as_a_step_from_its_arrival_to_its_last_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refused bucket of the right attempt is a step too; and a bucket whose checksums took
    a while restarts the clock when it is written, not when it arrived."""
    agent, now = _clocked_agent(tmp_path)
    p = _published(tmp_path, 108)
    first, second = buckets_of(p.tensors, max_bytes=1)[:2]
    await agent.prepare(p.candidate)
    now[0] = 9.0
    data = bytearray(first.tensors[0].tensor.data)
    data[0] ^= 0xFF
    flipped = msgspec.structs.replace(
        first,
        tensors=(
            msgspec.structs.replace(
                first.tensors[0],
                tensor=msgspec.structs.replace(first.tensors[0].tensor, data=bytes(data)),
            ),
        ),
    )
    await expect_refusal(ErrorCode.DIGEST_MISMATCH, agent.receive_bucket(_upload(p, flipped)))
    now[0] = 18.9
    assert agent.expire_idle() == []  # idle from 9.0, the refused bucket's arrival
    check = StagedWeights.check

    def slow_check(weights: StagedWeights, name: str, tensor: Any) -> str:
        now[0] = 25.0  # the checksums took a while
        return check(weights, name, tensor)

    monkeypatch.setattr(StagedWeights, "check", slow_check)
    await agent.receive_bucket(_upload(p, second))
    now[0] = 34.9
    assert agent.expire_idle() == []  # idle from 25.0, its last write
    now[0] = 35.0
    assert agent.expire_idle() == [p.name]


async def test_a_load_with_nothing_sent_names_the_first_missing_tensors(tmp_path: Path) -> None:
    agent = _agent_over(RecordingEngine(), tmp_path)
    p = _published(tmp_path, 109)
    names = sorted(t.name for t in p.candidate.manifest.tensors)
    assert len(names) > 3
    await agent.prepare(p.candidate)
    refusal = await expect_refusal(ErrorCode.INVALID_ADAPTER, agent.load(p.candidate))
    assert refusal.message == f"{len(names)} manifest tensors never arrived, e.g. {names[:3]}"


async def test_a_manifest_without_tensors_loads_nothing(tmp_path: Path) -> None:
    engine = RecordingEngine()
    agent = _agent_over(engine, tmp_path)
    p = _published(tmp_path, 110)
    config = p.candidate.manifest.config
    digest = compute_digest(config, ())
    empty = msgspec.structs.replace(
        p.candidate,
        digest=digest,
        manifest=msgspec.structs.replace(p.candidate.manifest, tensors=(), digest=digest),
    )
    await agent.prepare(empty)
    refusal = await expect_refusal(ErrorCode.INVALID_ADAPTER, agent.load(empty))
    assert refusal.message == f"{p.name}: no bytes were staged"
    assert [c for c in engine.calls if c[0] != "incarnation"] == []
