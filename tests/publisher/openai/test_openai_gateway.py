"""The OpenAI gateway with the official ``openai`` client (sync and async, streaming and not)
against local engines over HTTP on loopback: pinning across turns while versions publish and
retire, the wrong version refused, a disconnect mid-stream, a reset after send, two gateways on
one session, counts that never drift, and stickiness with its prefix-cache payoff."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import httpx
import msgspec
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from engines.local.tinymodel import make_adapter
from evlog.errors import LoraLedgerError
from evlog.events import EngineRestarted, EngineSuspended, SessionReleased
from projections.transitions import VersionState
from publisher.drivers.trainer import TrainerClient
from publisher.gateway import Gateway, LocalView
from publisher.gateway.affinity import rendezvous
from publisher.openai import (
    OpenAIGateway,
    OpenAIOptions,
    engine_routes,
    openai_app,
)
from publisher.sessions import RolloutWorker
from tests.publisher.openai_kit import TOKEN, Rig, rig, serve_app
from tests.publisher.plane_kit import FAST
from tests.publisher.rollout_kit import ENGINE_WARNINGS
from tests.support.log import events
from tests.support.relay import Relay
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.anyio, *ENGINE_WARNINGS]

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "the quick brown fox"}]


def sync_client(r: Rig, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=r.base_url, api_key=TOKEN, **kwargs)


def async_client(r: Rig, **kwargs: Any) -> openai.AsyncOpenAI:
    kwargs.setdefault("api_key", TOKEN)
    return openai.AsyncOpenAI(base_url=r.base_url, **kwargs)


def hdr(s: str | None) -> dict[str, str] | None:
    return {"x-session-id": s} if s else None


async def chat_sync(r: Rig, s: str | None, model: str = "policy") -> tuple[dict[str, str], str]:
    """One non-streaming chat turn with the sync client (in a worker thread)."""

    def call() -> tuple[dict[str, str], str]:
        with sync_client(r) as client:
            raw = client.chat.completions.with_raw_response.create(
                model=model,
                messages=MESSAGES,
                max_tokens=4,
                temperature=0,
                extra_headers=hdr(s),
            )
            reply = raw.parse()
            return dict(raw.headers), reply.choices[0].message.content or ""

    return await anyio.to_thread.run_sync(call)


async def stream_async(
    r: Rig, s: str, *, usage: bool = False, chat: bool = True
) -> tuple[dict[str, str], list[Any]]:
    async with async_client(r) as client:
        if chat:
            maker: Any = client.chat.completions.with_streaming_response.create(
                model="policy",
                messages=MESSAGES,
                max_tokens=4,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True} if usage else None,
                extra_headers=hdr(s),
            )
        else:
            maker = client.completions.with_streaming_response.create(
                model="policy",
                prompt="the quick brown fox",
                max_tokens=4,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True} if usage else None,
                extra_headers=hdr(s),
            )
        async with maker as response:
            chunks = [chunk async for chunk in await response.parse()]
            return dict(response.headers), chunks


async def test_pinned_across_turns_while_versions_publish_and_retire(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        v1 = await r.publish(1)
        headers, _ = await chat_sync(r, "agent-1")
        assert headers["x-loraledger-version"] == "1"
        first_engine = headers["x-loraledger-engine"]
        assert headers["x-request-id"] and headers["x-loraledger-staleness"] == "0"

        await r.publish(2)  # v1 retires; agent-1 stays on it
        headers, chunks = await stream_async(r, "agent-1")
        assert (headers["x-loraledger-version"], headers["x-loraledger-engine"]) == (
            "1",
            first_engine,
        )
        assert headers["x-loraledger-staleness"] == "1"
        assert chunks and all(c.usage is None for c in chunks)  # the usage chunk was stripped
        assert chunks[-1].choices[0].finish_reason == "length"

        newcomer, _ = await chat_sync(r, "agent-2")
        assert newcomer["x-loraledger-version"] == "2"
        await r.publish(3)
        headers, chunks = await stream_async(r, "agent-1", usage=True, chat=False)
        assert headers["x-loraledger-version"] == "1"
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
        no_session, _ = await chat_sync(r, None)  # one-turn: the current default, released
        assert no_session["x-loraledger-version"] == "3"

        # Provenance: one row per request, joinable by request id, with the bound version.
        await wait_for(  # the recorder drains its buffer behind
            "five provenance rows", lambda: len(r.sink.rows) >= 5
        )
        rows = {row.request_id: row for row in r.sink.rows}
        assert rows[headers["x-request-id"]].version_id == 1
        assert rows[headers["x-request-id"]].staleness == 2
        assert rows[no_session["x-request-id"]].session.startswith("openai-gw-once-")
        assert len(r.sink.rows) == 5

        # /v1/models: the alias, then the versions with their state
        async with async_client(r) as client:
            models = {m.id: m for m in (await client.models.list()).data}
        assert models["policy"].model_extra["default_version"] == 3  # type: ignore[index]
        assert models[v1].model_extra["state"] == "RETIRED"  # type: ignore[index]

        # Releasing agent-1 lets reclaim take v1 (nothing in flight, nobody bound).
        async with httpx.AsyncClient(base_url=r.url) as plain:
            reply = await plain.post(
                "/v1/sessions/agent-1/release", headers={"authorization": f"Bearer {TOKEN}"}
            )
        assert reply.status_code == 200 and reply.json()["released"] is True
        await wait_for(
            "v1 reclaimed", lambda: r.plane.ledger.state.versions[1].state is VersionState.RECLAIMED
        )
        assert r.gateway.inflight_counts() == {} and not r.worker.inflight


async def test_an_explicit_version_must_be_the_bound_one(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        v1 = await r.publish(1)
        await chat_sync(r, "pinned")
        v2 = await r.publish(2)
        headers, _ = await chat_sync(r, "pinned", model=v1)  # its own version: accepted
        assert headers["x-loraledger-version"] == "1"
        sent = r.gateway.dispatched

        def wrong_version() -> None:
            with sync_client(r) as client:
                client.chat.completions.create(
                    model=v2, messages=MESSAGES, max_tokens=2, extra_headers=hdr("pinned")
                )

        with pytest.raises(openai.ConflictError) as info:
            await anyio.to_thread.run_sync(wrong_version)  # the sync client, off the loop
        assert info.value.code == "VERSION_NOT_BOUND"
        assert info.value.response.headers["x-should-retry"] == "false"
        assert r.gateway.dispatched == sent  # refused before any engine saw it
        async with async_client(r, api_key="wrong") as client:
            with pytest.raises(openai.AuthenticationError):
                await client.chat.completions.create(model="policy", messages=MESSAGES)


async def test_a_disconnect_mid_stream_aborts_upstream_and_decrements(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        await r.publish(1)
        async with async_client(r) as client:
            stream = await client.chat.completions.create(
                model="policy",
                messages=MESSAGES,
                max_tokens=400,
                temperature=0,
                extra_body={"ignore_eos": True},
                stream=True,
                extra_headers=hdr("quitter"),
            )
            got = 0
            async for _ in stream:
                got += 1
                if got == 3:
                    break
            assert sum(r.gateway.inflight_counts().values()) == 1
            await stream.close()  # the client goes away mid-stream
        await wait_for(
            "the gateway's in-flight counts back to zero",
            lambda: not r.gateway.inflight_counts(),
            timeout=10,
        )
        await wait_for(
            "every engine idle", lambda: all(e.in_flight == 0 for e in r.engines), timeout=10
        )
        assert not r.worker.inflight
        await wait_for(
            "the quitter's provenance row", lambda: any(x.session == "quitter" for x in r.sink.rows)
        )
        row = r.sink.rows[-1]
        assert row.finish_reason == "client_abort" and row.session == "quitter"
        # the engine stopped long before 400 tokens: its adapter lease is back
        assert all(e.refcount(row.lora_name) == 0 for e in r.engines)


async def test_a_reset_after_send_is_ambiguous_and_never_resent(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        relays = {e: Relay(url, "reset") for e, url in r.urls.items()}
        async with relays["e0"].running() as u0, relays["e1"].running() as u1:
            r.face.engines["e0"] = r.face.engines["e0"].__class__(
                engine_id="e0", kind="local", base_url=u0
            )
            r.face.engines["e1"] = r.face.engines["e1"].__class__(
                engine_id="e1", kind="local", base_url=u1
            )
            await r.publish(1)
            # default client: it would retry a 502 unless told not to (x-should-retry)
            with sync_client(r) as client, pytest.raises(openai.APIStatusError) as info:
                await anyio.to_thread.run_sync(
                    lambda: client.chat.completions.create(
                        model="policy",
                        messages=MESSAGES,
                        max_tokens=2,
                        extra_headers=hdr("unlucky"),
                    )
                )  # the sync client runs off the event loop (the servers live on it)
            assert info.value.status_code == 502
            assert info.value.code == "AMBIGUOUS_DISPATCH"
            assert sum(x.delivered for x in relays.values()) == 1  # exactly one dispatch
            assert not r.gateway.inflight_counts()  # down before the 502 was sent
            await wait_for(  # the recorder drains its buffer behind
                "the provenance row of the ambiguous dispatch", lambda: bool(r.sink.rows)
            )
            assert [row.finish_reason for row in r.sink.rows] == ["ambiguous"]


async def test_connection_refused_tries_the_next_holder(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        await r.publish(1)
        with socket_closed() as dead:
            r.face.engines["e0"] = r.face.engines["e0"].__class__(
                engine_id="e0", kind="local", base_url=dead
            )
            s = next(f"s{i}" for i in range(100) if rendezvous(f"s{i}", ["e0", "e1"]) == "e0")
            headers, _ = await chat_sync(r, s)
        assert headers["x-loraledger-engine"] == "e1"  # e0 refused the connection: nothing sent
        assert not r.gateway.inflight_counts()


async def test_a_refusal_for_a_lost_adapter_is_relayed_once_and_moves_routing(
    tmp_path: Path,
) -> None:
    """The default unloaded from e0 behind the ledger's back: the session's next turn is refused
    by e0 (relayed with its code, sent once, never resent), the face reports the refusal, and
    the reconciler reads e0's inventory at once (its full pass is 30 s away): the turn after
    goes to e1."""
    async with rig(tmp_path) as r:
        name = await r.publish(1)
        v1 = r.plane.ledger.state.versions[1]
        s = next(f"s{i}" for i in range(100) if rendezvous(f"s{i}", ["e0", "e1"]) == "e0")
        headers, _ = await chat_sync(r, s)
        assert headers["x-loraledger-engine"] == "e0"
        await r.engine("e0").unload(name, attempt=v1.attempt)
        sent = r.gateway.dispatched
        with pytest.raises(openai.BadRequestError) as refused:
            await chat_sync(r, s)
        assert refused.value.code == "NAME_RECLAIMED"
        assert r.gateway.dispatched == sent + 1  # not tried on e1: a premature reclaim surfaces
        await wait_for("two provenance rows", lambda: len(r.sink.rows) == 2)
        assert (r.sink.rows[-1].engine, r.sink.rows[-1].finish_reason) == ("e0", "refused")
        await wait_for(
            "e0 dropped from the holders of v1",
            lambda: "e0" not in r.plane.ledger.state.holders(name),
            timeout=20.0,  # inside the 30 s to the full pass, whatever the machine's load
        )
        headers, _ = await chat_sync(r, s)
        assert headers["x-loraledger-engine"] == "e1"
        assert not r.gateway.inflight_counts()


IDLE = 3600.0  # the plane's probe interval when only a report may get an engine read


def going_to(engine_id: str, holders: list[str]) -> str:
    """A session id whose first choice (rendezvous) among ``holders`` is ``engine_id``."""
    return next(f"s{i}" for i in range(1000) if rendezvous(f"s{i}", holders) == engine_id)


async def turn(r: Rig, s: str, stream: bool) -> dict[str, str]:
    """One chat turn, streaming or not; the reply's headers."""
    if stream:
        headers, chunks = await stream_async(r, s)
        assert chunks and chunks[-1].choices[0].finish_reason
        return headers
    headers, _ = await chat_sync(r, s)
    return headers


