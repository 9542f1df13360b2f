"""What the OpenAI face refuses before anything is bound, and how it answers requests outside
its routes, with the official ``openai`` client against the face on real parts (local engines
over HTTP on loopback, the in-process ledger: ``LocalView``).

* an unknown ``model`` is ``404 model_not_found`` (the SDK's ``NotFoundError``), and a first
  turn naming a version other than the default is ``409 VERSION_NOT_BOUND``: neither leaves a
  ``SessionBound`` or ``SessionReleased`` in the log;
* a session bound by another gateway keeps its own version name;
* ``GET /v1/models/{model}`` (``models.retrieve``) answers the list's entry;
* unknown paths, wrong methods and a trailing slash answer in OpenAI's error shape."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from evlog.events import SessionBound, SessionReleased
from projections.transitions import VersionState
from publisher.gateway import Gateway, LocalView
from publisher.sessions import RolloutWorker
from tests.publisher.openai_kit import TOKEN, Rig, rig
from tests.publisher.rollout_kit import ENGINE_WARNINGS
from tests.support.log import events
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.anyio, *ENGINE_WARNINGS]

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "the quick brown fox"}]
AUTH = {"authorization": f"Bearer {TOKEN}"}


def client_of(r: Rig) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=r.base_url, api_key=TOKEN, max_retries=0)


async def session_events(r: Rig) -> list[tuple[str, str]]:
    """Every ``SessionBound``/``SessionReleased`` of the log, as (type, session)."""
    return [
        (type(e).__name__, e.session)
        for e in await events(r.plane.ledger)
        if isinstance(e, (SessionBound, SessionReleased))
    ]


def other_gateway(r: Rig) -> AbstractAsyncContextManager[RolloutWorker]:
    """The worker of a second gateway (owner ``gw-b``) on the rig's ledger and fleet."""
    gateway = Gateway(r.plane.fleet, LocalView(r.plane.ledger), gateway_id="gw-b")
    return RolloutWorker.open(r.plane.ledger, gateway, owner="gw-b")


def openai_error(response: httpx.Response) -> dict[str, Any]:
    """The body of an error reply, checked to be OpenAI's shape."""
    assert response.headers["content-type"] == "application/json", response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["message"], error
    assert response.headers["x-should-retry"] == "false"
    return dict(error)


async def test_an_unknown_model_is_not_found_and_binds_nothing(tmp_path: Path) -> None:
    async with rig(tmp_path) as r, client_of(r) as client:
        await r.publish(1)
        before = await session_events(r)
        sent = r.gateway.dispatched
        calls: list[Any] = [
            client.chat.completions.create(model="gpt-4o", messages=MESSAGES),
            client.chat.completions.create(
                model="gpt-4o",
                messages=MESSAGES,
                stream=True,
                extra_headers={"x-session-id": "agent-7"},
            ),
            client.completions.create(
                model="gpt-4o", prompt="hi", extra_headers={"x-session-id": "agent-7"}
            ),
        ]
        for call in calls:
            with pytest.raises(openai.NotFoundError) as info:
                await call
            assert info.value.code == "model_not_found"
            assert "'gpt-4o'" in info.value.message and "/v1/models" in info.value.message
            assert info.value.response.headers["x-should-retry"] == "false"
        assert await session_events(r) == before  # no bind, no release: nothing written
        assert r.gateway.dispatched == sent
        assert "agent-7" not in r.plane.ledger.state.sessions

        # The session id is still fresh: its first real turn binds it, once.
        raw = await client.chat.completions.with_raw_response.create(
            model="policy",
            messages=MESSAGES,
            max_tokens=2,
            extra_headers={"x-session-id": "agent-7"},
        )
        assert raw.headers["x-loraledger-version"] == "1"
        assert (await session_events(r))[len(before) :] == [("SessionBound", "agent-7")]


