"""A trainer on another host publishes through ``loraledger serve`` with no filesystem shared
between them: the adapter's bytes travel over HTTP (``HttpTrainerClient``, ``loraledger
publish --url``), streamed, checked against their digest on arrival, resumed after a lost
connection, and published once.

Real processes throughout: ``loraledger serve`` in its own working directory, ``loraledger
engine`` processes (a local engine server with a rank limit high enough for a 64 MiB adapter
for the memory test), every one stopped by its PID. Faults between trainer and service come from
the TCP relay of ``tests/support/relay.py``. Before these, a trainer could publish only a path
on the service's own host (``POST /versions`` with ``adapter_dir``): none of this existed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import anyio
import httpx
import pytest

from engines.artifacts import AdapterFiles, describe_adapter_dir, serialize_safetensors
from engines.local.tinymodel import make_adapter
from evlog.events import AttemptStarted, CommandRecorded, Event, VersionPublished
from evlog.sqlite import SQLiteStore
from publisher.core.errors import Code
from publisher.drivers.publication import ErrorKind, PublicationError
from publisher.remote import HttpTrainerClient
from tests.publisher.rollout_kit import ENGINE_WARNINGS
from tests.support.log import events
from tests.support.memory import PeakGrowth
from tests.support.paths import REPO
from tests.support.relay import Relay
from tests.support.waiting import wait_for
from tests.tools.conftest import console_script, script_env
from tests.tools.test_serve import _Process

pytestmark = [pytest.mark.anyio, *ENGINE_WARNINGS]
TOKEN = "remote-trainer-token"
MiB = 1024 * 1024


@contextmanager
def engines(tmp_path: Path, n: int) -> Iterator[list[str]]:
    """``n`` ``loraledger engine`` processes; their URLs."""
    procs = [
        _Process(tmp_path, f"e{i}", "engine", "--id", f"e{i}", "--port", "0", "--json")
        for i in range(n)
    ]
    try:
        yield [str(p.ready()["url"]) for p in procs]
    finally:
        for p in procs:
            assert p.stop() == 0, p.stderr()


@contextmanager
def serve_process(home: Path, engine_urls: list[str]) -> Iterator[tuple[str, _Process]]:
    """``loraledger serve`` with ``home`` as its working directory (its log and artifact
    store there, nothing else it is told about), the token from the environment."""
    home.mkdir()
    (home / "token").write_text(TOKEN + "\n")
    flags = [f"--engine=e{i}=local:{url}" for i, url in enumerate(engine_urls)]
    proc = _Process(
        home,
        "serve",
        "serve",
        "--db",
        "ledger.db",
        "--port",
        "0",
        "--token-file",
        "token",
        "--deployment",
        "remote",
        *flags,
        "--json",
        cwd=home,
    )
    try:
        yield str(proc.ready()["url"]), proc
    finally:
        assert proc.stop() == 0, proc.stderr()


def adapter(
    root: Path, seed: int, *, r: int = 8, targets: tuple[str, ...] = ("q_proj", "v_proj")
) -> Path:
    """A PEFT directory (rank ``r`` on ``targets`` of the tiny model, float32)."""
    config, tensors = make_adapter(seed, r=r, targets=targets)
    out = root / f"adapter-{seed}"
    out.mkdir()
    (out / "adapter_config.json").write_text(json.dumps(config))
    (out / "adapter_model.safetensors").write_bytes(serialize_safetensors(tensors))
    return out


def trainer_client(url: str, **options: float) -> HttpTrainerClient:
    """A client with a connection per request (the relay carries one request per
    connection)."""
    http = httpx.AsyncClient(
        base_url=url,
        headers={"authorization": f"Bearer {TOKEN}"},
        timeout=60,
        trust_env=False,
        limits=httpx.Limits(max_keepalive_connections=0),
    )
    return HttpTrainerClient(url, token=TOKEN, client=http, **options)


async def logged(db: Path) -> list[Event]:
    """The events of a running service's log, read through a read-only connection."""
    store = await SQLiteStore.connect_read_only(f"{db.as_uri()}?mode=ro")
    try:
        return await events(store)
    finally:
        await store.close()


async def turn(url: str, session: str) -> httpx.Response:
    """One generation through serve's OpenAI route."""
    async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=60) as http:
        reply = await http.post(
            "/v1/chat/completions",
            json={
                "model": "policy",
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 4,
            },
            headers={"authorization": f"Bearer {TOKEN}", "x-session-id": session},
        )
    assert reply.status_code == 200, reply.text
    return reply


