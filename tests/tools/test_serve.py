"""``loraledger serve``: the real console script as a subprocess (stopped by its PID), and the
service in process over two real local engines (publish, bind, in-flight, metrics).

Network only on loopback: every server here listens on 127.0.0.1, on a port the OS picks.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engines.guard import is_loopback
from tests.support.paths import REPO
from tests.support.waiting import wait_for
from tests.tools.conftest import Cli, console_script, script_env
from tools.exitcodes import Exit
from tools.serve import ServeOptions, serve
from tools.service_options import parse_engine

TOKEN = "t0ken-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# one owner life: its incarnation and the secret every owner-bound call carries
LIFE = {"incarnation": "life-1", "secret": "s" * 64}


def _metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


class Served:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, db: Path) -> None:
        self.proc, self.url, self.db = proc, url, db


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    """``loraledger serve`` as a user starts it, on a free loopback port; stopped by PID."""
    db = tmp_path / "served.db"
    out, err = tmp_path / "serve.out", tmp_path / "serve.err"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        proc = subprocess.Popen(
            [*console_script(), "serve", "--db", str(db), "--port", "0", "--json"],
            cwd=REPO,
            stdout=stdout,
            stderr=stderr,
            env=script_env(LORALEDGER_TOKEN=TOKEN),
        )
    try:
        deadline = time.monotonic() + 30
        while not out.read_text().strip():
            assert proc.poll() is None, f"serve exited {proc.returncode}: {err.read_text()}"
            assert time.monotonic() < deadline, f"serve did not listen: {err.read_text()}"
            time.sleep(0.05)
        ready = json.loads(out.read_text().splitlines()[0])
        assert ready["row"] == "listening" and ready["pid"] == proc.pid
        yield Served(proc, ready["url"], db)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def test_health_status_metrics_and_the_token(served: Served, cli: Cli) -> None:
    with httpx.Client(base_url=served.url, trust_env=False, timeout=10) as http:
        health = http.get("/health").json()
        assert health["ok"] is True and health["deployment"] == "default"
        status = http.get("/status").json()
        assert (status["capacity"], status["default"], status["epoch"]) == (3, None, 1)
        metrics = _metrics(http.get("/metrics").text)
        assert metrics[("loraledger_capacity_limit", ())] == 3.0
        assert metrics[("loraledger_versions", (("state", "PUBLISHED"),))] == 0.0

        # state-changing routes: no token, a wrong token -> 401; the right one -> accepted
        refused = http.post("/owners", json={"owner": "w1"})
        assert refused.status_code == 401 and refused.json()["code"] == "UNAUTHORIZED"
        assert refused.headers["www-authenticate"].startswith("Bearer")
        wrong = http.post("/owners", json={"owner": "w1"}, headers={"Authorization": "Bearer x"})
        assert wrong.status_code == 401
        assert http.post("/sessions/s1/bind", json={"owner": "w1"}).status_code == 401
        # nothing happened: the one owner is the OpenAI routes' own (registered at start)
        assert http.get("/status").json()["owners"] == 1
        ok = http.post("/owners", json={"owner": "w1", "ttl_s": 60, **LIFE}, headers=AUTH)
        assert ok.status_code == 200, ok.text
        # a refusal keeps the ledger's code
        bind = http.post("/sessions/s1/bind", json={"owner": "w1", **LIFE}, headers=AUTH)
        assert (bind.status_code, bind.json()["code"]) == (409, "NO_PUBLISHED_VERSION")
        bad = http.post("/owners", content=b"{not json", headers=AUTH)
        assert (bad.status_code, bad.json()["code"]) == (400, "INVALID_INPUT")
        # counted from the start of the HTTP service (the OpenAI owner registered before it), by
        # the service's log follower: the count arrives shortly after the answer
        key = ("loraledger_events_appended_total", (("type", "OwnerRegistered"),))
        deadline = time.monotonic() + 10
        while key not in (counted := _metrics(http.get("/metrics").text)):
            assert time.monotonic() < deadline, f"OwnerRegistered never counted: {counted}"
            time.sleep(0.01)
        assert counted[key] == 1

    live = cli("status", "--url", served.url, "--json")
    assert live.returncode == 0, live.stderr
    row = json.loads(live.stdout)
    assert (row["row"], row["owners"]) == ("status", 2)  # w1 and the OpenAI routes' owner
    human = cli("status", "--url", served.url)
    assert f"ledger at {served.url}" in human.stdout and "deployment default" in human.stdout

    # SIGTERM: a clean stop (exit 0), and the log it wrote verifies
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(timeout=20) == 0
    check = cli("verify", served.db, "--json")
    assert check.returncode == 0, check.stdout
    assert cli("status", "--url", served.url, "--timeout", "1").returncode == Exit.UNREACHABLE


def _unopenable(tmp_path: Path) -> Path:
    """A db path that cannot be created (its parent is a file): should a refusal ever regress,
    serve fails to open the log instead of listening anywhere."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    return blocker / "never.db"