@pytest.mark.parametrize("stream", [False, True])
async def test_a_not_loaded_refusal_is_served_by_the_other_holder(
    tmp_path: Path, stream: bool
) -> None:
    """e0 restarted empty and the ledger does not know yet (its probe is an hour away): e0
    refuses the session's turn ``NOT_LOADED`` before anything ran, so the face serves it on
    e1, the other holder, as the Python gateway does -- once per holder, one provenance row
    (e1's), every count back to 0 -- and reports the refusal: the reconciler reads e0 at once
    and records its restart."""
    async with rig(tmp_path, restartable=True, probe_interval_s=IDLE) as r:
        name = await r.publish(1)
        s = going_to("e0", ["e0", "e1"])
        assert (await turn(r, s, stream))["x-loraledger-engine"] == "e0"
        await r.hosts["e0"].restart()
        assert "e0" in r.plane.ledger.state.holders(name)  # routing has not caught up
        await wait_for("the first turn's provenance row", lambda: len(r.sink.rows) == 1)
        sent = r.gateway.dispatched
        headers = await turn(r, s, stream)
        assert headers["x-loraledger-engine"] == "e1"
        assert headers["x-loraledger-version"] == "1"
        assert r.gateway.dispatched == sent + 2  # e0 once (refused), e1 once (served)
        assert not r.gateway.inflight_counts() and not r.worker.inflight
        await wait_for("two provenance rows", lambda: len(r.sink.rows) == 2)
        row = r.sink.rows[-1]
        assert (row.engine, row.request_id, row.version_id) == ("e1", headers["x-request-id"], 1)
        assert row.finish_reason in ("stop", "length")
        # reported: e0 is read now, not at the next probe, and its new life recorded (then
        # repaired: the plane loads the version again, so the holders are no witness)
        life = r.hosts["e0"].engine.incarnation_id
        await wait_for(
            "e0's new life recorded",
            lambda: r.plane.ledger.state.engines["e0"].incarnation == life,
            timeout=IDLE / 60,  # far inside the hour to the next probe
        )
        restarts = [e for e in await events(r.plane.ledger) if isinstance(e, EngineRestarted)]
        assert [e.engine for e in restarts] == ["e0"]


