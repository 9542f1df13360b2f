"""``loraledger serve`` bounds what a caller can make it hold: bodies, numbers, renewal entries,
connections and slow clients; the token comes from the environment or a file, and can guard the
read routes too.

Each test is named after the defect it pins. In process, no engines: every server listens on
127.0.0.1 on a port the OS picks, and is stopped by the test (``stop``)."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from tests.tools.conftest import Cli
from tests.tools.serving import serving
from tools.exitcodes import Exit

TOKEN = "t0ken-for-limits"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# one owner life: its incarnation and the secret every owner-bound call carries
LIFE = {"incarnation": "life-1", "secret": "s" * 64}


def running(tmp_path: Path, **options: Any) -> AbstractAsyncContextManager[str]:
    return serving(tmp_path / "limits.db", token=TOKEN, **options)


async def raw(url: str, data: bytes, *, read: bool = True) -> bytes:
    """Send ``data`` on a raw loopback connection and read until the server closes it."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    async with await anyio.connect_tcp(host, int(port)) as stream:
        await stream.send(data)
        reply = b""
        with anyio.fail_after(30):
            while read:
                try:
                    reply += await stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    break
    return reply


@pytest.mark.anyio
async def test_serve_read_a_body_of_any_size(tmp_path: Path) -> None:
    """Before: a body was buffered whatever its size. Now a declared length over 1 MiB is 413
    before one byte of it is read, on every route."""
    async with running(tmp_path) as url:
        for path in ("/owners", "/owners/w/renew", "/sessions/s/bind", "/versions"):
            head = (
                f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {300 * 1024 * 1024}\r\n\r\n"
            )
            reply = await raw(url, head.encode())
            assert reply.startswith(b"HTTP/1.1 413"), (path, reply[:200])
            assert b"BODY_TOO_LARGE" in reply


RENEW = '{"inflight": [{"engine": "e", "version_id": 1, "count": COUNT}]}'
NON_NUMBERS = ["NaN", "Infinity", "-Infinity", "1e400", str(2**80)]


@pytest.mark.anyio
async def test_nan_infinity_and_huge_numbers_reached_the_ledger(tmp_path: Path) -> None:
    """Before: Python-style JSON let NaN, Infinity, 1e400 and 2^80 through to the ledger (an
    infinite TTL, an id SQLite cannot store). Now each is 400 INVALID_INPUT, on every route."""
    async with (
        running(tmp_path) as url,
        httpx.AsyncClient(base_url=url, trust_env=False, timeout=30) as http,
    ):
        assert (
            await http.post("/owners", json={"owner": "w", **LIFE}, headers=AUTH)
        ).status_code == 200
        for v in NON_NUMBERS:
            bodies = {
                "/owners": f'{{"owner": "w2", "ttl_s": {v}}}',
                "/owners/w/renew": RENEW.replace("COUNT", v),
                "/versions": f'{{"version_id": {v}, "adapter_dir": "/nonexistent"}}',
                "/sessions/s/bind": f'{{"owner": "w", "x": {v}}}',  # a number where none belongs
            }
            for path, body in bodies.items():
                r = await http.post(path, content=body.encode(), headers=AUTH)
                assert r.status_code == 400, (path, body, r.status_code, r.text)
                assert r.json()["code"] == "INVALID_INPUT"
        # nothing else happened: w and the OpenAI routes' own owner
        assert (await http.get("/status")).json()["owners"] == 2