async def test_a_first_turn_naming_another_version_than_the_default_binds_nothing(
    tmp_path: Path,
) -> None:
    """The session is not bound yet, so its first turn would bind it to the default: naming
    any other version is refused before the bind, and the session stays free to bind. A
    session another gateway bound to v1 is not refused v1 here, though this gateway never saw
    it: the ledger knows the binding."""
    async with (
        rig(tmp_path) as r,
        client_of(r) as client,
        other_gateway(r) as worker_b,
    ):
        v1 = await r.publish(1)
        await worker_b.session("elsewhere").bind()
        v2 = await r.publish(2)
        listed = [m.id for m in (await client.models.list()).data]
        assert v1 in listed and v2 in listed
        before = await session_events(r)
        for session in ("want-v1", None):  # a named session, and a one-turn request
            with pytest.raises(openai.ConflictError) as info:
                await client.chat.completions.create(
                    model=v1,
                    messages=MESSAGES,
                    max_tokens=2,
                    extra_headers={"x-session-id": session} if session else None,
                )
            assert info.value.code == "VERSION_NOT_BOUND"
            assert v2 in info.value.message and "default" in info.value.message
            assert info.value.response.headers["x-should-retry"] == "false"
        assert await session_events(r) == before
        assert "want-v1" not in r.plane.ledger.state.sessions

        # The default's own name is accepted on a first turn (it binds to it), one-turn too.
        for session in ("want-v2", None):
            raw = await client.chat.completions.with_raw_response.create(
                model=v2,
                messages=MESSAGES,
                max_tokens=2,
                extra_headers={"x-session-id": session} if session else None,
            )
            assert raw.headers["x-loraledger-version"] == "2"
        raw = await client.chat.completions.with_raw_response.create(
            model="policy",
            messages=MESSAGES,
            max_tokens=2,
            extra_headers={"x-session-id": "want-v1"},
        )
        assert raw.headers["x-loraledger-version"] == "2"
        new = [kind for kind, session in (await session_events(r))[len(before) :]]
        assert new.count("SessionBound") == 3 and new.count("SessionReleased") == 1  # the one-turn

        raw = await client.chat.completions.with_raw_response.create(
            model=v1, messages=MESSAGES, max_tokens=2, extra_headers={"x-session-id": "elsewhere"}
        )
        assert raw.headers["x-loraledger-version"] == "1"
        with pytest.raises(openai.ConflictError) as info:  # refused after the bind answered v1
            await client.chat.completions.create(
                model=v2, messages=MESSAGES, extra_headers={"x-session-id": "elsewhere"}
            )
        assert info.value.code == "VERSION_NOT_BOUND" and v1 in info.value.message


async def test_models_retrieve_answers_the_entry_of_the_list(tmp_path: Path) -> None:
    async with rig(tmp_path) as r, client_of(r) as client:
        v1 = await r.publish(1)
        await r.worker.session("keeps-v1").bind()  # v1 stays RETIRED, not reclaimed
        await r.publish(2)
        listed = {m.id: m.model_dump() for m in (await client.models.list()).data}
        for name in ("policy", v1):
            got = (await client.models.retrieve(name)).model_dump()
            assert got["id"] == name
            assert {k: v for k, v in got.items() if k != "created"} == {
                k: v for k, v in listed[name].items() if k != "created"
            }
        assert (await client.models.retrieve("policy")).model_extra["default_version"] == 2  # type: ignore[index]
        assert (await client.models.retrieve(v1)).model_extra["state"] == "RETIRED"  # type: ignore[index]
        with pytest.raises(openai.NotFoundError) as info:
            await client.models.retrieve("gpt-4o")
        assert info.value.code == "model_not_found" and "'gpt-4o'" in info.value.message
        r.face.clock = lambda: 1234.9  # the cards' `created`: the face's clock, in seconds
        raw = await client.models.with_raw_response.retrieve(v1)
        assert raw.headers["content-type"] == "application/json"
        assert raw.parse().created == 1234
        async with httpx.AsyncClient(base_url=r.url, headers=AUTH, trust_env=False) as http:
            listing = await http.get("/v1/models")
        assert listing.status_code == 200
        assert listing.headers["content-type"] == "application/json"
        assert set(listing.json()) == {"object", "data"} and listing.json()["object"] == "list"
        assert {card["created"] for card in listing.json()["data"]} == {1234}
        with pytest.raises(openai.AuthenticationError):
            await client.with_options(api_key="nope").models.retrieve("policy")


