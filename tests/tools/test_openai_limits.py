"""The OpenAI routes' limits as a multimodal rollout meets them, on every face: ``loraledger
serve``, a ``loraledger gateway`` process (its app, in this process) and the bare app a Ray
gateway actor serves, with the official ``openai`` client.

* a body over the cap is a readable ``413 BODY_TOO_LARGE`` in OpenAI's error shape, which the
  client does not resend (the server sees the request once), not a reset connection retried
  twice; a huge declared body is refused without being read;
* a screenshot-sized body (5 MB) goes through under the default cap;
* ``--max-body-mb`` and ``--upstream-timeout-s`` reach the face, from the command line and the
  Ray ``GatewayConfig``.

The engine is the benchmark's stub of a vLLM server (:mod:`tools.bench.stub_engine`), a test
double for what cannot run here: a multimodal engine, which like vLLM takes any body size and
image parts. It runs in this process on a free loopback port; so do serve and the gateway."""

from __future__ import annotations

import base64
import contextlib
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest

import tools.gateway
import tools.serve
from tests.publisher.openai_kit import serve_app
from tests.tools.conftest import Cli
from tests.tools.serving import serving
from tests.tools.test_serve import _adapter_dir
from tools.bench.stub_engine import StubEngine
from tools.service_options import parse_engine

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
]
TOKEN = "openai-limits-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MIB = 1024 * 1024
CHAT = "/v1/chat/completions"
# One screenshot as an OpenAI client sends it: a data URL, ~1.7 MB of base64.
SCREEN = "data:image/png;base64," + base64.b64encode(os.urandom(1_300_000)).decode()


def screenshots(count: int) -> list[Any]:
    """A computer-use turn: a question and ``count`` screenshots (the same one, to save time)."""
    parts: list[Any] = [{"type": "text", "text": "what is on screen?"}]
    parts += [{"type": "image_url", "image_url": {"url": SCREEN}}] * count
    return [{"role": "user", "content": parts}]


class Seen:
    """The requests a server saw, by path: its app wrapped where ``_server`` builds it."""

    def __init__(self) -> None:
        self.paths: Counter[str] = Counter()

    def around(self, build: Callable[..., Any]) -> Callable[..., Any]:
        def counting_server(app: Any, *args: Any, **kwargs: Any) -> Any:
            async def counting(scope: Any, receive: Any, send: Any) -> None:
                if scope["type"] == "http":
                    self.paths[scope["path"]] += 1
                await app(scope, receive, send)

            return build(counting, *args, **kwargs)

        return counting_server


@contextlib.asynccontextmanager
async def stub_engine() -> AsyncIterator[tuple[StubEngine, str]]:
    stub = StubEngine()
    async with serve_app(stub.app()) as url:
        yield stub, url


@contextlib.asynccontextmanager
async def face(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **options: Any
) -> AsyncIterator[tuple[str, Seen, StubEngine]]:
    """serve (``kind`` "serve") or a gateway process in front of it ("gateway"), over one stub
    engine holding a published version; yields the face's URL and what that face's server saw.
    ``options``: the face's (ServeOptions or GatewayOptions)."""
    from tools.gateway import GatewayOptions, run_gateway

    seen = Seen()
    served = options if kind == "serve" else {}
    if kind == "serve":
        monkeypatch.setattr(tools.serve, "_server", seen.around(tools.serve._server))
    else:
        monkeypatch.setattr(tools.gateway, "_server", seen.around(tools.serve._server))
    async with (
        stub_engine() as (stub, engine_url),
        serving(
            tmp_path / "ledger.db",
            token=TOKEN,
            engines=(parse_engine(f"e0=vllm:{engine_url}"),),
            **served,
        ) as ledger,
        httpx.AsyncClient(base_url=ledger, trust_env=False, timeout=60) as http,
    ):
        published = await http.post(
            "/versions",
            json={"version_id": 1, "adapter_dir": str(_adapter_dir(tmp_path, 1))},
            headers=AUTH,
        )
        assert published.status_code == 200, published.text
        if kind == "serve":
            yield ledger, seen, stub
            return
        opts = GatewayOptions(
            ledger=ledger,
            token=TOKEN,
            port=0,
            owner="gw-limits",
            refresh_s=0.2,
            provenance=str(tmp_path / "gw.provenance.jsonl"),
            **options,
        )
        urls: list[str] = []
        listening, stop = anyio.Event(), anyio.Event()

        def ready(url: str, owner: str) -> None:
            urls.append(url)
            listening.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: run_gateway(opts, on_ready=ready, handle_signals=False, stop=stop)
            )
            with anyio.fail_after(60):
                await listening.wait()
            try:
                yield urls[0], seen, stub
            finally:
                stop.set()


