"""Bad input at every HTTP door, against the real servers on loopback: the local engine's
server (every route) and ``loraledger serve`` (every route), with generated bodies, headers and
slow or broken clients.

Part of the bad-input suite (``tests/fault/test_bad_input.py``): its cases join that suite's
count ("bad inputs tried" in the fault-matrix summary). What must hold for every case:

* never a 500: every answer is a 2xx, a 4xx (JSON with a code on our routes; the router's plain
  404/405 for unknown paths and methods outside ``/v1/``, where every 4xx but the body cap's is
  OpenAI's ``{"error": {...}}``) or a 503 from the connection cap;
* a caller without the token changes nothing (the engine's adapters, the ledger's log);
* on ``serve``, run once with each role's token: a role the route does not admit is answered
  403 and changes nothing (``tools/roles.py``);
* after slow, truncated and abandoned requests the server still answers ``/health``.

Bounded: ``EXAMPLES`` cases per property (``--slow``: ``SLOW_EXAMPLES``), each a few requests.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.access import OPERATOR, ROLES
from engines.local.server import CONTROL_PATHS, running_server
from tests.fault.conftest import record_figure
from tests.fault.test_bad_input import TRIED, _count, _json, _numbers, _settings
from tests.tools.serving import serving
from tools.roles import ROUTE_ROLES

pytestmark = [pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")]

TOKEN = "fuzz-token"
ENGINE_ROUTES = [
    ("POST", "/generate"),
    ("POST", "/load_lora_adapter"),
    ("POST", "/unload_lora_adapter"),
    ("GET", "/v1/models"),
    ("GET", "/server_info"),
    ("GET", "/get_server_info"),
    ("GET", "/model_info"),
    ("GET", "/health"),
    ("GET", "/health_generate"),
    ("POST", "/flush_cache"),
    ("POST", "/pause_generation"),
    ("POST", "/continue_generation"),
    ("POST", "/abort_request"),
    ("POST", "/loraledger/prepare"),
    ("POST", "/loraledger/bucket"),
    ("POST", "/loraledger/load"),
    ("POST", "/loraledger/unload"),
    ("GET", "/loraledger/inventory"),
]
SERVE_ROUTES = [
    ("GET", "/health"),
    ("GET", "/status"),
    ("GET", "/metrics"),
    ("POST", "/owners"),
    ("POST", "/owners/{p}/renew"),
    ("POST", "/sessions/{p}/bind"),
    ("POST", "/sessions/{p}/release"),
    ("POST", "/versions"),
    ("POST", "/engines/{p}/trouble"),
    ("POST", "/engines/{p}/suspend"),
    ("POST", "/sessions/forget"),
    ("POST", "/provenance"),
    # the OpenAI routes serve mounts, and paths and methods beside them (its fallback)
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{p}"),
    ("POST", "/v1/sessions/{p}/release"),
    ("GET", "/v1/chat/completions"),
    ("POST", "/v1/{p}"),
]
_NON_NUMBERS = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", str(2**80), "-0"])


def _with_raw(value: str) -> bytes:
    return json.dumps({"x": "VALUE"}).replace('"VALUE"', value).encode()


_bodies = (
    st.builds(lambda j: json.dumps(j).encode(), _json)
    | st.binary(max_size=80)
    | st.builds(_with_raw, _NON_NUMBERS)
    | st.builds(
        lambda n, t: json.dumps(
            {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1, "n": n, "top_p": t}}
        ).encode(),
        _numbers.filter(lambda v: not isinstance(v, float)),
        st.floats(allow_nan=False, allow_infinity=False),
    )
    | st.builds(
        lambda name, attempt: json.dumps({"lora_name": name, "attempt": attempt}).encode(),
        st.text(max_size=20),
        _json,
    )
)


def _auth_with(token: str) -> st.SearchStrategy[str | None]:
    return st.sampled_from(
        [None, f"Bearer {token}", "Bearer wrong", token, "Basic x", "Bearer", "bearer " + token]
    )


_auth = _auth_with(TOKEN)
# Each role's run of the serve fuzz: the operator's as many examples as before, the others a few.
ROLE_EXAMPLES = 25
_content_type = st.sampled_from(
    [None, "application/json", "application/msgpack", "text/plain", "x" * 200]
)


def _headers(auth: str | None, content_type: str | None) -> dict[str, str]:
    out = {}
    if auth is not None:
        out["authorization"] = auth
    if content_type is not None:
        out["content-type"] = content_type
    return out


def _authorized(auth: str | None, token: str = TOKEN) -> bool:
    scheme, _, given = (auth or "").partition(" ")
    return scheme.lower() == "bearer" and given == token


def _roles_of(method: str, path: str) -> frozenset[str] | None:
    """The roles the policy admits on a fuzzed route (``{p}`` for its parameter), None for a
    path or method outside the policy (the router's or the OpenAI fallback's answer)."""
    for route, rule in ROUTE_ROLES.items():
        if re.sub(r"\{\w+\}", "{p}", route) == f"{method} {path}":
            return None if rule.open or rule.read else rule.roles
    return None


def _check_answer(response: httpx.Response, *, openai_routes: bool = False) -> None:
    """``openai_routes``: the server mounts the OpenAI face under ``/v1/`` (serve; the
    engine's own ``/v1/models`` is not it)."""
    assert response.status_code < 500 or response.status_code == 503, (
        response.status_code,
        response.text[:300],
    )
    if response.status_code >= 400 and response.status_code not in (404, 405, 503):
        assert response.headers.get("content-type", "").startswith("application/json"), (
            response.status_code,
            response.text[:300],
        )
    openai_face = openai_routes and response.request.url.path.startswith("/v1/")
    if openai_face and 400 <= response.status_code < 500 and response.status_code != 413:
        # OpenAI's shape, which the SDKs read (the body cap is the shared guard's, in serve's)
        error = response.json()["error"]
        assert error["code"] and error["message"], response.text[:300]


@pytest.fixture(scope="module", autouse=True)
def _report() -> Iterator[None]:
    yield  # after test_bad_input's own report: the total now includes the HTTP doors
    detail = ", ".join(f"{door} {n}" for door, n in TRIED.items())
    record_figure("bad inputs tried", f"{sum(TRIED.values())} ({detail})")


async def _slow_clients(url: str, prefixes: list[tuple[bytes, int]]) -> None:
    """Send a prefix of a request a few bytes at a time, then abandon the connection."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    for data, step in prefixes:
        async with await anyio.connect_tcp(host, int(port)) as stream:
            try:
                for i in range(0, len(data), step):
                    await stream.send(data[i : i + step])
            except anyio.BrokenResourceError:
                pass  # the server closed it (a malformed request): that is an answer too


_requests = st.lists(
    st.tuples(st.integers(0, len(ENGINE_ROUTES) - 1), _bodies, _auth, _content_type, st.booleans()),
    min_size=1,
    max_size=4,
)
_prefixes = st.lists(
    st.tuples(
        st.sampled_from(
            [
                b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{",
                b"GET /health HTTP/1.1\r\nHost: x\r\n",
                b"POST /owners HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab",
                b"GARBAGE\r\n\r\n",
                b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n",
            ]
        ).flatmap(lambda d: st.integers(0, len(d)).map(lambda k: d[:k])),
        st.integers(1, 4096),
    ),
    min_size=1,
    max_size=3,
)


@pytest.mark.anyio
async def test_every_engine_route_answers_bad_requests_without_a_500(
    tmp_path: Path, slow: bool
) -> None:
    """The local engine's server, token configured: random bodies, headers, methods on every
    route; a caller without the token never changes what the engine holds; slow and abandoned
    clients leave it answering."""
    from engines.artifacts import ArtifactStore
    from engines.local.client import LocalHTTPEngine
    from tests.engines.contract import candidate_for, publish

    store = ArtifactStore(tmp_path / "artifacts")
    async with running_server("fz-0", artifact_root=store.root, token=TOKEN) as (engine, url):
        adapter = LocalHTTPEngine(url, "fz-0", api_key=TOKEN)
        try:
            await publish(adapter, candidate_for(store, 1))
        finally:
            await adapter.aclose()
        cases: list[list[Any]] = []

        @_settings(slow)
        @given(_requests, _prefixes)
        def collect(requests: list[Any], prefixes: list[Any]) -> None:
            cases.append([requests, prefixes])

        collect()
        async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=60) as http:
            for requests, prefixes in cases:
                for index, body, auth, content_type, swap_method in requests:
                    _count("HTTP requests (engine)")
                    method, path = ENGINE_ROUTES[index]
                    if swap_method:
                        method = "GET" if method == "POST" else "POST"
                    held = engine.loaded_adapters()
                    response = await http.request(
                        method,
                        path,
                        content=body if method == "POST" else None,
                        headers=_headers(auth, content_type),
                    )
                    _check_answer(response)
                    if path in CONTROL_PATHS and not _authorized(auth):
                        assert response.status_code in (401, 405), (path, response.status_code)
                        assert engine.loaded_adapters() == held
                    engine.continue_generation()  # a fuzzed pause must not stall the next case
                _count("HTTP slow clients (engine)")
                await _slow_clients(url, prefixes)
            assert (await http.get("/health")).status_code == 200


@pytest.mark.anyio
@pytest.mark.parametrize("role", ROLES)
async def test_every_serve_route_answers_bad_requests_without_a_500(
    tmp_path: Path, slow: bool, role: str
) -> None:
    """``loraledger serve`` on loopback: random bodies, headers, methods and path parameters on
    every route, with ``role``'s token; a caller without the token never adds to the log, nor
    does one whose role the route does not admit (403); slow and abandoned clients leave it
    answering."""
    token = TOKEN if role == OPERATOR else f"fuzz-{role}-token"
    serve_requests = st.lists(
        st.tuples(
            st.integers(0, len(SERVE_ROUTES) - 1),
            _bodies,
            _auth_with(token),
            _content_type,
            st.sampled_from(["w", "s1", "", "%20", "x" * 300, "..", "a%2Fb", "%00"]),
        ),
        min_size=1,
        max_size=4,
    )
    cases: list[list[Any]] = []

    few = role != OPERATOR and not slow

    @settings(_settings(slow), max_examples=ROLE_EXAMPLES) if few else _settings(slow)
    @given(serve_requests, _prefixes)
    def collect(requests: list[Any], prefixes: list[Any]) -> None:
        cases.append([requests, prefixes])

    collect()
    tokens = () if role == OPERATOR else ((role, token),)
    async with (
        serving(tmp_path / "fuzz.db", token=TOKEN, tokens=tokens, header_timeout_s=2) as url,
        httpx.AsyncClient(base_url=url, trust_env=False, timeout=30) as http,
    ):
        assert (
            await http.post(
                "/owners",
                json={"owner": "w", "secret": "s" * 64},
                headers=_headers(f"Bearer {TOKEN}", None),
            )
        ).status_code == 200
        for requests, prefixes in cases:
            for index, body, auth, content_type, param in requests:
                _count("HTTP requests (serve)")
                method, path = SERVE_ROUTES[index]
                seq = (await http.get("/health")).json()["seq"]
                response = await http.request(
                    method,
                    path.replace("{p}", param),
                    content=body if method == "POST" else None,
                    headers=_headers(auth, content_type),
                )
                _check_answer(response, openai_routes=True)
                if method == "POST" and not _authorized(auth, token):
                    assert response.status_code in (401, 404), response.text
                    assert (await http.get("/health")).json()["seq"] == seq
                roles = _roles_of(method, path)
                if _authorized(auth, token) and roles is not None and role not in roles:
                    assert response.status_code in (403, 404), (path, response.text)
                    assert (await http.get("/health")).json()["seq"] == seq
            _count("HTTP slow clients (serve)")
            await _slow_clients(url, prefixes)
        assert (await http.get("/health")).status_code == 200
