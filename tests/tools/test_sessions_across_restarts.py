"""Sessions outlive the processes that relayed them: real ``loraledger engine``, ``serve`` and
``gateway`` processes (port 0, stopped by PID), the official ``openai`` client.

A session bound through an OpenAI face belongs to its client (docs/sessions.md, "Who owns a
session"): ``serve`` stopped with SIGTERM or killed with SIGKILL and started again on the same
log, or a ``loraledger gateway`` in front of a live ``serve`` restarted either way, serves the
next turn of every session on the version it was bound to, though a newer one is the default
now. A session idle past its bound is released by ``serve``'s process, with no face running.

Before, the end of the face's owner life ended them: 0 of 8 sessions survived a ``serve``
SIGTERM (``owner_exited``) or SIGKILL (``owner_restarted`` at the next start), and a gateway's
SIGTERM released its sessions the same way (each next turn: 409 ``SESSION_CLOSED``). The counts
below are the figures of RELIABILITY.md, "Sessions across process restarts"."""

from __future__ import annotations

import functools
import json
import signal
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import anyio.to_thread
import httpx
import openai
import pytest

from evlog.events import SessionReleased
from evlog.sqlite import SQLiteStore
from tests.publisher.rollout_kit import ENGINE_WARNINGS
from tests.support.waiting import wait_for
from tests.tools.test_serve import _adapter_dir, _Process

pytestmark = [pytest.mark.anyio, *ENGINE_WARNINGS]
TOKEN = "sessions-across-restarts"
SESSIONS = [f"episode-{i}" for i in range(8)]
HELLO = [{"role": "user", "content": "hello"}]


class World:
    """An engine process, ``serve`` processes on one log, gateway processes; each started
    process is stopped (SIGTERM, then SIGKILL) by PID when the test ends."""

    def __init__(self, tmp_path: Path, stack: ExitStack) -> None:
        self.tmp = tmp_path
        self.stack = stack
        self.db = tmp_path / "ledger.db"
        self.token_file = tmp_path / "token"
        self.token_file.write_text(TOKEN + "\n")
        self.started = 0
        engine = self.start("engine", "--id", "e0", "--port", "0", "--json")
        self.engine_url = str(engine.ready()["url"])

    def start(self, *args: str) -> _Process:
        self.started += 1
        process = _Process(self.tmp, f"p{self.started}", *args)
        self.stack.callback(process.stop)
        return process

    async def serve(self) -> tuple[_Process, str]:
        process = self.start(
            "serve", "--db", str(self.db), "--port", "0", "--token-file", str(self.token_file),
            "--engine", f"e0=local:{self.engine_url}", "--json",
        )  # fmt: skip
        return process, str((await anyio.to_thread.run_sync(process.ready))["url"])

    async def gateway(self, ledger: str, *flags: str) -> tuple[_Process, str]:
        process = self.start(
            "gateway", "--ledger", ledger, "--token-file", str(self.token_file), "--port", "0",
            "--refresh-s", "0.2", "--provenance", str(self.tmp / f"gw{self.started}.jsonl"),
            "--json", *flags,
        )  # fmt: skip
        return process, str((await anyio.to_thread.run_sync(process.ready))["url"])

    async def publish(self, ledger: str, version_id: int) -> None:
        adapter = _adapter_dir(self.tmp, version_id)
        async with httpx.AsyncClient(base_url=ledger, trust_env=False, timeout=120) as http:
            reply = await http.post(
                "/versions",
                json={"version_id": version_id, "adapter_dir": str(adapter)},
                headers={"Authorization": f"Bearer {TOKEN}"},
            )
        assert reply.status_code == 200 and reply.json()["status"] == "PUBLISHED", reply.text


async def turns(face: str, sessions: list[str]) -> dict[str, str]:
    """One turn of each session through the face at ``face``: the version that served it, or
    the refusal's code."""
    seen: dict[str, str] = {}
    async with openai.AsyncOpenAI(base_url=face + "/v1", api_key=TOKEN, max_retries=0) as client:
        for session in sessions:
            try:
                raw = await client.chat.completions.with_raw_response.create(
                    model="policy",
                    messages=HELLO,  # type: ignore[arg-type]
                    max_tokens=2,
                    extra_headers={"x-session-id": session},
                )
                seen[session] = raw.headers["x-loraledger-version"]
            except openai.APIStatusError as exc:
                seen[session] = f"{exc.status_code} {exc.code}"
    return seen