async def raw_post(url: str, head: str) -> tuple[bytes, float]:
    """Send a request head alone on a raw connection; the reply and how long after the head
    the server closed the connection."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    async with await anyio.connect_tcp(host, int(port)) as stream:
        await stream.send(head.encode())
        sent = time.monotonic()
        reply = b""
        with anyio.fail_after(30):
            while True:
                try:
                    reply += await stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    break
    return reply, time.monotonic() - sent


async def _refused_readably(client: openai.AsyncOpenAI, seen: Seen, count: int) -> None:
    """A chat of ``count`` screenshots is answered 413 BODY_TOO_LARGE in OpenAI's error shape,
    once: the client does not resend it, and the server saw one request."""
    before = seen.paths[CHAT]
    with pytest.raises(openai.APIStatusError) as refused:
        await client.chat.completions.create(
            model="policy", messages=screenshots(count), max_tokens=2
        )
    error = refused.value
    assert error.status_code == 413, error
    assert error.code == "BODY_TOO_LARGE" and error.type == "invalid_request_error", error.body
    assert isinstance(error.body, dict) and "bytes" in error.body["message"], error.body
    assert error.response.headers["x-should-retry"] == "false"
    assert seen.paths[CHAT] - before == 1, seen.paths  # nothing was uploaded twice


@pytest.mark.parametrize("kind", ["serve", "gateway"])
async def test_a_multimodal_body_over_the_cap_was_a_reset_retried_twice(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the cap was 4 MiB, and the guard answered 413 and closed while the client was
    still uploading, so the connection was reset: three screenshots (5 MB) became
    ``APIConnectionError`` after the SDK had sent them three times. Now the default cap is
    64 MiB, a 5 MB turn is served, and a body over the cap is a 413 the client reads, in
    OpenAI's error shape, sent once; a 200 MB declared body is refused at once, unread."""
    async with (
        face(kind, tmp_path, monkeypatch) as (url, seen, _),
        openai.AsyncOpenAI(base_url=url + "/v1", api_key=TOKEN, timeout=60) as client,
    ):
        served = await client.chat.completions.with_raw_response.create(
            model="policy",
            messages=screenshots(3),
            max_tokens=2,
            extra_headers={"x-session-id": "episode-1"},
        )
        assert served.http_request.headers["content-length"] > str(5 * 10**6)
        assert served.parse().choices[0].message.content == "okok"
        assert served.headers["x-loraledger-version"] == "1"

        await _refused_readably(client, seen, 40)  # 69 MB: over 64 MiB

        head = (
            f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {200 * 10**6}\r\n\r\n"
        )
        reply, closed_after = await raw_post(url, head)
        assert reply.startswith(b"HTTP/1.1 413"), reply[:300]
        assert b'{"error":{' in reply and b"BODY_TOO_LARGE" in reply, reply[:600]
        assert closed_after < 5, closed_after  # not read: closed without waiting for it

        again = await client.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": "still there?"}],
            max_tokens=1,
            extra_headers={"x-session-id": "episode-1"},
        )
        assert again.choices[0].message.content == "ok"