def test_listening_beyond_loopback_needs_a_token(cli: Cli, tmp_path: Path) -> None:
    db = _unopenable(tmp_path)
    for host in ("0.0.0.0", "::", "192.0.2.10", "ledger.example.com"):
        result = cli("serve", "--db", db, "--host", host)
        assert result.returncode == Exit.UNSAFE, (host, result.stdout, result.stderr)
        assert "without a token" in result.stderr
    assert not db.exists()  # refused before anything was opened
    assert [is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "127.3.2.1")] == [True] * 4


def test_engine_specs(cli: Cli, tmp_path: Path) -> None:
    assert parse_engine("e0=sglang:http://127.0.0.1:30000").url == "http://127.0.0.1:30000"
    local = parse_engine("e1=local:")
    assert (local.kind, local.url) == ("local", None)
    db = _unopenable(tmp_path)
    for bad in ("e0", "e0=tgi:http://x", "e0=vllm:", "e/0=local:", "e0=sglang:ftp://x"):
        result = cli("serve", "--db", db, "--engine", bad)
        assert result.returncode == Exit.USAGE, bad
    assert not db.exists()


def _adapter_dir(root: Path, seed: int) -> Path:
    from engines.artifacts import serialize_safetensors
    from engines.local.tinymodel import make_adapter

    config, tensors = make_adapter(seed)
    out = root / f"adapter-{seed}"
    out.mkdir()
    (out / "adapter_config.json").write_text(json.dumps(config))
    (out / "adapter_model.safetensors").write_bytes(serialize_safetensors(tensors))
    return out


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft's
async def test_publish_bind_and_inflight_show_in_metrics(tmp_path: Path) -> None:
    """In process, two local engines: POST /versions publishes to both, the gauges follow."""
    opts = ServeOptions(
        db=str(tmp_path / "live.db"),
        port=0,
        token=TOKEN,
        engines=(parse_engine("e0=local:"), parse_engine("e1=local:")),
        deployment="live",
        capacity=2,
    )
    urls: list[str] = []
    listening, stop = anyio.Event(), anyio.Event()

    def ready(url: str) -> None:
        urls.append(url)
        listening.set()

    adapters = [_adapter_dir(tmp_path, seed) for seed in (1, 2)]

    async def client() -> None:
        with anyio.fail_after(60):
            await listening.wait()
        async with httpx.AsyncClient(base_url=urls[0], trust_env=False, timeout=60) as http:
            first = await http.post(
                "/versions", json={"version_id": 1, "adapter_dir": str(adapters[0])}, headers=AUTH
            )
            assert first.status_code == 200, first.text
            assert first.json()["status"] == "PUBLISHED"
            await http.post("/owners", json={"owner": "w1", **LIFE}, headers=AUTH)
            bound = await http.post("/sessions/s1/bind", json={"owner": "w1", **LIFE}, headers=AUTH)
            assert bound.json()["version_id"] == 1
            second = await http.post(
                "/versions", json={"version_id": 2, "adapter_dir": str(adapters[1])}, headers=AUTH
            )
            assert second.json()["retired"] == 1
            renew = await http.post(
                "/owners/w1/renew",
                json={"inflight": [{"engine": "e1", "version_id": 1, "count": 2}], **LIFE},
                headers=AUTH,
            )
            assert renew.status_code == 200, renew.text
            # The event counters and the latency histogram follow the log (the service's
            # follower observes each committed record), so they may trail a reply by a moment
            # on a loaded machine; the state gauges are read from the ledger at scrape time.
            latency = ("loraledger_publish_latency_seconds_count", ())
            with anyio.fail_after(30):
                m = _metrics((await http.get("/metrics")).text)
                while m.get(latency) != 2:  # an HTTP scrape: there is no event to await
                    await anyio.sleep(0.05)
                    m = _metrics((await http.get("/metrics")).text)
            assert m[("loraledger_versions", (("state", "PUBLISHED"),))] == 1
            assert m[("loraledger_versions", (("state", "RETIRED"),))] == 1
            assert m[("loraledger_capacity_used", ())] == 2
            assert m[("loraledger_bound_sessions", (("state", "RETIRED"), ("version", "1")))] == 1
            assert m[("loraledger_inflight_requests", (("engine", "e1"),))] == 2
            assert m[("loraledger_inflight_requests", (("engine", "e0"),))] == 0
            assert m[("loraledger_engine_routable", (("engine", "e0"),))] == 1
            status = (await http.get("/status")).json()
            assert [v["holders"] for v in status["versions"]] == [["e0", "e1"], ["e0", "e1"]]
        stop.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(client)
        await serve(opts, on_ready=ready, handle_signals=False, stop=stop)


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft's
async def test_a_rollback_over_http_is_refused_until_it_is_meant(tmp_path: Path) -> None:
    """The refusal says "pass allow_rollback=True to mean it": the route takes that field."""
    from tests.tools.serving import serving

    adapters = [_adapter_dir(tmp_path, seed) for seed in (1, 2)]
    engines = (parse_engine("e0=local:"),)
    async with (
        serving(tmp_path / "roll.db", token=TOKEN, engines=engines) as url,
        httpx.AsyncClient(base_url=url, trust_env=False, timeout=60, headers=AUTH) as http,
    ):
        first = await http.post(
            "/versions", json={"version_id": 5, "adapter_dir": str(adapters[0])}
        )
        assert first.status_code == 200, first.text
        back = {"version_id": 3, "adapter_dir": str(adapters[1])}
        refused = await http.post("/versions", json=back)
        assert (refused.status_code, refused.json()["code"]) == (409, "VERSION_REGRESSION")
        meant = await http.post("/versions", json={**back, "allow_rollback": True})
        assert meant.status_code == 200, meant.text
        assert (meant.json()["version_id"], meant.json()["retired"]) == (3, 5)
        assert (await http.get("/status")).json()["default"] == 3


