"""The route x role table of docs/operations.md ("Roles") is the policy the code consults, and
every cell of it holds against a running ``serve``: an allowed cell is never answered 401 or
403, a refused cell is answered 403 ``FORBIDDEN`` (401 for no token) and the log's last seq
does not move.

Before: one bearer token did everything; a rollout's token (the OpenAI api_key) could publish,
suspend and remove engines, forget tombstones and release every session of serve's face."""

from __future__ import annotations

import re
from pathlib import Path

import anyio
import httpx
import msgspec
import pytest
from starlette.routing import Route

from engines.access import ROLES
from evlog.sqlite import SQLiteStore
from publisher.core.ledger import Ledger
from publisher.openai.face import ROUTE_NAMES
from tests.tools.serving import serving
from tools.http_app import build_app
from tools.metrics import LedgerMetrics
from tools.roles import ROUTE_ROLES

DOCS = Path(__file__).parents[2] / "docs" / "operations.md"
TOKENS = {role: f"{role}-t0ken" for role in ROLES}
OTHERS = tuple((role, token) for role, token in TOKENS.items() if role != "operator")
NO_TOKEN = "no token"
_CONVERTER = re.compile(r":\w+}")  # a path parameter's converter: {owner:path}, {version:int}
# a value for each path parameter: an owner, a session, an engine, a digest, a model
PARAMS = {
    "owner": "w",
    "session": "s1",
    "engine": "e0",
    "digest": "sha256-" + "0" * 64,
    "model": "policy",
    "version": "1",
}


def docs_table() -> dict[str, dict[str, str]]:
    """The "Roles" section's table: route -> column (role, or "no token") -> cell."""
    section = DOCS.read_text(encoding="utf-8").split("### Roles: who may call what", 1)[1]
    section = section.split("\n### ", 1)[0].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert header == ["route", *ROLES, NO_TOKEN], header
    table = {}
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        table[cells[0].strip("`")] = dict(zip(header[1:], cells[1:], strict=True))
    return table


def test_the_documented_table_is_the_policy_the_code_consults() -> None:
    expected = {}
    for route, rule in ROUTE_ROLES.items():
        row = {role: "yes" if role in rule.roles else "no" for role in ROLES}
        row[NO_TOKEN] = "yes" if rule.open else "unless `--private-reads`" if rule.read else "no"
        expected[route] = row
    assert docs_table() == expected


@pytest.mark.anyio
async def test_every_route_of_the_apps_is_in_the_policy(tmp_path: Path) -> None:
    """A route the policy does not name would fail at its first request: none is missing."""
    async with SQLiteStore.open(tmp_path / "l.db") as store, Ledger.open(store) as ledger:
        app = build_app(ledger, LedgerMetrics(lambda: ledger.state), token="t")
        served = {
            f"{method} {_CONVERTER.sub('}', route.path)}"
            for route in app.routes
            if isinstance(route, Route)
            for method in route.methods or ()
            if method != "HEAD"
        }
    assert served | set(ROUTE_NAMES) == set(ROUTE_ROLES)


def _request(route: str) -> tuple[str, str]:
    method, template = route.split(" ", 1)
    return method, re.sub(r"\{(\w+)\}", lambda m: PARAMS[m.group(1)], template)


async def _seq(http: httpx.AsyncClient) -> int:
    seq: int = (await http.get("/health")).json()["seq"]
    return seq


def _error(reply: httpx.Response) -> dict[str, object]:
    body: dict[str, object] = msgspec.json.decode(reply.content)
    error = body.get("error", body)
    assert isinstance(error, dict)
    return error


async def _check_cells(url: str, table: dict[str, dict[str, str]], *, private: bool) -> int:
    checked = 0
    async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=30) as http:
        for route, row in table.items():
            method, path = _request(route)
            body = b"{}" if method in ("POST", "PUT") else None
            for column, cell in row.items():
                token = TOKENS.get(column)
                headers = {"authorization": f"Bearer {token}"} if token else {}
                allowed = cell == "yes" or (cell.startswith("unless") and not private)
                seq = await _seq(http)
                # a stream (the live page's feed) is judged by its status line: never read whole
                async with http.stream(method, path, content=body, headers=headers) as reply:
                    stream = "text/event-stream" in reply.headers.get("content-type", "")
                    text = "(a stream)" if stream else (await reply.aread()).decode()
                where = (route, column, reply.status_code, text[:200])
                if allowed:
                    assert reply.status_code not in (401, 403), where
                else:
                    assert reply.status_code == (403 if token else 401), where
                    assert await _seq(http) == seq, where
                if not allowed and token:
                    error = _error(reply)
                    assert error["code"] == "FORBIDDEN", where
                    assert f"this token's role is {column}" in str(error["message"]), where
                    if "details" in error:  # serve's own routes; OpenAI's shape has none
                        details = error["details"]
                        assert details == {
                            "needed": sorted(r for r in ROLES if row[r] == "yes"),
                            "role": column,
                        }, where
                checked += 1
    return checked


@pytest.mark.anyio
@pytest.mark.parametrize("private", [True, False], ids=["private-reads", "open-reads"])
async def test_every_cell_of_the_table_holds_on_a_running_serve(
    tmp_path: Path, private: bool
) -> None:
    table = docs_table()
    async with serving(
        tmp_path / "ledger.db",
        token=TOKENS["operator"],
        tokens=OTHERS,
        private_reads=private,
    ) as url:
        checked = await _check_cells(url, table, private=private)
    assert checked == len(table) * (len(ROLES) + 1)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("path", "token"),
    [("/versions", TOKENS["rollout"]), ("/v1/chat/completions", TOKENS["trainer"])],
)
async def test_a_refusal_is_decided_before_the_body_is_read(
    tmp_path: Path, path: str, token: str
) -> None:
    """The request's head announces a body that never comes: the 403 is answered anyway (an
    admitted role would wait for the body), so a refused caller cannot make the server read,
    buffer or parse anything."""
    async with serving(tmp_path / "ledger.db", token=TOKENS["operator"], tokens=OTHERS) as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
        )
        async with await anyio.connect_tcp(host, int(port)) as stream:
            await stream.send(head.encode())
            with anyio.fail_after(30):
                answer = await stream.receive()
        assert answer.startswith(b"HTTP/1.1 403 "), answer[:200]
        assert b"FORBIDDEN" in answer, answer