@pytest.mark.parametrize("kind", ["serve", "gateway"])
async def test_the_cap_and_the_upstream_timeout_were_fixed(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: neither the 4 MiB cap nor the 600 s upstream timeout could be changed. Now
    ``max_body_mb`` and ``upstream_timeout_s`` (``--max-body-mb``, ``--upstream-timeout-s``)
    reach the face: 4 MiB refuses the 5 MB turn (readably), and 0.3 s ends a stream whose
    engine falls silent for a second (502 AMBIGUOUS_DISPATCH inside the stream)."""
    async with (
        face(kind, tmp_path, monkeypatch, max_body_mb=4, upstream_timeout_s=0.3) as (
            url,
            seen,
            stub,
        ),
        openai.AsyncOpenAI(base_url=url + "/v1", api_key=TOKEN, timeout=60) as client,
    ):
        await _refused_readably(client, seen, 3)
        stub.chunk_interval_s = 1.0  # a decode step of a second between tokens
        stream = await client.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": "think slowly"}],
            max_tokens=3,
            stream=True,
        )
        chunks: list[Any] = []

        async def read_all() -> None:
            async for chunk in stream:
                chunks.append(chunk)

        with pytest.raises(openai.APIError) as silent:
            await read_all()
        assert len(chunks) == 1  # the first token came at once, the second never within 0.3 s
        assert isinstance(silent.value.body, dict), silent.value
        assert silent.value.body["code"] == "AMBIGUOUS_DISPATCH", silent.value.body
        assert "TIMEOUT" in silent.value.body["message"], silent.value.body


async def test_the_bare_app_answered_400_after_reading_any_body(tmp_path: Path) -> None:
    """Before: ``openai_app`` (what a Ray gateway actor serves) had no guard: it read a body of
    any size whole, then answered 400 INVALID_INPUT. Now it is behind the same guard as the
    other faces: 413 BODY_TOO_LARGE in OpenAI's shape, at the face's ``max_body_bytes``."""
    from publisher.openai import OpenAIGateway, OpenAIOptions, openai_app
    from tests.publisher.openai_kit import TOKEN as RIG_TOKEN
    from tests.publisher.openai_kit import rig

    async with rig(tmp_path, engines=1) as r:
        small = OpenAIGateway(
            r.worker,
            r.face.engines,
            OpenAIOptions(token=RIG_TOKEN, max_body_bytes=4 * MIB),
        )
        seen = Seen()
        app = seen.around(lambda app: app)(openai_app(small))
        try:
            async with (
                serve_app(app) as url,
                openai.AsyncOpenAI(base_url=url + "/v1", api_key=RIG_TOKEN) as client,
            ):
                await _refused_readably(client, seen, 3)
                head = (
                    f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {200 * 10**6}\r\n\r\n"
                )
                reply, closed_after = await raw_post(url, head)
                assert reply.startswith(b"HTTP/1.1 413") and b'{"error":{' in reply, reply[:300]
                assert closed_after < 5, closed_after
        finally:
            await small.aclose()


def test_the_limits_reach_the_face_from_the_command_line_and_the_ray_config(
    cli: Cli, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--max-body-mb`` and ``--upstream-timeout-s`` on serve and gateway end up in the face's
    ``OpenAIOptions`` (so do ``GatewayConfig``'s fields on Ray); the defaults are the face's
    own everywhere; nonsense is refused before anything starts."""
    from publisher.openai import MAX_BODY_BYTES, UPSTREAM_TIMEOUT_S, OpenAIOptions
    from publisher.ray.gateway import GatewayConfig
    from tools.exitcodes import Exit
    from tools.gateway import GatewayOptions
    from tools.serve import ServeOptions
    from tools.service_options import openai_options

    started: list[Any] = []

    async def capture(opts: Any, **kwargs: Any) -> None:
        started.append(opts)

    monkeypatch.setattr(tools.serve, "serve", capture)
    monkeypatch.setattr(tools.gateway, "run_gateway", capture)
    monkeypatch.setenv("LORALEDGER_TOKEN", TOKEN)
    limits = ["--max-body-mb", "96", "--upstream-timeout-s", "7200"]
    assert cli("serve", "--db", tmp_path / "x.db", *limits).returncode == 0
    assert cli("gateway", "--ledger", "http://127.0.0.1:9", *limits).returncode == 0
    assert cli("serve", "--db", tmp_path / "x.db").returncode == 0
    for opts in started[:2]:
        face = OpenAIOptions(**openai_options(opts))
        assert (face.max_body_bytes, face.upstream_timeout_s) == (96 * MIB, 7200.0), opts
    default = OpenAIOptions(**openai_options(started[2]))
    assert (default.max_body_bytes, default.upstream_timeout_s) == (
        MAX_BODY_BYTES,
        UPSTREAM_TIMEOUT_S,
    )
    for options in (ServeOptions(db="x"), GatewayOptions(ledger="x")):
        assert OpenAIOptions(**openai_options(options)) == OpenAIOptions()

    for bad in (["--max-body-mb", "0"], ["--upstream-timeout-s", "inf"]):
        result = cli("serve", "--db", tmp_path / "x.db", *bad)
        assert result.returncode == Exit.USAGE, (bad, result.stderr)
        result = cli("gateway", "--ledger", "http://127.0.0.1:9", *bad)
        assert result.returncode == Exit.USAGE, (bad, result.stderr)
    assert len(started) == 3

    config = GatewayConfig(token=TOKEN, max_body_bytes=8 * MIB, upstream_timeout_s=5400.0)
    config.check()
    face = config.openai_options()
    assert (face.max_body_bytes, face.upstream_timeout_s, face.token) == (8 * MIB, 5400.0, TOKEN)
    assert GatewayConfig(token=TOKEN).openai_options() == OpenAIOptions(token=TOKEN)
    from evlog.errors import InvalidInput

    for wrong in ({"max_body_bytes": 0}, {"upstream_timeout_s": 0.0}):
        with pytest.raises(InvalidInput):
            GatewayConfig(token=TOKEN, **wrong).check()