async def test_an_engine_unreachable_over_http_is_reported_and_probed_at_once(
    tmp_path: Path,
) -> None:
    """e0's HTTP server stops (nothing listens on its port any more) and the ledger does not
    know: its probe is an hour away. The session's turn finds e0 refusing the connection and is
    served by e1 (nothing was sent to e0), and the face reports the failure through the
    gateway's hook: the reconciler probes e0 at once, and that failed probe suspends it
    (``suspend_after_s=0``: at the first failed probe), so routing moves off e0 now, not at the
    next tick."""
    async with rig(tmp_path, probe_interval_s=IDLE, suspend_after_s=0.0) as r:
        name = await r.publish(1)
        s = going_to("e0", ["e0", "e1"])
        assert (await turn(r, s, False))["x-loraledger-engine"] == "e0"
        await r.stop_serving("e0")
        await wait_for("the health loop settled", lambda: r.plane.reconciler.settled)
        assert r.plane.ledger.state.engines["e0"].routable  # nobody has looked yet
        sent = r.gateway.dispatched
        headers = await turn(r, s, False)
        assert headers["x-loraledger-engine"] == "e1"
        assert r.gateway.dispatched == sent + 2  # e0 tried once (refused at connect), e1 served
        await wait_for(
            "e0 suspended",
            lambda: r.plane.ledger.state.engines["e0"].suspended,
            timeout=IDLE / 60,  # far inside the hour to the next probe
        )
        suspended = [e for e in await events(r.plane.ledger) if isinstance(e, EngineSuspended)]
        assert [(e.engine, e.cause) for e in suspended] == [("e0", "unhealthy")]
        assert r.plane.ledger.state.holders(name) == ("e1",)
        assert not r.gateway.inflight_counts() and not r.worker.inflight


