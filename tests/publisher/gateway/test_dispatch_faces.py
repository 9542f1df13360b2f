"""One dispatch executor behind every face: the same scenario, driven through the Python face
(``SessionBinder.generate``) and through the OpenAI face (HTTP, as any OpenAI client sends it),
gets the same answer -- which engine served it, or which code refused it -- after the same
number of attempts.

Real parts only: local engines over HTTP on loopback, a control plane over them, the OpenAI
routes served by uvicorn. Faults are made by where an engine's requests go (each face reaches
an engine through the same address): nowhere (connection refused), a relay that resets the
connection once the engine answered (a reply lost after the engine ran it), a spare engine that
holds nothing (an engine that lost the adapter: ``NOT_LOADED``), or a relay that holds the
request until the test lets it go.

The last row is the rule the two loops once disagreed on: the staleness bound is checked
before every attempt, so a retry on another holder after new versions were published during
the failed try is refused ``SESSION_TOO_STALE`` (and the session released ``too_stale``) by
both faces.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.abc
import httpx
import pytest

from engines.contract import SamplingParams
from engines.local.client import LocalHTTPEngine
from engines.local.engine import LocalEngine
from engines.local.server import serve as serve_engine
from evlog.errors import LoraLedgerError
from evlog.events import SessionReleased
from projections.staleness import TOO_STALE
from publisher.drivers.fleet import Fleet
from publisher.gateway import DispatchCode, DispatchError, Gateway, LocalView
from publisher.gateway.affinity import rendezvous
from publisher.openai import EngineRoute
from publisher.sessions import RolloutWorker
from tests.publisher.openai_kit import TOKEN, Rig, rig
from tests.publisher.plane_kit import LIMITS, PEFT_WARNINGS
from tests.support.log import events
from tests.support.relay import Relay

pytestmark = [pytest.mark.anyio, PEFT_WARNINGS]

T = TypeVar("T")
PROMPT = "the quick brown fox"
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
TOO_LONG = SamplingParams(max_tokens=LIMITS.max_request_tokens + 1, temperature=0.0)


@dataclass(frozen=True)
class Answer:
    """What a face answered, face-neutral: served by an engine, or refused with a code (an
    engine's refusal by the engine's own code), and how many attempts the gateway made."""

    served_by: str | None
    refused: str | None
    attempts: int


def _nowhere() -> str:
    """A loopback URL where nothing listens (connection refused)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


@dataclass
class Stage:
    """What a scenario sets up: where each engine's turns go, what runs while the turn is in
    flight, and how the turn asks."""

    routes: dict[str, str] = field(default_factory=dict)  # engine -> where its turns go
    relays: list[Relay] = field(default_factory=list)
    during: Callable[[], Coroutine[Any, Any, None]] | None = None  # beside the turn in flight
    params: SamplingParams = GREEDY


Setup = Callable[[Rig, contextlib.AsyncExitStack, str], Awaitable[Stage]]


async def healthy(r: Rig, stack: contextlib.AsyncExitStack, spare: str) -> Stage:
    return Stage()


async def first_lacks_it(r: Rig, stack: contextlib.AsyncExitStack, spare: str) -> Stage:
    return Stage(routes={"e0": spare})


async def first_unreachable(r: Rig, stack: contextlib.AsyncExitStack, spare: str) -> Stage:
    return Stage(routes={"e0": _nowhere()})


async def first_loses_reply(r: Rig, stack: contextlib.AsyncExitStack, spare: str) -> Stage:
    relay = Relay(r.urls["e0"], "reset")
    url = await stack.enter_async_context(relay.running())
    return Stage(routes={"e0": url}, relays=[relay])


async def request_too_big(r: Rig, stack: contextlib.AsyncExitStack, spare: str) -> Stage:
    return Stage(params=TOO_LONG)


async def every_holder_lacks_it(r: Rig, stack: contextlib.AsyncExitStack, spare: str) -> Stage:
    return Stage(routes={"e0": spare, "e1": spare})


async def no_routable_holder(r: Rig, stack: contextlib.AsyncExitStack, spare: str) -> Stage:
    for engine in ("e0", "e1"):
        await r.plane.ledger.suspend_engine(engine, cause="operator", detail="test")
    return Stage()


async def stale_by_the_retry(r: Rig, stack: contextlib.AsyncExitStack, spare: str) -> Stage:
    """e0 holds the turn while two versions are published, then refuses it ``NOT_LOADED``:
    the retry on e1 would serve a session two versions behind, over the bound of one."""
    await r.plane.ledger.configure_deployment(max_staleness=1)
    relay = Relay(spare, "hold")
    url = await stack.enter_async_context(relay.running())

    async def publish_two() -> None:
        await relay.arrived.wait()
        await r.publish(2)
        await r.publish(3)
        relay.release()

    return Stage(routes={"e0": url}, relays=[relay], during=publish_two)


