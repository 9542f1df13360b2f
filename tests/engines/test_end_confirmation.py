"""How the SGLang and vLLM adapters confirm a request's end (``abort_request``), over real HTTP.

The gateway ends a request's in-flight count only when the engine confirms the request is over
(docs/engines.md, "When a request has ended"); what each adapter reads as that confirmation is
pinned here, against :class:`RecordedEngineDouble`: a test double (no GPU engine runs here)
that is a real HTTP server on loopback, answering with the shapes the real servers send.

* SGLang: ``POST /abort_request {"rid"}`` answers 200 with an empty body (docs/engines.md's
  reference table), for a running request and for an id it does not know alike; the adapter
  sends the request's id and takes the 200 as the end. Anything else proves nothing.
* vLLM has no abort-by-id route outside its dev mode (it aborts a request when its client's
  connection closes). Its ``/metrics`` carries the ``vllm:lora_requests_info`` gauge: one
  series per label set ever reported (``max_lora``, ``waiting_lora_adapters``,
  ``running_lora_adapters``, comma-joined names), each set to the time it was last reported,
  so the series with the newest value is the scheduler's current state and older ones stay
  listed. The adapter confirms only when that newest series names the adapter neither
  running nor waiting.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from engines.contract import AmbiguousReply, ErrorCode
from engines.sglang import SGLangEngine
from engines.vllm import VLLMEngine

pytestmark = pytest.mark.anyio

LORA = "agent@dep-1-0123456789abcdef"
OTHER = "agent@dep-2-fedcba9876543210"
START_TIME = "1.79602781588e+09"


class RecordedEngineDouble:
    """A test double of an engine's HTTP server, on 127.0.0.1 (a port the OS picks): it answers
    ``GET /metrics`` with :attr:`metrics` (after vLLM's ``process_start_time_seconds``;
    status :attr:`metrics_status`) and
    ``POST /abort_request`` with :attr:`abort_status` and an empty body, as SGLang does, and
    records each request as (method, path, JSON body)."""

    def __init__(self) -> None:
        self.metrics = ""
        self.metrics_status = 200
        self.abort_status = 200
        self.requests: list[tuple[str, str, Any]] = []
        double = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                double.requests.append(("GET", self.path, None))
                if self.path != "/metrics":
                    self._answer(404, b'{"detail":"Not Found"}')
                    return
                text = f"process_start_time_seconds {START_TIME}\n{double.metrics}"
                kind = "text/plain; version=0.0.4; charset=utf-8"
                self._answer(double.metrics_status, text.encode(), kind)

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                double.requests.append(("POST", self.path, body))
                if self.path != "/abort_request":
                    self._answer(404, b'{"detail":"Not Found"}')
                    return
                self._answer(double.abort_status, b"")

            def _answer(self, status: int, body: bytes, kind: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="engine-double")
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)


def lora_info(*series: tuple[str, str, float]) -> str:
    """vLLM's ``vllm:lora_requests_info`` as ``/metrics`` renders it: one line per
    (running, waiting, time last reported) label set, labels in vLLM's order."""
    lines = [
        "# HELP vllm:lora_requests_info Running stats on lora requests.",
        "# TYPE vllm:lora_requests_info gauge",
    ]
    for running, waiting, at in series:
        lines.append(
            f'vllm:lora_requests_info{{max_lora="2",waiting_lora_adapters="{waiting}",'
            f'running_lora_adapters="{running}"}} {at:.9e}'
        )
    return "\n".join(lines) + "\n"


@pytest.fixture
def double() -> Iterator[RecordedEngineDouble]:
    server = RecordedEngineDouble()
    try:
        yield server
    finally:
        server.stop()


# --- SGLang ---------------------------------------------------------------------------------------


async def test_sglang_sends_the_request_id_and_takes_its_200_as_the_end(
    double: RecordedEngineDouble,
) -> None:
    engine = SGLangEngine(double.url, "sg")
    try:
        assert engine.capabilities.confirms_end
        assert await engine.abort_request("gw-1-7", LORA) is True
        # an id SGLang no longer knows (it ended) is answered the same way
        assert await engine.abort_request("gw-1-8", None) is True
    finally:
        await engine.aclose()
    assert double.requests == [
        ("POST", "/abort_request", {"rid": "gw-1-7"}),
        ("POST", "/abort_request", {"rid": "gw-1-8"}),
    ]