@pytest.mark.parametrize("stream", [False, True])
async def test_when_every_holder_refuses_the_last_refusal_is_relayed(
    tmp_path: Path, stream: bool
) -> None:
    """Both holders restarted empty: each is tried once, and the client gets the last one's
    clean refusal (the engine's 400 ``NOT_LOADED``, not retryable), not ``NO_ROUTE`` nor a
    5xx, after its one ``refused`` row is written and every count is back to 0."""
    async with rig(tmp_path, restartable=True, probe_interval_s=IDLE) as r:
        await r.publish(1)
        s = going_to("e0", ["e0", "e1"])
        for host in r.hosts.values():
            await host.restart()
        sent = r.gateway.dispatched
        with pytest.raises(openai.BadRequestError) as refused:
            await turn(r, s, stream)
        assert refused.value.status_code == 400
        assert refused.value.code == "NOT_LOADED"
        assert refused.value.response.headers["x-should-retry"] == "false"
        assert "engine e1 refused" in refused.value.message  # the last holder tried
        assert r.gateway.dispatched == sent + 2
        assert not r.gateway.inflight_counts() and not r.worker.inflight
        await wait_for("the refused turn's provenance row", lambda: bool(r.sink.rows))
        assert [(row.engine, row.finish_reason, row.refusal_code) for row in r.sink.rows] == [
            ("e1", "refused", "NOT_LOADED")
        ]