async def test_requests_outside_the_routes_answer_in_openai_shape(tmp_path: Path) -> None:
    """The face as its own app (a gateway process, a Ray actor): a wrong method is a 405
    with ``Allow``, an unknown path or a trailing slash a 404 (never a redirect), all JSON in
    OpenAI's shape, which the SDK turns into its typed errors with the code."""
    async with rig(tmp_path) as r, client_of(r) as client:
        await r.publish(1)
        async with httpx.AsyncClient(
            base_url=r.url, headers=AUTH, trust_env=False, follow_redirects=False
        ) as http:
            for method in ("GET", "OPTIONS", "PUT", "DELETE"):
                response = await http.request(method, "/v1/chat/completions")
                assert response.status_code == 405, (method, response.text)
                assert openai_error(response)["code"] == "METHOD_NOT_ALLOWED"
                assert response.headers["allow"] == "POST"
            response = await http.post("/v1/models")
            assert (response.status_code, response.headers["allow"]) == (405, "GET")
            response = await http.get("/v1/sessions/s1/release")
            assert response.status_code == 405 and openai_error(response)["code"]

            response = await http.post(
                "/v1/chat/completions/", json={"model": "policy", "messages": MESSAGES}
            )
            assert response.status_code == 404, response.text
            error = openai_error(response)
            assert error["code"] == "UNKNOWN_ROUTE"
            assert error["message"] == (
                "no route POST /v1/chat/completions/ on this gateway: did you mean "
                "POST /v1/chat/completions (no trailing slash)?"
            )
            # only the slash is stripped: a path that names no route without it gets the list
            response = await http.post("/v1/chat/completionsX/", json={})
            assert openai_error(response)["message"] == (
                "no route POST /v1/chat/completionsX/ on this gateway: the routes are "
                "POST /v1/chat/completions, POST /v1/completions, GET /v1/models, "
                "GET /v1/models/{model:path}, POST /v1/sessions/{session:path}/release"
            )
            for method, path in [
                ("POST", "/v1/embeddings"),
                ("POST", "/v1/responses"),
                ("GET", "/v1/models/"),
                ("GET", "/"),
                ("POST", "/chat/completions"),  # a base_url without /v1
            ]:
                response = await http.request(method, path, json={})
                assert response.status_code == 404, (path, response.text)
                assert openai_error(response)["code"] == "UNKNOWN_ROUTE"
            assert r.gateway.dispatched == 0 and not r.plane.ledger.state.sessions

        with pytest.raises(openai.NotFoundError) as info:
            await client.embeddings.create(model="policy", input="x")
        assert info.value.code == "UNKNOWN_ROUTE"


async def test_a_non_ascii_request_id_is_refused_before_anything_is_bound(tmp_path: Path) -> None:
    """The id goes on to the engine in a header, which carries ASCII only: a request with
    ``x-request-id: run-é`` was bound, then failed building the engine's request and was
    answered 502 AMBIGUOUS_DISPATCH with an ``ambiguous`` row, though nothing had been sent."""
    async with rig(tmp_path) as r, httpx.AsyncClient(base_url=r.url, trust_env=False) as http:
        await r.publish(1)
        before = await session_events(r)
        sent = r.gateway.dispatched
        reply = await http.post(
            "/v1/chat/completions",
            json={"model": "policy", "messages": MESSAGES, "max_tokens": 2},
            headers=[
                (b"authorization", AUTH["authorization"].encode()),
                (b"x-session-id", b"s-ascii"),
                (b"x-request-id", "run-é".encode()),  # UTF-8 bytes, as curl sends them
            ],
        )
        assert reply.status_code == 400, reply.text
        error = openai_error(reply)
        assert error["code"] == "INVALID_INPUT" and "ASCII" in error["message"], error
        assert await session_events(r) == before
        assert r.gateway.dispatched == sent and r.sink.rows == []


async def test_a_session_released_through_another_gateway_is_closed_here_not_no_route(
    tmp_path: Path,
) -> None:
    """Each gateway process caches the bindings it served. A session released through another
    one (an explicit release, or its idle release) was still served here from the cache, and
    once its version was reclaimed every turn was ``503 NO_ROUTE`` with ``x-should-retry:
    true``: the SDK retried it twice, in vain. Now that turn is ``409 SESSION_CLOSED`` and this
    gateway forgets the binding, so every later turn is refused the same way by the ledger."""
    async with (
        rig(tmp_path) as r,
        client_of(r) as client,
        other_gateway(r) as worker_b,
    ):
        await r.publish(1)
        turn: dict[str, Any] = dict(
            model="policy", messages=MESSAGES, max_tokens=2, extra_headers={"x-session-id": "ep-1"}
        )
        raw = await client.chat.completions.with_raw_response.create(**turn)
        assert raw.headers["x-loraledger-version"] == "1"
        await worker_b.session("ep-1").close()  # released behind this gateway's back
        assert "ep-1" not in r.plane.ledger.state.sessions
        await r.publish(2)
        await wait_for(
            "v1 reclaimed", lambda: r.plane.ledger.state.versions[1].state == VersionState.RECLAIMED
        )
        for _ in range(2):  # the stale cache's answer, then the ledger's own
            with pytest.raises(openai.ConflictError) as info:
                await client.chat.completions.create(**turn)
            assert info.value.code == "SESSION_CLOSED", info.value.message
            assert info.value.response.headers["x-should-retry"] == "false"
        assert "ep-1" not in r.worker._binders


