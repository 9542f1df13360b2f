"""A stream the engine does not finish is never recorded, nor relayed, as a finished sample.

Every OpenAI stream ends with ``data: [DONE]``. vLLM and SGLang, failing mid-generation,
send an error event (``data: {"error": {...}}``) and then ``[DONE]``; the local engine ends
a failed stream without ``[DONE]``. The face used to relay both as they came and record
``finish_reason: "stop"``, so a trainer joining provenance counted a failed rollout as a
completed one, and a client of a cut stream saw a clean end.

The engine that fails here is :class:`ScriptedStreamEngine`, a test double named as such: an
HTTP server on loopback that answers every generation with a fixed SSE script, in the shapes
above. The rest is real: the plane, the in-process ledger and local engines (which hold the
adapter), the OpenAI face on uvicorn and the official ``openai`` client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tests.publisher.openai_kit import TOKEN, rig, serve_app
from tests.publisher.rollout_kit import ENGINE_WARNINGS
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.anyio, *ENGINE_WARNINGS]

_CHUNK = (
    b'data: {"id":"c1","object":"chat.completion.chunk","model":"MODEL","choices":'
    b'[{"index":0,"delta":{"role":"assistant","content":"hel"},"finish_reason":null}]}\n\n'
)
# vLLM's mid-stream failure: an error event in its error shape, then [DONE]
_ERROR = (
    b'data: {"error":{"object":"error","message":"EngineCore encountered an issue",'
    b'"type":"InternalServerError","param":null,"code":500}}\n\n'
)
_DONE = b"data: [DONE]\n\n"
_FINISH = (
    b'data: {"id":"c1","object":"chat.completion.chunk","model":"MODEL","choices":'
    b'[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'
)


class ScriptedStreamEngine:
    """Test double for an engine's OpenAI route that streams ``script`` and ends (``MODEL`` in
    an event is the request's ``model``, echoed as vLLM echoes the adapter's name)."""

    def __init__(self, *script: bytes) -> None:
        self.script = script

    def app(self) -> Starlette:
        async def generate(request: Request) -> Response:
            model = str((await request.json()).get("model", "")).encode()

            async def events() -> AsyncIterator[bytes]:
                for event in self.script:
                    yield event.replace(b"MODEL", model)

            return StreamingResponse(events(), media_type="text/event-stream")

        return Starlette(routes=[Route("/v1/chat/completions", generate, methods=["POST"])])


async def _stream_once(tmp_path: Path, *script: bytes) -> tuple[str, Exception | None, str]:
    """One streamed turn through the face to an engine playing ``script``: the text the
    client read, what it raised, and the row's finish reason."""
    engine = ScriptedStreamEngine(*script)
    async with serve_app(engine.app()) as fake, rig(tmp_path, engines=1, routes={"e0": fake}) as r:
        await r.publish(1)
        client = openai.AsyncOpenAI(base_url=r.base_url, api_key=TOKEN, max_retries=0)
        text = ""
        raised: Exception | None = None
        try:
            stream = await client.chat.completions.create(
                model="policy",
                messages=[{"role": "user", "content": "hi"}],
                stream=True,
                extra_headers={"x-session-id": "rollout-1"},
            )
            async for chunk in stream:
                text += "".join(c.delta.content or "" for c in chunk.choices)
        except openai.APIError as exc:
            raised = exc
        finally:
            await client.close()
        await wait_for("the stream's provenance row", lambda: len(r.sink.rows) == 1)
        (row,) = r.sink.rows
        assert not r.worker.inflight  # the request is over, whatever its end
        return text, raised, row.finish_reason


async def test_an_error_event_mid_stream_is_an_engine_error(tmp_path: Path) -> None:
    """Was: the client raised, yet the row said ``stop``."""
    text, raised, finish = await _stream_once(tmp_path, _CHUNK, _ERROR, _DONE)
    assert text == "hel"
    assert isinstance(raised, openai.APIError), raised
    assert "EngineCore encountered an issue" in str(raised)
    assert finish == "engine_error"


async def test_a_stream_cut_before_done_is_ambiguous_and_the_client_hears_it(
    tmp_path: Path,
) -> None:
    """Was: the client saw a clean end (a partial sample taken for a whole one) and the row
    said ``stop``."""
    text, raised, finish = await _stream_once(tmp_path, _CHUNK)
    assert text == "hel"
    assert isinstance(raised, openai.APIError), raised
    assert "AMBIGUOUS_DISPATCH" in str(raised) or "ended without [DONE]" in str(raised)
    assert finish == "ambiguous"


async def test_a_finished_stream_is_still_recorded_with_its_finish_reason(
    tmp_path: Path,
) -> None:
    """The other side: a whole stream ending in ``[DONE]`` relays cleanly, its reason kept."""
    text, raised, finish = await _stream_once(tmp_path, _CHUNK, _FINISH, _DONE)
    assert (text, raised, finish) == ("hel", None, "length")