class socket_closed:
    """A loopback URL where nothing listens (connection refused)."""

    def __enter__(self) -> str:
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        return None


async def test_two_gateways_serve_one_session_on_the_same_version_and_engine(
    tmp_path: Path,
) -> None:
    async with rig(tmp_path, engines=3) as r:
        await r.publish(1)
        other_gateway = Gateway(r.plane.fleet, LocalView(r.plane.ledger), gateway_id="gw-b")
        r.plane.add_inflight_source(other_gateway)
        async with RolloutWorker.open(r.plane.ledger, other_gateway, owner="gw-b") as worker_b:
            face_b = OpenAIGateway(
                worker_b,
                engine_routes(r.plane.fleet),
                OpenAIOptions(token=TOKEN),
            )
            async with serve_app(openai_app(face_b)) as url_b:
                seen = []
                for turn in range(6):
                    base = r.base_url if turn % 2 == 0 else url_b + "/v1"
                    async with openai.AsyncOpenAI(base_url=base, api_key=TOKEN) as client:
                        raw = await client.chat.completions.with_raw_response.create(
                            model="policy",
                            messages=MESSAGES,
                            max_tokens=2,
                            extra_headers=hdr("shared"),
                        )
                    seen.append(
                        (raw.headers["x-loraledger-version"], raw.headers["x-loraledger-engine"])
                    )
                    if turn == 2:
                        await r.publish(2)
                assert len(set(seen)) == 1, seen
            await face_b.aclose()


