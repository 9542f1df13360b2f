"""The operator's live page (``GET /ui``), in a real headless Chromium.

A real ``serve`` (in this process, on loopback) over two ``loraledger engine`` processes; the
browser opens ``/ui`` once, and the page must show, without a reload, each change within a
second of it: a publication (from ``POST /versions``' answer), a session pinned to it (from the
turn's answer), an engine killed by PID (from the moment serve's ``/status`` shows it out of
routing). The session id is markup (client text): the page shows it as text, and no element
or script of it runs. The version's and the engine's links open their timelines (the replay's
own views) and the last incidents name the outage. The figures are printed.

``LORALEDGER_UI_SCREENSHOT=docs/ui.png`` also saves the page as the README shows it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import httpx
import msgspec
import openai
import pytest

from projections.registry import RegistryState
from tests.publisher.rollout_kit import ENGINE_WARNINGS
from tests.support.browser import Page, browser, chromium_binary
from tests.support.waiting import wait_for
from tests.tools.serving import serving
from tests.tools.test_engine_death import engine_process
from tests.tools.test_gateway_process import behind_a_gateway
from tests.tools.test_serve import _adapter_dir
from tools.service_options import parse_engine
from tools.ui import UiPages, UiSnapshot, snapshot

pytestmark = [pytest.mark.anyio, *ENGINE_WARNINGS]
TOKEN = "ui-token"
# client text that is markup: shown as text, never parsed (a session id may be any printable)
SESSION = '<img src=x onerror="window.pwned=1">s1'
WITHIN_S = 1.0


async def _shown(page: Page, what: str, js: str, since: float) -> float:
    """Seconds from ``since`` (monotonic) until the page's ``js`` is true; fails past 10 s."""
    await wait_for(f"the page shows {what}", lambda: _true(page, js), timeout=10, every=0.02)
    took = time.monotonic() - since
    print(f"{what}: on the page {took:.3f} s after the ledger")
    return took


async def _true(page: Page, js: str) -> bool:
    return bool(await page.evaluate(js))


def _cell(version: int, column: int) -> str:
    return f"document.querySelector('tr[data-version=\"{version}\"]')?.cells[{column}]?.textContent"


async def _first(condition: Callable[[], Awaitable[bool]], what: str) -> float:
    await wait_for(what, condition, timeout=30, every=0.01)
    return time.monotonic()