def publish_cli(
    url: str, adapter: Path, version: int, *flags: str
) -> subprocess.CompletedProcess[str]:
    """``loraledger publish`` as a user runs it, the token in a file of its own."""
    token = adapter.parent / "cli-token"
    token.write_text(TOKEN + "\n")
    env = script_env()
    env.pop("LORALEDGER_TOKEN", None)
    return subprocess.run(
        [
            *console_script(),
            "publish",
            "--url",
            url,
            "--version",
            str(version),
            "--token-file",
            str(token),
            *flags,
            str(adapter),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=adapter.parent,
        env=env,
    )


async def test_a_trainer_on_another_host_publishes_and_its_versions_are_served(
    tmp_path: Path,
) -> None:
    """The trainer's directory is deleted after the upload and before the publication: serve
    publishes from the bytes it received, into its own artifact store, and serves them. Then
    ``loraledger publish --url`` publishes the next step, and ``allow_rollback`` is honoured
    on both (refused ``VERSION_REGRESSION`` without it, with the ledger's code)."""
    trainer_home = tmp_path / "trainer"
    trainer_home.mkdir()
    with engines(tmp_path, 2) as urls, serve_process(tmp_path / "serve", urls) as (url, _):
        async with HttpTrainerClient(url, token=TOKEN) as trainer:
            step10 = await trainer.upload(adapter(trainer_home, 10))
            shutil.rmtree(trainer_home / "adapter-10")
            published = await trainer.publish_uploaded(step10.digest, step=10)
            assert (published.status, published.version_id) == ("PUBLISHED", 10)
            assert published.digest == step10.digest
            assert (tmp_path / "serve" / "ledger.db.artifacts" / step10.digest).is_dir()
            first = await turn(url, "episode-1")
            assert first.headers["x-loraledger-version"] == "10"
            assert first.headers["x-loraledger-digest"] == step10.digest

            by_cli = publish_cli(url, adapter(trainer_home, 20), 20, "--json")
            assert by_cli.returncode == 0, by_cli.stderr
            row = json.loads(by_cli.stdout)
            assert (row["row"], row["status"], row["version_id"]) == (
                "publication",
                "PUBLISHED",
                20,
            )
            assert (await turn(url, "episode-2")).headers["x-loraledger-version"] == "20"
            assert (await turn(url, "episode-1")).headers["x-loraledger-version"] == "10"

            back = adapter(trainer_home, 15)
            with pytest.raises(PublicationError) as refused:
                await trainer.publish(back, step=15)
            assert (refused.value.code, refused.value.kind) == (
                Code.VERSION_REGRESSION,
                ErrorKind.FATAL,
            )
            by_cli = publish_cli(url, back, 15)
            assert by_cli.returncode == 1
            assert "VERSION_REGRESSION" in by_cli.stderr, by_cli.stderr
            meant = await trainer.publish(back, step=15, allow_rollback=True)
            assert (meant.status, meant.retired) == ("PUBLISHED", 20)
            assert (await trainer.status()).default == 15
            assert (await turn(url, "episode-3")).headers["x-loraledger-version"] == "15"
        log = await logged(tmp_path / "serve" / "ledger.db")
    published_versions = [e.version_id for e in log if isinstance(e, VersionPublished)]
    assert published_versions == [10, 20, 15]
    assert not list((tmp_path / "serve" / "ledger.db.artifacts" / ".uploads").iterdir())


async def test_a_cut_upload_resumes_and_a_lost_reply_is_answered_with_the_same_outcome(
    tmp_path: Path,
) -> None:
    """The connection is cut after 256 KiB of the weights: the client offers again and sends
    only the rest (the bytes that arrived were kept). Then the publication's reply is lost
    after serve published: asked again with the same request id, serve answers the same
    ``PUBLISHED`` (same revision, attempt), from the log, and the version was allocated and
    published once. A new request for the step is the ordinary ``NO_OP``."""
    trainer_home = tmp_path / "trainer"
    trainer_home.mkdir()
    cut_at = 64 * 1024
    step3 = adapter(trainer_home, 7, r=64)
    digest = describe_adapter_dir(step3).digest
    size = (step3 / "adapter_model.safetensors").stat().st_size
    assert size > 2 * cut_at
    home = tmp_path / "serve"
    partial = home / "ledger.db.artifacts" / ".uploads" / f"{digest}.part"
    with engines(tmp_path, 1) as urls, serve_process(home, urls) as (url, _):
        cutter = Relay(url, "cut", requests=(b"PUT /adapters/",), faults=1, at=cut_at)
        loser = Relay(url, "reset", requests=(b"POST /versions",), faults=1)
        async with cutter.running() as cut_url, loser.running() as lossy_url:
            uploaded: list[AdapterFiles] = []
            reports: list[tuple[int, int]] = []  # what a progress bar is told
            async with trainer_client(cut_url) as uploader, anyio.create_task_group() as tg:
                uploader.upload_progress = lambda sent, total: reports.append((sent, total))

                async def upload() -> None:
                    uploaded.append(await uploader.upload(step3))

                tg.start_soon(upload)
                await wait_for(
                    "the bytes before the cut on serve's disk",
                    lambda: partial.exists() and partial.stat().st_size == cut_at,
                    timeout=60,
                    every=0.01,
                )
                cutter.release()  # the connection is lost now
            files = uploaded[0]
            assert uploader.bytes_sent == size + (size - cut_at)  # the rest, not it all
            # the bar goes back to what serve holds, and ends full
            assert (cut_at, size) in reports and reports[-1] == (size, size), reports
            async with trainer_client(lossy_url) as publisher:
                outcome = await publisher.publish_uploaded(files.digest, step=3)
                assert loser.delivered == 1  # the reply of the first ask was lost
                assert (outcome.status, outcome.version_id, outcome.attempt) == (
                    "PUBLISHED",
                    3,
                    1,
                )
                assert outcome.revision == 1
                again = await publisher.publish_uploaded(files.digest, step=3)
                assert again.status == "NO_OP"
        log = await logged(tmp_path / "serve" / "ledger.db")
    assert [e.version_id for e in log if isinstance(e, AttemptStarted)] == [3]
    assert [e.version_id for e in log if isinstance(e, VersionPublished)] == [3]
    recorded = sorted(e.command_id.rsplit(":", 1)[1] for e in log if isinstance(e, CommandRecorded))
    assert recorded == ["allocate", "commit"]


async def test_a_corrupted_byte_is_refused_naming_the_digest(tmp_path: Path) -> None:
    """A byte of the weights flipped on the way: serve refuses the upload
    ``DIGEST_MISMATCH`` (naming the digest sent and the one the bytes have), stores nothing,
    allocates nothing; the trainer hears ``RETRYABLE`` (nothing was left behind)."""
    trainer_home = tmp_path / "trainer"
    trainer_home.mkdir()
    step1 = adapter(trainer_home, 4)
    size = (step1 / "adapter_model.safetensors").stat().st_size
    with engines(tmp_path, 1) as urls, serve_process(tmp_path / "serve", urls) as (url, _):
        flip = Relay(url, "corrupt", requests=(b"PUT /adapters/",), faults=1, at=size - 1)
        async with flip.running() as flip_url, trainer_client(flip_url) as trainer:
            with pytest.raises(PublicationError) as refused:
                await trainer.publish(step1, step=1)
            digest = describe_adapter_dir(step1).digest
            with pytest.raises(PublicationError) as not_stored:  # nothing of it was kept
                await trainer.publish_uploaded(digest, step=1)
            files = await trainer.upload(step1)  # the next try, unharmed
        log = await logged(tmp_path / "serve" / "ledger.db")
    assert (refused.value.code, refused.value.kind) == ("DIGEST_MISMATCH", ErrorKind.RETRYABLE)
    assert files.digest in refused.value.message
    assert (not_stored.value.code, not_stored.value.kind) == (
        "ADAPTER_NOT_UPLOADED",
        ErrorKind.RETRYABLE,
    )
    assert not any(isinstance(e, AttemptStarted) for e in log)


async def test_an_outage_is_retryable(tmp_path: Path) -> None:
    """No service answers at the URL for the whole retry window: ``PublicationError``
    ``LEDGER_CLOSED``, ``RETRYABLE`` (a training loop goes on), and ``loraledger publish``
    says so with exit 10."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, never listening: refused
        step1 = adapter(tmp_path, 1)
        started = time.monotonic()
        async with HttpTrainerClient(url, token=TOKEN, retry_for_s=1.0) as trainer:
            with pytest.raises(PublicationError) as down:
                await trainer.publish(step1, step=1)
        assert time.monotonic() - started < 30
        by_cli = publish_cli(url, step1, 1, "--retry-for", "0.5")
    assert (down.value.code, down.value.kind) == (Code.LEDGER_CLOSED, ErrorKind.RETRYABLE)
    assert by_cli.returncode == 10, by_cli.stderr
    assert "is `loraledger serve` running" in by_cli.stderr


def test_the_publish_command_refuses_a_missing_or_bad_directory(tmp_path: Path) -> None:
    """Before anything is sent: a missing directory and one that is not a LoRA adapter are
    usage errors (exit 2) naming the directory."""
    missing = publish_cli("http://127.0.0.1:9", tmp_path / "nowhere", 1)
    assert missing.returncode == 2 and "does not exist" in missing.stderr, missing.stderr
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{}")
    (bad / "adapter_model.safetensors").write_bytes(b"not safetensors")
    refused = publish_cli("http://127.0.0.1:9", bad, 1)
    assert refused.returncode == 2 and "INVALID_ADAPTER" in refused.stderr, refused.stderr


@asynccontextmanager
async def high_rank_engine(tmp_path: Path, *, max_rank: int = 8192) -> AsyncIterator[str]:
    """The local engine server (what ``loraledger engine`` runs) with a rank limit high
    enough for a large adapter on the tiny model (8192: a 64 MiB one); its URL once it
    listens. Stopped by its PID on exit."""
    server = [sys.executable, "-m", "engines.local.server", "--engine-id", "e0"]
    port_file = tmp_path / "e0.port"
    engine = await anyio.open_process(
        [*server, "--port-file", str(port_file), "--max-lora-rank", str(max_rank)],
        cwd=REPO,
        env=script_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        await wait_for("the engine listening", port_file.exists, timeout=120, every=0.05)
        yield f"http://127.0.0.1:{port_file.read_text().strip()}"
    finally:
        os.kill(engine.pid, signal.SIGTERM)
        with anyio.fail_after(60):
            await engine.wait()


# A trainer process: the client warmed up (imports, a first round trip), then its peak
# resident memory over one publish, from the current resident size (KiB).
_TRAINER = """
import json, sys, anyio
from pathlib import Path
from publisher.remote import HttpTrainerClient
from tests.support.memory import memory_kib as _memory_kib

async def main(url, token, adapter, version):
    async with HttpTrainerClient(url, token=token) as trainer:
        await trainer.status()
        Path("/proc/self/clear_refs").write_text("5")
        before = _memory_kib("self")["VmRSS"]
        outcome = await trainer.publish(adapter, step=int(version))
        growth = _memory_kib("self")["VmHWM"] - before
        print(json.dumps({"status": outcome.status, "growth": growth}))

anyio.run(main, *sys.argv[1:])
"""


def _trainer_growth(url: str, adapter_dir: Path, version: int) -> int:
    """Publish from a trainer process of its own; its memory growth over the publish, KiB."""
    done = subprocess.run(
        [sys.executable, "-c", _TRAINER, url, TOKEN, str(adapter_dir), str(version)],
        cwd=adapter_dir.parent,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(done.stdout)
    assert row["status"] == "PUBLISHED"
    return int(row["growth"])


async def test_a_64_mib_adapter_streams_through_serve_in_bounded_memory(tmp_path: Path) -> None:
    """A 64 MiB adapter published from a trainer process: the peak resident memory of serve
    during the upload and the publication, and of the trainer during its publish, grow by a
    fraction of the adapter (neither holds it whole: the trainer streams the file, serve
    writes it to disk as it arrives and sends the engine buckets read from its store)."""
    trainer_home = tmp_path / "trainer"
    trainer_home.mkdir()
    modules = ("q_proj", "k_proj", "v_proj", "o_proj")
    big = adapter(trainer_home, 64, r=8192, targets=modules)  # 16 tensors of 4 MiB
    size = (big / "adapter_model.safetensors").stat().st_size
    assert size >= 64 * MiB
    async with high_rank_engine(tmp_path) as engine_url:
        with serve_process(tmp_path / "serve", [engine_url]) as (url, served):
            small = adapter(trainer_home, 1)
            await anyio.to_thread.run_sync(_trainer_growth, url, small, 1)  # serve warmed up
            peak = await PeakGrowth.start(served.proc.pid)
            trainer = await anyio.to_thread.run_sync(_trainer_growth, url, big, 2)
            serve = peak.bytes() // 1024
    print(
        f"\n{size / MiB:.0f} MiB adapter: peak resident memory grew by {serve / 1024:.1f} MiB "
        f"in serve, {trainer / 1024:.1f} MiB in the trainer"
    )
    assert serve * 1024 < size // 2, serve
    assert trainer * 1024 < size // 4, trainer