async def test_counts_never_drift(tmp_path: Path, slow: bool) -> None:
    """Many requests with ~5% client aborts and injected engine errors (refusals and resets
    after send), while versions publish and retire: every count ends at 0 and no request was
    refused for an unloaded adapter."""
    total = 2_000 if slow else 240
    rng = random.Random(13)
    # The engines answer probes on the loop that runs this load: on a loaded machine a probe
    # can miss FAST's 2 s, the engine is recorded unreachable and turns find NO_ROUTE. Probes
    # are not what this test is about: they get all the time a loaded machine needs.
    patient = msgspec.structs.replace(FAST, probe=60.0)
    async with rig(tmp_path, capacity=3, timeouts=patient) as r:
        await r.publish(1)
        relay = Relay(r.urls["e1"], "reset")
        outcomes: Counter[str] = Counter()
        async with relay.running() as reset_url, async_client(r, max_retries=0) as client:
            healthy = r.face.engines["e1"]
            faulty = healthy.__class__(engine_id="e1", kind="local", base_url=reset_url)

            async def one(i: int) -> None:
                # half are one-turn (bound, served, released: their versions get reclaimed
                # while others run), half are turns of a few long sessions
                s = f"load-{i % 8}" if i % 2 else None
                kind = rng.random()
                extra: dict[str, Any] = {}
                if kind < 0.03:
                    extra["frequency_penalty"] = 1.0  # the engine refuses it cleanly
                try:
                    if kind > 0.95:  # a client that aborts mid-stream
                        stream = await client.chat.completions.create(
                            model="policy",
                            messages=MESSAGES,
                            max_tokens=50,
                            stream=True,
                            extra_body={"ignore_eos": True},
                            extra_headers=hdr(s),
                        )
                        async for _ in stream:
                            break
                        await stream.close()
                        outcomes["aborted"] += 1
                        return
                    await client.chat.completions.create(
                        model="policy",
                        messages=MESSAGES,
                        max_tokens=2,
                        extra_body=extra,
                        extra_headers=hdr(s),
                    )
                    outcomes["ok"] += 1
                except openai.APIStatusError as exc:
                    outcomes[str(exc.code)] += 1

            async def publisher() -> None:
                for version in (2, 3, 4, 5):
                    await anyio.sleep(0.5)
                    config, tensors = make_adapter(version)
                    published = await TrainerClient(r.plane).publish(
                        tensors, config=config, step=version
                    )
                    statuses[str(published.status)] += 1

            statuses: Counter[str] = Counter()

            async with anyio.create_task_group() as tg:
                tg.start_soon(publisher)
                limiter = anyio.CapacityLimiter(16)
                for i in range(total):
                    # a reset after send now and then on e1
                    r.face.engines["e1"] = faulty if rng.random() < 0.05 else healthy

                    async def run(i: int = i) -> None:
                        async with limiter:
                            await one(i)

                    tg.start_soon(run)
                    await anyio.lowlevel.checkpoint()
        assert sum(outcomes.values()) == total, outcomes
        assert statuses["PUBLISHED"] >= 2, statuses  # versions changed under the load
        assert outcomes["aborted"] > 0 and outcomes["ok"] > total * 0.7, outcomes
        # injected errors only: never NOT_LOADED / NAME_RECLAIMED (an unload under a request)
        assert set(outcomes) <= {"ok", "aborted", "BAD_REQUEST", "AMBIGUOUS_DISPATCH"}, outcomes
        await wait_for(
            "the gateway's in-flight counts back to zero",
            lambda: not r.gateway.inflight_counts(),
            timeout=20,
        )
        assert not r.worker.inflight
        await wait_for(
            "every engine idle", lambda: all(e.in_flight == 0 for e in r.engines), timeout=20
        )
        for engine in r.engines:
            assert all(engine.refcount(n) == 0 for n in engine.loaded_adapters())


async def test_sticky_sessions_keep_their_engine_and_its_prefix_cache(tmp_path: Path) -> None:
    """Multi-turn sessions on 2 healthy engines: >= 99% of later turns on the first engine,
    and a cached-prefix fraction of later turns >= 0.9x a single-engine run."""

    async def workload(r: Rig) -> tuple[float, float]:
        await r.publish(1)
        same = later = cached = prompt = 0
        async with async_client(r) as client:

            async def conversation(s: str) -> None:
                nonlocal same, later, cached, prompt
                messages: list[ChatCompletionMessageParam] = [
                    {"role": "user", "content": f"task {s}: go"}
                ]
                first = None
                for turn in range(4):
                    raw = await client.chat.completions.with_raw_response.create(
                        model="policy",
                        messages=messages,
                        max_tokens=3,
                        temperature=0,
                        extra_headers=hdr(s),
                    )
                    reply = raw.parse()
                    engine = raw.headers["x-loraledger-engine"]
                    if turn == 0:
                        first = engine
                    else:
                        later += 1
                        same += engine == first
                        assert reply.usage is not None
                        details = reply.usage.prompt_tokens_details
                        cached += (details.cached_tokens or 0) if details else 0
                        prompt += reply.usage.prompt_tokens
                    messages += [
                        {"role": "assistant", "content": reply.choices[0].message.content or ""},
                        {"role": "user", "content": f"step {turn}"},
                    ]

            async with anyio.create_task_group() as tg:
                for i in range(12):
                    tg.start_soon(conversation, f"conv-{i}")
        return same / later, cached / prompt

    async with rig(tmp_path / "two", engines=2) as r:
        stuck, fraction_two = await workload(r)
    async with rig(tmp_path / "one", engines=1) as r:
        _, fraction_one = await workload(r)
    assert stuck >= 0.99
    assert fraction_two >= 0.9 * fraction_one, (fraction_two, fraction_one)
    assert fraction_one > 0.3


async def _released_causes(r: Rig) -> dict[str, str]:
    return {
        rec.event.session: rec.event.cause
        async for rec in r.plane.ledger.store.iterate(after=0)
        if isinstance(rec.event, SessionReleased)
    }