class _Process:
    """A console-script process that prints one JSON "listening" row on stdout when ready."""

    def __init__(self, tmp_path: Path, name: str, *args: str, cwd: Path = REPO, **env: str) -> None:
        self.out, self.err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
        with open(self.out, "wb") as stdout, open(self.err, "wb") as stderr:
            self.proc = subprocess.Popen(
                [*console_script(), *args],
                cwd=cwd,
                stdout=stdout,
                stderr=stderr,
                env=script_env(**env),
            )

    def ready(self, timeout: float = 120.0) -> dict[str, object]:
        deadline = time.monotonic() + timeout
        while not self.out.read_text().strip():
            assert self.proc.poll() is None, f"exited {self.proc.returncode}: {self.stderr()}"
            assert time.monotonic() < deadline, f"not listening: {self.stderr()}"
            time.sleep(0.05)
        row: dict[str, object] = json.loads(self.out.read_text().splitlines()[0])
        assert row["row"] == "listening" and row["pid"] == self.proc.pid
        return row

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def stop(self) -> int:
        """SIGTERM by PID: a clean stop exits 0."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)


def _serve_process(tmp_path: Path, name: str, engine: str, *flags: str, **env: str) -> _Process:
    """``loraledger serve`` on its own log (``NAME.db``), on a port the OS picks, over one
    engine (``--engine`` ``ENGINE``), with the CLI's ``flags`` (``-v``) before the command."""
    db = str(tmp_path / f"{name}.db")
    args = ("serve", "--db", db, "--port", "0", "--engine", engine, "--json")
    return _Process(tmp_path, name, *flags, *args, cwd=REPO, **env)


def _serve_for(tmp_path: Path, name: str, engine_url: object, *flags: str) -> str:
    """``loraledger serve`` over one HTTP engine until its health loop woke three times (each
    wake probes the engine); its stderr."""
    served = _serve_process(tmp_path, name, f"e0=local:{engine_url}", *flags)
    try:
        url = served.ready()["url"]
        deadline = time.monotonic() + 60
        wakes = ("loraledger_health_wakes_total", ())
        while _metrics(httpx.get(f"{url}/metrics", trust_env=False).text)[wakes] < 3:
            assert time.monotonic() < deadline, "serve's health loop did not wake 3 times in 60 s"
            time.sleep(0.05)
    finally:
        assert served.stop() == 0, served.stderr()
    return served.stderr()