@pytest.mark.anyio
async def test_a_renewal_had_no_cap_on_entries_or_counts(tmp_path: Path) -> None:
    """Before: one renewal could carry any number of entries and counts. Now more than 1024
    entries, or a count over 1,000,000, is 400 and nothing is renewed."""
    from publisher.core.ledger_api import MAX_INFLIGHT_COUNT, MAX_INFLIGHT_ENTRIES

    async with (
        running(tmp_path) as url,
        httpx.AsyncClient(base_url=url, trust_env=False, timeout=30) as http,
    ):
        assert (
            await http.post("/owners", json={"owner": "w", **LIFE}, headers=AUTH)
        ).status_code == 200
        many = [{"engine": "e", "version_id": i + 1, "count": 1} for i in range(1025)]
        assert len(many) > MAX_INFLIGHT_ENTRIES
        big = [{"engine": "e", "version_id": 1, "count": MAX_INFLIGHT_COUNT + 1}]
        for inflight in (many, big):
            r = await http.post(
                "/owners/w/renew", json={"inflight": inflight, **LIFE}, headers=AUTH
            )
            assert r.status_code == 400 and r.json()["code"] == "INVALID_INPUT", r.text
        ok = [{"engine": "e", "version_id": 1, "count": MAX_INFLIGHT_COUNT}]
        r = await http.post("/owners/w/renew", json={"inflight": ok, **LIFE}, headers=AUTH)
        assert r.status_code == 200, r.text


@pytest.mark.anyio
async def test_idle_connections_were_held_forever(tmp_path: Path) -> None:
    """Before: a connection that never sent a request was never closed, and uvicorn's own
    concurrency limit answers only once a request arrives, so idle connections piled up until
    EMFILE (20,000 of them made /health time out). Now a connection over the cap is answered
    503 and closed at once, and one that sends no complete headers is closed after the header
    timeout; /health answers again."""
    async with (
        running(tmp_path, max_connections=4, header_timeout_s=0.5) as url,
        httpx.AsyncClient(base_url=url, trust_env=False, timeout=30) as http,
    ):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        idle = [await anyio.connect_tcp(host, int(port)) for _ in range(4)]
        try:
            await idle[0].send(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never finished
            await anyio.sleep(0.1)  # let the server accept them (no event to await)
            over = await raw(url, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert over.startswith(b"HTTP/1.1 503"), over[:100]
            closed = 0
            with anyio.fail_after(30):
                for stream in idle:
                    try:
                        assert await stream.receive() == b""
                    except (anyio.EndOfStream, anyio.BrokenResourceError):
                        closed += 1
            assert closed == 4
        finally:
            for stream in idle:
                await stream.aclose()
        assert (await http.get("/health")).status_code == 200


@pytest.mark.anyio
async def test_status_and_metrics_were_open_to_anyone(tmp_path: Path) -> None:
    """Before: /status and /metrics (engine URLs, versions, owners) answered any caller. With
    ``private_reads`` they need the token; /health stays open for probes."""
    async with (
        running(tmp_path, private_reads=True) as url,
        httpx.AsyncClient(base_url=url, trust_env=False, timeout=30) as http,
    ):
        for path in ("/status", "/metrics"):
            r = await http.get(path)
            assert r.status_code == 401 and r.json()["code"] == "UNAUTHORIZED", path
            assert (await http.get(path, headers=AUTH)).status_code == 200
        assert (await http.get("/health")).status_code == 200


def _unopenable(tmp_path: Path) -> Path:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    return blocker / "never.db"


def test_the_token_could_only_be_given_on_argv(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: beyond loopback the token had to be ``--token`` (readable by every user in
    ``ps``) or the environment. Now ``--token-file`` works, ``--token`` warns, and both at
    once is a usage error."""
    monkeypatch.delenv("LORALEDGER_TOKEN", raising=False)
    db = _unopenable(tmp_path)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    by_file = cli("serve", "--db", db, "--host", "0.0.0.0", "--token-file", token_file)
    assert by_file.returncode not in (Exit.UNSAFE, Exit.USAGE), by_file.stderr
    by_argv = cli("serve", "--db", db, "--host", "0.0.0.0", "--token", TOKEN)
    assert by_argv.returncode != Exit.UNSAFE and "visible to every user" in by_argv.stderr
    both = cli("serve", "--db", db, "--token", TOKEN, "--token-file", token_file)
    assert both.returncode == Exit.USAGE
    token_file.write_text("\n")
    empty = cli("serve", "--db", db, "--token-file", token_file)
    assert empty.returncode == Exit.USAGE and "empty" in empty.stderr