async def test_an_idle_session_is_released_and_a_late_turn_is_refused(tmp_path: Path) -> None:
    """OpenAI clients never release: a session with no turn for ``idle_release_s`` is released
    by the gateway's idle loop (cause ``idle``) so its version can be reclaimed; a session with
    a turn in flight stays bound; a late turn on the released one is a 409 the client does not
    retry. (That a turn inside the idle time keeps a session bound is checked with time as
    data in ``test_idle_release_takes_time_as_data``: against the real clock, a stall as long
    as the idle time would release a session that keeps turning.)"""
    async with rig(tmp_path, idle_release_s=0.4) as r:
        await r.publish(1)
        await chat_sync(r, "quiet")
        await chat_sync(r, "busy")
        async with r.worker.session("busy").turn():  # in flight: never idle, however late
            await wait_for(
                "session quiet released as idle",
                lambda: "quiet" not in r.plane.ledger.state.sessions,
            )
            causes = await _released_causes(r)
            assert causes == {"quiet": "idle"}
            assert "busy" in r.plane.ledger.state.sessions

        before = r.face.requests
        with pytest.raises(openai.ConflictError) as refused:
            await chat_sync(r, "quiet")
        assert r.face.requests == before + 1  # x-should-retry: false, so the client did not
        assert refused.value.response.headers["x-should-retry"] == "false"
        assert refused.value.code == "SESSION_CLOSED"
        assert "idle" in refused.value.message

        # Once "busy" goes quiet too, nothing pins v1: a new version lets reclaim take it.
        await wait_for(
            "session busy released as idle", lambda: "busy" not in r.plane.ledger.state.sessions
        )
        await r.publish(2)
        await wait_for(
            "v1 reclaimed", lambda: r.plane.ledger.state.versions[1].state is VersionState.RECLAIMED
        )
        assert (await _released_causes(r))["busy"] == "idle"


async def test_idle_release_takes_time_as_data(tmp_path: Path) -> None:
    """``release_idle(now)``: nothing before the idle time, never a session with a turn in
    flight, and the idle tombstone is forgotten only after ``idle_tombstone_s`` (until then a
    late turn is refused without asking the ledger)."""
    async with rig(tmp_path) as r:
        await r.publish(1)
        worker = r.worker
        worker.idle_release_s, worker.idle_tombstone_s = 100.0, 1000.0
        await chat_sync(r, "a")
        await chat_sync(r, "b")
        t0 = anyio.current_time()
        assert await worker.release_idle(now=t0 + 99) == 0
        binder = worker.session("b")
        async with binder.turn():  # "b" has a turn in flight: never idle
            assert await worker.release_idle(now=t0 + 101) == 1
        assert set(r.plane.ledger.state.sessions) == {"b"}
        assert await worker.release_idle(now=anyio.current_time() + 101) == 1
        assert not r.plane.ledger.state.sessions
        with pytest.raises(LoraLedgerError) as late:
            await worker.session("a").bind()
        assert late.value.code == "SESSION_CLOSED" and late.value.details["cause"] == "idle"

        assert await worker.release_idle(now=anyio.current_time() + 2000) == 0
        await worker.flush_forgets()  # the tombstones are gone: the ids would bind afresh
        assert not r.plane.ledger.state.tombstones


async def test_requests_without_a_session_never_share_one_under_a_request_id(
    tmp_path: Path,
) -> None:
    """A request without a session id is a one-turn session the gateway names: never after
    the client's ``x-request-id``. The SDK resends the same headers after a retryable
    refusal, and a proxy may stamp one id on many requests; neither may meet the tombstone
    of the first request's released session (``SESSION_CLOSED``)."""
    async with rig(tmp_path) as r:
        same = {"x-request-id": "stamped-by-a-proxy"}
        async with async_client(r, max_retries=0) as client:
            with pytest.raises(openai.APIStatusError) as early:
                await client.chat.completions.create(
                    model="policy", messages=MESSAGES, max_tokens=2, extra_headers=same
                )
            assert early.value.response.headers["x-should-retry"] == "true"
            await r.publish(1)
            for _ in range(2):  # the SDK's retry, then the proxy's next request
                raw = await client.chat.completions.with_raw_response.create(
                    model="policy", messages=MESSAGES, max_tokens=2, extra_headers=same
                )
                assert raw.headers["x-request-id"] == "stamped-by-a-proxy"
                assert raw.headers["x-loraledger-version"] == "1"