async def test_refusals_before_the_parse_carry_the_request_id_and_openais_whole_shape(
    tmp_path: Path,
) -> None:
    """docs/openai.md: ``x-request-id`` is on error replies too; a 401 and a 400 (bad body)
    had none. And OpenAI's error object always has ``param`` (null here), which was missing."""
    async with rig(tmp_path) as r, httpx.AsyncClient(base_url=r.url, trust_env=False) as http:
        unauthorized = await http.post(
            "/v1/chat/completions", json={}, headers={"x-request-id": "trace-1"}
        )
        assert unauthorized.status_code == 401
        assert unauthorized.headers["x-request-id"] == "trace-1"
        bad = await http.post("/v1/chat/completions", content=b"{not json", headers=AUTH)
        assert bad.status_code == 400 and len(bad.headers["x-request-id"]) == 32  # made here
        for reply in (unauthorized, bad):
            error = openai_error(reply)
            assert "param" in error and error["param"] is None, error


async def test_a_session_too_stale_is_refused_so_before_its_model_is_judged(tmp_path: Path) -> None:
    """The executor's per-attempt rules in their order: the lease, the staleness bound, then
    the face's pin of ``model``. A session past ``max_staleness`` whose turn also names another
    version is refused ``SESSION_TOO_STALE`` and released (cause ``too_stale``), as every turn
    of it would be, not ``VERSION_NOT_BOUND`` with the session left bound."""
    async with rig(tmp_path, capacity=4) as r, client_of(r) as client:
        await r.plane.ledger.configure_deployment(max_staleness=1)
        await r.publish(1)
        turn: dict[str, Any] = dict(
            model="policy", messages=MESSAGES, max_tokens=2, extra_headers={"x-session-id": "ep-9"}
        )
        await client.chat.completions.create(**turn)  # bound to version 1
        await r.publish(2)
        await r.publish(3)
        with pytest.raises(openai.ConflictError) as info:
            await client.chat.completions.create(**{**turn, "model": r.names[3]})
        assert info.value.code == "SESSION_TOO_STALE", info.value.message
        released = [
            e.cause
            for e in await events(r.plane.ledger)
            if isinstance(e, SessionReleased) and e.session == "ep-9"
        ]
        assert released == ["too_stale"]


async def test_a_face_that_reaches_no_engine_refuses_before_anything_is_bound(
    tmp_path: Path,
) -> None:
    """A face with no OpenAI route to any engine (a fleet of engines without an OpenAI
    endpoint it can reach) can serve no turn: a first turn is refused ``503
    ENGINE_NOT_HTTP`` (not retryable) and binds nothing. Before, it bound the session, then
    answered ``503 NO_ROUTE`` "unreachable" to that turn and every later one, so the session
    held its version from reclaim for nothing."""
    async with rig(tmp_path, engines=1) as r, client_of(r) as client:
        await r.publish(1)
        before = await session_events(r)
        r.face.engines.clear()  # as for a face whose fleet has only in-process engines
        for session in ("episode-1", None):
            with pytest.raises(openai.APIStatusError) as refused:
                await client.chat.completions.create(
                    model="policy",
                    messages=MESSAGES,
                    max_tokens=2,
                    extra_headers={"x-session-id": session} if session else None,
                )
            assert (refused.value.status_code, refused.value.code) == (503, "ENGINE_NOT_HTTP")
            assert refused.value.response.headers["x-should-retry"] == "false"
            assert "nothing was bound" in refused.value.message
        assert await session_events(r) == before
        assert r.gateway.dispatched == 0


async def test_a_release_answers_the_ledgers_outcome_or_its_refusal_in_openais_shape(
    tmp_path: Path,
) -> None:
    async with rig(tmp_path) as r, httpx.AsyncClient(base_url=r.url, trust_env=False) as http:
        await r.publish(1)
        await r.worker.session("ep-9").bind()
        released = await http.post("/v1/sessions/ep-9/release", headers=AUTH)
        assert released.status_code == 200
        assert released.headers["content-type"] == "application/json"
        assert released.json()["session"] == "ep-9" and released.json()["released"] is True
        refused = await http.post("/v1/sessions/%01/release", headers=AUTH)  # not printable
        assert refused.status_code == 400, refused.text
        error = openai_error(refused)
        assert error["code"] == "INVALID_INPUT" and "printable" in error["message"], error