def test_serve_logs_no_line_per_probe(tmp_path: Path) -> None:
    """With -v a service's log shows decisions, not each HTTP request its probes make (httpx
    logs one INFO line per request); -vv shows everything."""
    engine = _Process(tmp_path, "engine", "engine", "--id", "e0", "--port", "0", "--json")
    try:
        url = engine.ready()["url"]
        decisions = _serve_for(tmp_path, "decisions", url, "-v")
        chatty = _serve_for(tmp_path, "chatty", url, "-vv")
    finally:
        assert engine.stop() == 0, engine.stderr()
    assert "serve.listening" in decisions  # -v: info level
    assert "HTTP Request" not in decisions, decisions[-2000:]
    assert chatty.count("HTTP Request") >= 3, chatty[-2000:]  # the probes were there


# A line of serve's log as structlog's console renderer writes it: time, [level], event, fields.
_LOG_LINE = re.compile(r"^\S+Z \[(?P<level>\w+)\s*\] (?P<event>\S+)(?P<fields>.*)$")
_SEQ = re.compile(r"\bseq=(\d+)")


async def _serve_a_story(tmp_path: Path, name: str, *flags: str) -> tuple[str, str, int]:
    """A real ``serve`` over an in-process engine through a short story: publish v1, six turns
    of one session through the OpenAI routes (one streamed), publish v2, release the session,
    v1 reclaimed; then SIGTERM. Its stdout, its stderr and the last seq of the story."""
    adapters = [tmp_path / f"adapter-{seed}" for seed in (1, 2)]
    for seed, adapter in enumerate(adapters, start=1):
        if not adapter.exists():
            _adapter_dir(tmp_path, seed)
    served = _serve_process(tmp_path, name, "e0=local:", *flags, LORALEDGER_TOKEN=TOKEN)
    try:
        url = str(served.ready()["url"])
        async with httpx.AsyncClient(
            base_url=url, trust_env=False, timeout=60, headers=AUTH
        ) as http:
            for version, adapter in enumerate(adapters, start=1):
                body = {"version_id": version, "adapter_dir": str(adapter)}
                published = await http.post("/versions", json=body)
                assert published.status_code == 200, published.text
                for turn in range(6 if version == 1 else 0):
                    chat = {
                        "model": "policy",
                        "messages": [{"role": "user", "content": f"turn {turn}"}],
                        "max_tokens": 2,
                        "stream": turn == 5,
                    }
                    reply = await http.post(
                        "/v1/chat/completions", json=chat, headers={"x-session-id": "s1"}
                    )
                    assert reply.status_code == 200, reply.text
            assert (await http.post("/v1/sessions/s1/release")).status_code == 200

            async def reclaimed() -> bool:
                versions = (await http.get("/status")).json()["versions"]
                return any(v["version_id"] == 1 and v["state"] == "RECLAIMED" for v in versions)

            await wait_for("v1 reclaimed", reclaimed, timeout=30)
            last_seq = int((await http.get("/status")).json()["last_seq"])
    finally:
        assert served.stop() == 0, served.stderr()
    return served.out.read_text(), served.stderr(), last_seq


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft's
async def test_serve_is_quiet_by_default_and_logs_each_decision_once_with_v(
    tmp_path: Path,
) -> None:
    """The README's promise: quiet by default (the start banner on stdout, warnings on
    stderr), one line per decision with its seq with -v. Before, serve logged at info level
    without -v: 30-odd lines for this story (each event, the drivers' account of it), a
    progress bar from the in-process engine's model load and a peft warning per unload, and
    hundreds over a longer run."""
    out, quiet, _ = await _serve_a_story(tmp_path, "quiet")
    assert len(out.splitlines()) == 1  # the "listening" row
    assert len(quiet.splitlines()) <= 2, quiet  # warnings only: none in this story
    assert "[info" not in quiet and "[debug" not in quiet, quiet

    _, loud, last_seq = await _serve_a_story(tmp_path, "loud", "-v")
    lines = loud.splitlines()
    parsed = [_LOG_LINE.match(line) for line in lines]
    assert all(parsed), [line for line, m in zip(lines, parsed, strict=True) if m is None]
    logged = [m for m in parsed if m is not None]
    decided = [int(_SEQ.findall(m["fields"])[0]) for m in logged if m["event"] == "event"]
    # every decision of the story, each on one line with its seq
    assert len(decided) == len(set(decided)), decided
    assert set(range(decided[0], last_seq + 1)) <= set(decided), (decided, last_seq)
    # the other lines are the drivers' account of those decisions (a seq each) and the
    # service's start and stop: nothing per turn, per request or per probe
    unsequenced = [m["event"] for m in logged if not _SEQ.search(m["fields"])]
    assert len(unsequenced) <= 4, unsequenced
    assert len(logged) <= 2 * len(decided) + 4, loud