async def test_one_request_id_on_two_running_requests_is_a_label_not_a_key(
    tmp_path: Path,
) -> None:
    """A trace id in a framework's default headers (or a proxy's stamp) lands on concurrent
    requests. Engines key running requests by id (the local engine and vLLM refuse a
    duplicate; SGLang aborts by prefix), so the engine sees a unique id; the client's id is
    echoed and keys both provenance rows, each naming the id its engine saw."""
    async with rig(tmp_path, engines=1) as r:
        await r.publish(1)
        trace = {"x-request-id": "trace-42"}
        async with async_client(r, max_retries=0) as client:
            maker = client.chat.completions.with_streaming_response.create(
                model="policy",
                messages=MESSAGES,
                max_tokens=64,
                stream=True,
                extra_headers={**trace, "x-session-id": "episode-a"},
            )
            async with maker as first:
                chunks = (await first.parse()).__aiter__()
                await chunks.__anext__()  # the first request is running on the engine
                second = await client.chat.completions.with_raw_response.create(
                    model="policy",
                    messages=MESSAGES,
                    max_tokens=2,
                    extra_headers={**trace, "x-session-id": "episode-b"},
                )
                assert second.headers["x-request-id"] == "trace-42"
                async for _ in chunks:
                    pass
                assert first.headers["x-request-id"] == "trace-42"
        await wait_for("both sessions' provenance rows", lambda: len(r.sink.rows) == 2)
        rows = {row.session: row for row in r.sink.rows}
        assert {row.request_id for row in rows.values()} == {"trace-42"}
        seen = {row.engine_request_id for row in rows.values()}
        assert len(seen) == 2 and all(s and s.startswith("trace-42-") for s in seen), seen
        assert {row.finish_reason for row in rows.values()} <= {"stop", "length"}


async def test_an_engines_clean_refusal_is_recorded_as_refused_with_its_code(
    tmp_path: Path,
) -> None:
    """A prompt the engine refuses before generating (here: more tokens than its context) is
    a refusal, not an engine failure: its provenance row says ``refused`` with the engine's
    code, the one the client got, and no tokens. Before, the row said ``engine_error``, the
    outcome of an engine that failed mid-generation, and dropped the engine's code."""
    async with rig(tmp_path, engines=1) as r:
        await r.publish(1)
        for stream in (False, True):
            rows = len(r.sink.rows)
            async with async_client(r, max_retries=0) as client:
                with pytest.raises(openai.BadRequestError) as refused:
                    await client.chat.completions.create(
                        model="policy",
                        messages=MESSAGES,
                        max_tokens=10**9,
                        stream=stream,
                        extra_headers={"x-session-id": f"too-long-{stream}"},
                    )
            await wait_for("the refusal's row", lambda: len(r.sink.rows) > rows)  # noqa: B023
            row = r.sink.rows[-1]
            assert (row.finish_reason, row.refusal_code) == ("refused", refused.value.code)
            assert refused.value.code and refused.value.code != "GENERATION_FAILED"
            assert (row.prompt_tokens, row.completion_tokens) == (0, 0)


async def test_an_error_reply_names_the_request_id_its_provenance_row_is_under(
    tmp_path: Path,
) -> None:
    async with rig(tmp_path, engines=1) as r:
        await r.publish(1)
        async with async_client(r, max_retries=0) as client:
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(
                    model="policy",
                    messages=MESSAGES,
                    max_tokens=10**9,  # the engine refuses it: over its context
                    extra_headers={"x-session-id": "ep-1"},
                )
        rid = refused.value.response.headers["x-request-id"]
        await wait_for("the refused request's provenance row", lambda: len(r.sink.rows) == 1)
        [row] = r.sink.rows
        assert (row.request_id, row.finish_reason) == (rid, "refused")
        assert row.engine_request_id is None  # the gateway made the id: the engine saw it