async def test_the_live_page_shows_a_publication_a_pin_and_a_dead_engine_within_a_second(
    tmp_path: Path,
) -> None:
    chromium_binary()  # skip (or fail in CI) before starting anything
    db = tmp_path / "ledger.db"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with AsyncExitStack() as stack:
        engines = {e: await stack.enter_async_context(engine_process(e)) for e in ("e0", "e1")}
        specs = tuple(parse_engine(f"{e}=local:{url}") for e, (_, url) in engines.items())
        url = await stack.enter_async_context(serving(db, token=TOKEN, engines=specs))
        http = await stack.enter_async_context(
            httpx.AsyncClient(base_url=url, trust_env=False, timeout=60, headers=auth)
        )
        client = await stack.enter_async_context(
            openai.AsyncOpenAI(base_url=url + "/v1", api_key=TOKEN, max_retries=0)
        )
        page = await stack.enter_async_context(browser(tmp_path / "profile"))
        await page.navigate(url + "/ui")
        await wait_for(
            "the page live",
            lambda: _true(page, "document.getElementById('live')?.textContent === 'live'"),
            timeout=30,
            every=0.02,
        )
        figures = {}

        reply = await http.post(
            "/versions", json={"version_id": 1, "adapter_dir": str(_adapter_dir(tmp_path, 1))}
        )
        answered = time.monotonic()
        assert reply.status_code == 200, reply.text
        figures["publication"] = await _shown(
            page, "v1 published", f"{_cell(1, 1)} === 'PUBLISHED'", answered
        )
        # its age, from the log's times, on the service's clock
        assert (await page.evaluate(_cell(1, 5))).endswith(" s")

        for session in ("episode-0041", SESSION):
            raw = await client.chat.completions.with_raw_response.create(
                model="policy",
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=2,
                extra_headers={"x-session-id": session},
            )
        answered = time.monotonic()
        victim = raw.headers["x-loraledger-engine"]
        figures["pin"] = await _shown(
            page,
            "the session pinned to v1",
            f"({_cell(1, 8)} || '').includes({SESSION!r}) && {_cell(1, 4)} === '2'",
            answered,
        )
        # shown as text: no element of it was made, none of its script ran
        assert await page.evaluate("document.querySelectorAll('img').length") == 0
        assert await page.evaluate("window.pwned === undefined")

        process, _ = engines[victim]
        os.kill(process.pid, signal.SIGKILL)
        # a turn finds the engine dead (a kept-alive connection lost mid-request: ambiguous,
        # 502, never resent; a refused one: served by the other holder); the ledger records it
        with contextlib.suppress(openai.APIStatusError):
            await client.chat.completions.create(
                model="policy",
                messages=[{"role": "user", "content": "again"}],
                max_tokens=2,
                extra_headers={"x-session-id": SESSION},
            )

        async def out_of_routing() -> bool:
            status = (await http.get("/status")).json()
            return not next(e for e in status["engines"] if e["engine"] == victim)["routable"]

        recorded = await _first(out_of_routing, f"{victim} out of routing")
        row = f"document.querySelector('tr[data-engine=\"{victim}\"]')"
        figures["outage"] = await _shown(
            page,
            f"{victim} not routable, unreachable",
            f"{row}?.cells[2].textContent === 'no' && "
            f"{row}?.cells[6].textContent.startsWith('unreachable')",
            recorded,
        )
        assert all(took < WITHIN_S for took in figures.values()), figures

        await wait_for(
            "the last incidents name the outage",
            lambda: _true(
                page,
                "(document.getElementById('incidents').contentDocument?.body?.textContent || '')"
                ".includes('engine_unreachable')",
            ),
            timeout=30,
            every=0.05,
        )
        # the incidents name the session's failed turn, as text there too
        incidents = "document.getElementById('incidents')?.contentDocument"
        await wait_for(
            "the outage's failed turn in the incidents",
            lambda: _true(
                page,  # rich wraps a table cell at spaces: a part of the id with none
                f"({incidents}?.body?.textContent || '').includes({SESSION.split()[-1]!r})",
            ),
            timeout=30,
            every=0.05,
        )
        assert await page.evaluate(f"{incidents}.querySelectorAll('img').length") == 0
        assert await page.evaluate("window.pwned === undefined")
        shot = os.environ.get("LORALEDGER_UI_SCREENSHOT")
        if shot:
            await anyio.Path(shot).write_bytes(await page.screenshot())

        # the links open the replay's timelines
        href = await page.evaluate(f"{row}.cells[0].querySelector('a').href")
        await page.navigate(href)
        await wait_for(
            f"the timeline of {victim}",
            lambda: _true(
                page,
                f"(document.body?.textContent || '').includes('timeline of {victim}') && "
                "document.body.textContent.includes('EngineUnreachable')",
            ),
            timeout=30,
            every=0.05,
        )
        await page.navigate(url + "/ui/version/1")
        await wait_for(
            "the timeline of v1",
            lambda: _true(
                page,
                "(document.body?.textContent || '').includes('timeline of v1') && "
                "document.body.textContent.includes('PUBLISHED')",
            ),
            timeout=30,
            every=0.05,
        )


async def test_private_reads_close_the_page_as_they_close_status(tmp_path: Path) -> None:
    """With ``--private-reads`` the page, its stream and its timelines need the token."""
    async with (
        serving(tmp_path / "ledger.db", token=TOKEN, private_reads=True) as url,
        httpx.AsyncClient(base_url=url, trust_env=False, timeout=30) as http,
    ):
        for path in ("/ui", "/ui/events", "/ui/incidents", "/ui/version/1", "/ui/engine/e0"):
            assert (await http.get(path)).status_code == 401, path
        reply = await http.get("/ui", headers={"Authorization": f"Bearer {TOKEN}"})
        assert reply.status_code == 200
        assert "EventSource" in reply.text


async def test_the_stream_sends_a_snapshot_per_commit_and_ends_when_the_client_leaves(
    tmp_path: Path,
) -> None:
    """The first message is the state now; the next comes with the next commit (not a timer);
    closing the connection ends the stream on the server (its slot is free again)."""
    async with (
        serving(tmp_path / "ledger.db", token=TOKEN) as url,
        httpx.AsyncClient(base_url=url, trust_env=False, timeout=30) as http,
    ):
        auth = {"Authorization": f"Bearer {TOKEN}"}
        seqs: list[int] = []
        async with http.stream("GET", "/ui/events") as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            lines = stream.aiter_lines()
            async for line in lines:
                if line.startswith("id: "):
                    seqs.append(int(line[4:]))
                    break
            reply = await http.post(
                "/owners",
                json={"owner": "w", "ttl_s": 60, "incarnation": "i", "secret": "s" * 64},
                headers=auth,
            )
            assert reply.status_code == 200, reply.text
            with anyio.fail_after(10):
                async for line in lines:
                    if line.startswith("id: "):
                        seqs.append(int(line[4:]))
                        break
        assert seqs[1] > seqs[0], seqs


