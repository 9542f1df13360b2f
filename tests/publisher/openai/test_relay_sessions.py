"""The OpenAI face as a relay of client-held sessions, in process (the official client, local
engines over HTTP, the control plane on an in-memory log):

* its renewals carry the sessions it had a turn of, a turn still running included, and the
  plane releases a session with none for the idle bound (cause ``idle``, with the last turn);
  a late turn is ``409 SESSION_CLOSED`` saying so, and the face forgets its cached binding
  but not the tombstone (the ledger wrote it, the ledger forgets it);
* a first turn that names a version is bound only if the ledger's default is that version,
  whatever the face's own copy of the ledger says: a refused first turn binds nothing.

Before, the face's own worker released idle sessions on the turns it alone served, a session
whose face was gone was never idle-released, and a face that could not see the ledger's
sessions (a gateway process, a Ray gateway actor) bound a first turn naming a non-default
version to the default, then refused it 409, leaving the session bound."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from evlog.events import SessionBound, SessionReleased
from projections.status import LedgerStatus
from publisher.gateway import Gateway, LocalView
from publisher.openai import OpenAIGateway, OpenAIOptions, engine_routes, openai_app
from publisher.sessions import RolloutWorker
from tests.publisher.openai_kit import TOKEN, Rig, rig, serve_app
from tests.publisher.rollout_kit import ENGINE_WARNINGS
from tests.support.log import events_of
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.anyio, *ENGINE_WARNINGS]

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]


def client_of(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=TOKEN, max_retries=0)


async def turn(client: openai.AsyncOpenAI, session: str, model: str = "policy") -> str:
    raw = await client.chat.completions.with_raw_response.create(
        model=model, messages=MESSAGES, max_tokens=2, extra_headers={"x-session-id": session}
    )
    return raw.headers["x-loraledger-version"]


async def test_the_plane_releases_idle_sessions_from_the_turns_the_relay_reports(
    tmp_path: Path,
) -> None:
    async with rig(tmp_path, sessions_idle_s=0.5) as r, client_of(r.url) as client:
        ledger = r.plane.ledger
        await r.publish(1)
        assert [await turn(client, s) for s in ("quiet", "long")] == ["1", "1"]
        assert ledger.activity.last_turn("quiet") is not None  # heard with the renewal
        async with r.worker.session("long").turn():  # a turn running the whole time
            await wait_for(
                "quiet released", lambda: "quiet" not in ledger.state.sessions, timeout=20
            )
            (released,) = await events_of(ledger, SessionReleased)
            assert (released.session, released.cause, released.idle_s) == ("quiet", "idle", 0.5)
            assert released.at is not None and released.last_turn is not None
            assert released.at - released.last_turn >= 0.5
            # the running turn keeps being reported: "long" is never idle while it runs
            at = released.at
            await wait_for(
                "the running turn reported past the bound",
                lambda: (ledger.activity.last_turn("long") or 0.0) > at + 0.5,
                timeout=20,
            )
            assert "long" in ledger.state.sessions

        with pytest.raises(openai.ConflictError) as late:
            await turn(client, "quiet")
        assert late.value.code == "SESSION_CLOSED" and "idle" in late.value.message
        assert late.value.response.headers["x-should-retry"] == "false"
        assert "quiet" not in r.worker._binders
        await r.worker.flush_forgets()
        assert "quiet" in ledger.state.tombstones  # not this face's to forget


class _BlindView(LocalView):
    """What a gateway process or a Ray gateway actor sees of the ledger: no sessions (it
    cannot tell a session is unbound), and a status read a while ago (the default has moved
    since)."""

    def __init__(self, r: Rig) -> None:
        super().__init__(r.plane.ledger)
        self._copy: LedgerStatus = r.plane.ledger.status()

    def status(self) -> LedgerStatus:
        return self._copy

    def knows_unbound(self, session: str) -> bool:
        return False


@contextlib.asynccontextmanager
async def blind_face(r: Rig) -> AsyncIterator[str]:
    """A second OpenAI face (a relay, owner ``gw-blind``) over a :class:`_BlindView`."""
    gateway = Gateway(r.plane.fleet, _BlindView(r), gateway_id="gw-blind")
    async with RolloutWorker.open(
        r.plane.ledger, gateway, owner="gw-blind", sessions_idle_s=1800.0
    ) as worker:
        face = OpenAIGateway(worker, engine_routes(r.plane.fleet), OpenAIOptions(token=TOKEN))
        try:
            async with serve_app(openai_app(face)) as url:
                yield url
        finally:
            await face.aclose()


async def test_a_first_turn_naming_a_version_binds_only_to_the_ledgers_default(
    tmp_path: Path,
) -> None:
    async with rig(tmp_path, sessions_idle_s=1800.0) as r, client_of(r.url) as on_serve:
        v1 = await r.publish(1)
        assert await turn(on_serve, "elsewhere") == "1"
        async with blind_face(r) as url, client_of(url) as client:  # its copy: v1 the default
            v2 = await r.publish(2)
            bound_before = await events_of(r.plane.ledger, SessionBound)
            # v1 is the default by this face's copy, not by the ledger: refused, nothing bound
            with pytest.raises(openai.ConflictError) as refused:
                await turn(client, "fresh", model=v1)
            assert refused.value.code == "VERSION_NOT_BOUND"
            assert v2 in refused.value.message and "default" in refused.value.message
            assert "fresh" not in r.plane.ledger.state.sessions
            assert await events_of(r.plane.ledger, SessionBound) == bound_before
            # a session bound elsewhere to v1 is served v1 here; the alias binds the default
            assert await turn(client, "elsewhere", model=v1) == "1"
            assert await turn(client, "fresh") == "2"
            with pytest.raises(openai.ConflictError) as pinned:
                await turn(client, "fresh", model=v1)
            assert pinned.value.code == "VERSION_NOT_BOUND" and v2 in pinned.value.message