# name, setup, the answer both faces give
SCENARIOS: list[tuple[str, Setup, Answer]] = [
    ("healthy", healthy, Answer("e0", None, 1)),
    ("first holder lacks the adapter", first_lacks_it, Answer("e1", None, 2)),
    ("first holder unreachable", first_unreachable, Answer("e1", None, 2)),
    (
        "reply lost after the engine ran it",
        first_loses_reply,
        Answer(None, DispatchCode.AMBIGUOUS_DISPATCH, 1),
    ),
    ("the engine refuses the request", request_too_big, Answer(None, "BAD_REQUEST", 1)),
    ("every holder lacks the adapter", every_holder_lacks_it, Answer(None, "NOT_LOADED", 2)),
    ("no routable holder", no_routable_holder, Answer(None, DispatchCode.NO_ROUTE, 0)),
    ("too stale by the retry", stale_by_the_retry, Answer(None, "SESSION_TOO_STALE", 1)),
]


async def python_face(r: Rig, routes: dict[str, str], session: str, stage: Stage) -> Answer:
    """The turn through ``SessionBinder.generate``, over a gateway that reaches each engine
    where the stage says."""
    async with contextlib.AsyncExitStack() as stack:
        handles = [
            await stack.enter_async_context(contextlib.aclosing(LocalHTTPEngine(url, engine_id)))
            for engine_id, url in routes.items()
        ]
        gateway = Gateway(
            Fleet(handles),
            LocalView(r.plane.ledger),
            gateway_id="python-face",
            on_engine_trouble=r.plane.reconciler.engine_trouble,
        )
        worker = await stack.enter_async_context(
            RolloutWorker.open(r.plane.ledger, gateway, owner="python-face")
        )
        binder = worker.session(session)
        await binder.bind()
        try:
            served = await _during(stage, binder.generate(PROMPT, stage.params))
            answer = Answer(served.engine, None, gateway.dispatched)
        except DispatchError as exc:
            code = exc.details.get("engine_code") if exc.code == "GENERATION_FAILED" else None
            answer = Answer(None, code or exc.code, gateway.dispatched)
        except LoraLedgerError as exc:
            answer = Answer(None, exc.code, gateway.dispatched)
        assert not gateway.inflight_counts() and not worker.inflight
        return answer


async def openai_face(r: Rig, routes: dict[str, str], session: str, stage: Stage) -> Answer:
    """The turn through the OpenAI routes, as an OpenAI client sends it (``x-session-id``)."""
    for engine_id, url in routes.items():
        r.face.engines[engine_id] = EngineRoute(engine_id=engine_id, kind="local", base_url=url)
    headers = {"authorization": f"Bearer {TOKEN}", "x-session-id": session}
    async with httpx.AsyncClient(base_url=r.url, headers=headers, timeout=60) as http:
        body = {
            "model": "policy",
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": stage.params.max_tokens,
            "temperature": 0,
        }
        before = r.gateway.dispatched
        reply = await _during(stage, http.post("/v1/chat/completions", json=body))
    attempts = r.gateway.dispatched - before
    assert not r.gateway.inflight_counts() and not r.worker.inflight
    if reply.status_code == 200:
        return Answer(reply.headers["x-loraledger-engine"], None, attempts)
    return Answer(None, reply.json()["error"]["code"], attempts)


async def _during(stage: Stage, turn: Awaitable[T]) -> T:
    """Await ``turn`` while ``stage.during`` runs beside it; the turn's own error is raised as
    itself (not inside a task group's exception group)."""
    if stage.during is None:
        return await turn
    outcome: list[T] = []
    failure: list[Exception] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(stage.during)
        try:
            outcome.append(await turn)
        except Exception as exc:
            failure.append(exc)
    if failure:
        raise failure[0]
    return outcome[0]


@contextlib.asynccontextmanager
async def spare_engine() -> AsyncIterator[str]:
    """An engine of nobody's fleet, holding no adapter: it refuses every managed name
    ``NOT_LOADED``, as an engine that restarted empty does."""
    async with LocalEngine("spare", limits=LIMITS) as engine, serve_engine(engine) as url:
        yield url


@pytest.mark.parametrize("face", [python_face, openai_face], ids=["python", "openai"])
@pytest.mark.parametrize(
    ("setup", "expected"), [(s, a) for _, s, a in SCENARIOS], ids=[n for n, _, _ in SCENARIOS]
)
async def test_both_faces_answer_the_same(
    tmp_path: Path,
    face: Callable[[Rig, dict[str, str], str, Stage], Awaitable[Answer]],
    setup: Setup,
    expected: Answer,
) -> None:
    async with (
        rig(tmp_path, capacity=4, probe_interval_s=3600.0) as r,
        spare_engine() as spare,
        contextlib.AsyncExitStack() as stack,
    ):
        await r.publish(1)
        session = next(f"s{i}" for i in range(1000) if rendezvous(f"s{i}", ["e0", "e1"]) == "e0")
        stage = await setup(r, stack, spare)
        routes = {**r.urls, **stage.routes}
        answer = await face(r, routes, session, stage)
        assert answer == expected
        if expected.refused == DispatchCode.AMBIGUOUS_DISPATCH:
            assert sum(relay.delivered for relay in stage.relays) == 1  # sent once, not resent
        if expected.refused == "SESSION_TOO_STALE":
            released = [
                e
                for e in await events(r.plane.ledger)
                if isinstance(e, SessionReleased) and e.session == session
            ]
            assert [e.cause for e in released] == [TOO_STALE]