class _Commits:
    """A ledger's commit signal, driven by the test (``Ledger.wait_committed``'s contract)."""

    def __init__(self, state: RegistryState) -> None:
        self.state = state
        self._event = anyio.Event()

    def commit(self, seq: int) -> None:
        self.state.last_seq = seq
        self._event.set()
        self._event = anyio.Event()

    async def wait(self, seq: int) -> None:
        while self.state.last_seq <= seq:
            await self._event.wait()


def ledger_pages_over(state: RegistryState, commits: _Commits) -> UiPages:
    async def now() -> UiSnapshot:
        return snapshot(state, now=0.0)

    return UiPages(now, commits.wait, max_streams=1, min_interval_s=0.0, keepalive_s=0.05)


async def test_streams_are_bounded_coalesced_and_free_their_slot_when_closed() -> None:
    """One snapshot per wake-up, however many commits came meanwhile; a keepalive comment when
    nothing is committed; one stream past ``max_streams`` is told it is busy and ends; a closed
    stream (its client left: Starlette cancels the generator) frees its slot."""
    state = RegistryState()
    commits = _Commits(state)
    pages = ledger_pages_over(state, commits)

    first = pages._stream()
    assert (await anext(first)).startswith("retry: ")
    assert (await anext(first)).startswith("id: 0\n")
    assert pages.open_streams == 1

    busy = [message async for message in pages._stream()]
    assert len(busy) == 1 and "event: busy" in busy[0], busy
    assert pages.open_streams == 1

    assert await anext(first) == ": keepalive\n\n"  # nothing committed meanwhile
    for seq in (1, 2, 3):  # while the client was reading
        commits.commit(seq)
    assert (await anext(first)).startswith("id: 3\n")  # one snapshot of them all

    await first.aclose()
    assert pages.open_streams == 0


async def test_a_gateway_process_shows_its_own_view_and_sessions(tmp_path: Path) -> None:
    """``loraledger gateway``'s ``/ui``: the versions and engines as it last read them, and the
    sessions it holds pinned to their version (not the other processes' ones)."""
    async with AsyncExitStack() as stack:
        _, _, url, client = await behind_a_gateway(stack, tmp_path, "gw-ui")
        await client.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=2,
            extra_headers={"x-session-id": "g1"},
        )
        gateway = await stack.enter_async_context(
            httpx.AsyncClient(base_url=url, trust_env=False, timeout=30)
        )
        page = await gateway.get("/ui")
        assert page.status_code == 200 and "EventSource" in page.text
        async with gateway.stream("GET", "/ui/events") as stream:
            async for line in stream.aiter_lines():
                if line.startswith("data: "):
                    view = msgspec.json.decode(line[6:], type=UiSnapshot)
                    break
        assert view.view == "gateway" and view.held == 1
        [v1] = [v for v in view.status.versions if v.version_id == 1]
        assert v1.state == "PUBLISHED" and v1.holders == ("e0",)
        assert view.pinned == {1: ("g1",)}
        assert [e.engine for e in view.status.engines if e.routable] == ["e0"]
        # no log in a gateway process: the timelines are serve's
        assert (await gateway.get("/ui/version/1")).status_code == 404


async def test_an_open_page_does_not_hold_up_a_stop(tmp_path: Path) -> None:
    """serve's stop ends the page's streams at once: uvicorn would otherwise wait for them, the
    open responses, ``timeout_graceful_shutdown`` (5 s), then cancel them with an error."""
    opened, ended = anyio.Event(), anyio.Event()

    async def watch(url: str) -> None:
        async with (
            httpx.AsyncClient(base_url=url, trust_env=False, timeout=60) as http,
            http.stream("GET", "/ui/events") as stream,
        ):
            async for line in stream.aiter_lines():
                if line.startswith("data: "):
                    opened.set()
        ended.set()  # the server ended the stream cleanly (no protocol error)

    async with anyio.create_task_group() as tg:
        async with serving(tmp_path / "ledger.db", token=TOKEN) as url:
            tg.start_soon(watch, url)
            await opened.wait()
            stopping = time.monotonic()
        took = time.monotonic() - stopping
        print(f"\nserve stopped in {took:.3f} s with a page open")
        assert ended.is_set()
        assert took < 4.0  # uvicorn's wait for open responses is 5 s