def kept(seen: dict[str, str]) -> str:
    """Sessions served on their version (1) after a restart, as N/N."""
    return f"{sum(v == '1' for v in seen.values())}/{len(seen)}"


async def stop(process: _Process, how: signal.Signals) -> None:
    process.proc.send_signal(how)
    code = await anyio.to_thread.run_sync(functools.partial(process.proc.wait, timeout=60))
    assert code == (0 if how == signal.SIGTERM else -signal.SIGKILL), process.stderr()[-2000:]


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    with ExitStack() as stack:
        yield World(tmp_path, stack)


async def test_sessions_bound_through_serve_survive_its_restart(world: World) -> None:
    serve, url = await world.serve()
    await world.publish(url, 1)
    assert set((await turns(url, SESSIONS)).values()) == {"1"}  # bound to v1
    await world.publish(url, 2)  # the default moves on: a new session would bind v2
    figures = {}
    for how in (signal.SIGTERM, signal.SIGKILL):
        await stop(serve, how)
        serve, url = await world.serve()  # the same log, a new process (and a new port)
        figures[how.name] = kept(await turns(url, SESSIONS))
    assert figures == {"SIGTERM": "8/8", "SIGKILL": "8/8"}, figures
    assert await turns(url, ["newcomer"]) == {"newcomer": "2"}
    print(f"serve restarts: sessions kept {figures}")


async def test_sessions_bound_through_a_gateway_process_survive_its_restart_and_go_idle_in_serve(
    world: World,
) -> None:
    _, ledger = await world.serve()
    await world.publish(ledger, 1)
    gateway, face = await world.gateway(ledger)
    assert set((await turns(face, SESSIONS)).values()) == {"1"}
    await world.publish(ledger, 2)
    figures = {}
    for how in (signal.SIGTERM, signal.SIGKILL):
        await stop(gateway, how)
        gateway, face = await world.gateway(ledger)  # a new owner id, as a restarted pod gets
        figures[how.name] = kept(await turns(face, SESSIONS))
    assert figures == {"SIGTERM": "8/8", "SIGKILL": "8/8"}, figures
    print(f"gateway restarts: sessions kept {figures}")

    # A session bound through a gateway whose sessions go idle after 2 s: that gateway is
    # killed, and serve's process releases the session once it had no turn for 2 s.
    short, short_url = await world.gateway(ledger, "--session-idle-s", "2")
    assert await turns(short_url, ["short-lived"]) == {"short-lived": "2"}
    await stop(short, signal.SIGKILL)
    async with httpx.AsyncClient(base_url=ledger, trust_env=False, timeout=30) as http:

        async def released() -> bool:  # the 8 episodes are all that is left bound
            return bool((await http.get("/status")).json()["sessions_bound"] == len(SESSIONS))

        await wait_for("the idle session released by serve", released, timeout=30, every=0.1)
    late = await turns(face, ["short-lived"])  # a late turn, through another gateway
    assert late == {"short-lived": "409 SESSION_CLOSED"}, late
    assert await turns(face, SESSIONS[:1]) == {SESSIONS[0]: "1"}  # the episodes are untouched


async def test_the_idle_release_is_recorded_with_the_last_turn(world: World) -> None:
    """What serve's process recorded for an idle release: the cause, the last turn it heard
    of (by its own clock) and the idle bound of the face that bound the session."""
    serve, ledger = await world.serve()
    await world.publish(ledger, 1)
    gateway, face = await world.gateway(ledger, "--session-idle-s", "1")
    assert await turns(face, ["brief"]) == {"brief": "1"}
    await stop(gateway, signal.SIGTERM)  # a clean stop releases nothing: serve does, when idle
    async with httpx.AsyncClient(base_url=ledger, trust_env=False, timeout=30) as http:

        async def released() -> bool:
            return bool((await http.get("/status")).json()["sessions_bound"] == 0)

        await wait_for("the idle session released by serve", released, timeout=30, every=0.1)
    await stop(serve, signal.SIGTERM)
    async with SQLiteStore.open(world.db) as store:
        records = [r for r in await store.read() if isinstance(r.event, SessionReleased)]
    (record,) = records
    event = record.event
    assert isinstance(event, SessionReleased)
    assert (event.session, event.cause, event.idle_s) == ("brief", "idle", 1.0)
    assert event.last_turn is not None and event.at is not None
    assert 1.0 <= event.at - event.last_turn < 10.0
    assert event.at <= record.recorded_at + 1.0
    print(json.dumps({"idle release": {"after_s": round(event.at - event.last_turn, 2)}}))