@pytest.mark.parametrize("status", [400, 404, 500, 503])
async def test_sglang_confirms_nothing_on_any_other_answer(
    double: RecordedEngineDouble, status: int
) -> None:
    """Not a 200: the abort may not have been queued, so the request may still run; the
    gateway keeps its count held (an engine error it treats as no confirmation)."""
    double.abort_status = status
    engine = SGLangEngine(double.url, "sg")
    try:
        with pytest.raises(AmbiguousReply) as info:
            await engine.abort_request("gw-1-7", LORA)
    finally:
        await engine.aclose()
    assert info.value.status == status
    assert double.requests == [("POST", "/abort_request", {"rid": "gw-1-7"})]


async def test_sglang_unreachable_confirms_nothing(double: RecordedEngineDouble) -> None:
    url = double.url
    double.stop()  # nothing listens there any more
    engine = SGLangEngine(url, "sg")
    try:
        with pytest.raises(AmbiguousReply) as info:
            await engine.abort_request("gw-1-7", LORA)
    finally:
        await engine.aclose()
    assert info.value.code == ErrorCode.ENGINE_UNREACHABLE


# --- vLLM -----------------------------------------------------------------------------------------


async def ask_vllm(double: RecordedEngineDouble, lora_name: str | None = LORA) -> bool:
    engine = VLLMEngine(double.url, "v0", max_lora_rank=8)
    try:
        assert engine.capabilities.confirms_end
        return await engine.abort_request("cmpl-gw-1-7", lora_name)
    finally:
        await engine.aclose()


async def test_vllm_confirms_once_the_newest_series_no_longer_names_the_adapter(
    double: RecordedEngineDouble,
) -> None:
    """A request on LORA runs, then its client's connection closes and vLLM's next step no
    longer schedules it: a newer series with LORA in neither list is added, and the one that
    named it running stays on ``/metrics`` with its older time."""
    double.metrics = lora_info((LORA, "", 1.7960280e09))
    assert await ask_vllm(double) is False
    double.metrics = lora_info(("", "", 1.7960270e09), (LORA, "", 1.7960280e09))
    assert await ask_vllm(double) is False  # the empty series is the older one
    double.metrics = lora_info((LORA, "", 1.7960280e09), ("", "", 1.7960290e09))
    assert await ask_vllm(double) is True
    assert [r[:2] for r in double.requests] == [("GET", "/metrics")] * 3


@pytest.mark.parametrize(
    ("running", "waiting", "ended"),
    [
        (f"{OTHER},{LORA}", "", False),  # running beside another adapter
        ("", LORA, False),  # queued: it has not started, it may still
        ("", f"{LORA},{OTHER}", False),
        (OTHER, OTHER, True),  # only another adapter's requests
        ("", "", True),
    ],
)
async def test_vllm_reads_both_lists_of_the_newest_series(
    double: RecordedEngineDouble, running: str, waiting: str, ended: bool
) -> None:
    double.metrics = lora_info((LORA, "", 1.7960280e09), (running, waiting, 1.7960290e09))
    assert await ask_vllm(double) is ended


async def test_vllm_without_the_gauge_confirms_nothing(double: RecordedEngineDouble) -> None:
    """A server that exports no ``vllm:lora_requests_info`` (no series reported yet, or a
    build without it) proves nothing; the count stays held until its incarnation ends."""
    double.metrics = "# HELP process_open_fds Number of open file descriptors.\n"
    assert await ask_vllm(double) is False


async def test_vllm_cannot_confirm_a_request_of_the_base_model(
    double: RecordedEngineDouble,
) -> None:
    double.metrics = lora_info(("", "", 1.7960290e09))
    assert await ask_vllm(double, None) is False
    assert double.requests == []  # nothing to read: the gauge names adapters only


async def test_vllm_metrics_that_fail_confirm_nothing(double: RecordedEngineDouble) -> None:
    double.metrics = lora_info(("", "", 1.7960290e09))
    double.metrics_status = 503
    with pytest.raises(AmbiguousReply) as info:
        await ask_vllm(double)
    assert info.value.status == 503
