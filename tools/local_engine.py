"""``loraledger engine``: the bundled local engine as an HTTP server on loopback.

Why a command for it: trying loraledger needs engines, and a GPU SGLang or vLLM server is not
something a newcomer has at hand. The local engine (a tiny causal LM built locally, never
downloaded, with peft adapters) speaks SGLang 0.5.x's HTTP protocol plus loraledger's staged
transfer endpoints, so a control plane drives it exactly as it would drive SGLang:

* ``SGLangEngine(url, "e0")`` (or ``serve --engine e0=sglang:URL``): adapters are loaded by
  path from the artifact store, as on a real SGLang server;
* ``LocalHTTPEngine(url, "e0")`` (``serve --engine e0=local:URL``): adapters are streamed in
  buckets and verified on the engine.

The server itself is :func:`engines.local.server.serve` (the one the tests use); this module
only adds what a command needs: options checked before the model loads, one "listening" line
on stdout once it answers, and a clean stop on SIGINT/SIGTERM (exit 0) after a drain: new
requests are refused ``503 ENGINE_DRAINING`` (the gateway sends them to another holder), the
ones already running finish, at most ``--drain-timeout`` seconds (:mod:`engines.drain`).
It listens on 127.0.0.1 only. Without a token (``LORALEDGER_ENGINE_TOKEN`` or
``--token-file``) its control endpoints (load, unload, staged transfer, pause, abort) answer
any local process; with one, only callers presenting it (``serve`` sends it to every engine),
and a managed adapter is unloaded only under its attempt's fence whatever the token.
"""

from __future__ import annotations

import contextlib
import signal
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import msgspec

from engines.drain import DEFAULT_DRAIN_TIMEOUT_S, Drain
from tools.exitcodes import Exit, ToolError
from tools.logconfig import get_logger

log = get_logger("loraledger.engine")

HOST = "127.0.0.1"
DEFAULT_PORT = 30000  # SGLang's own default


class EngineOptions(msgspec.Struct, frozen=True, kw_only=True):
    engine_id: str = "e0"
    port: int = DEFAULT_PORT
    artifact_root: str | None = None
    threads: int = 1
    token: str | None = None  # guards the control routes (load, unload, staged, pause, abort)
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S  # on SIGTERM: requests running may finish


def check_options(opts: EngineOptions) -> None:
    if not 0 <= opts.port <= 65535:
        raise ToolError(Exit.USAGE, f"--port {opts.port} is not a TCP port")
    if opts.threads < 1:
        raise ToolError(Exit.USAGE, "--threads must be >= 1")
    if not (0 <= opts.drain_timeout_s < float("inf")):
        raise ToolError(Exit.USAGE, "--drain-timeout must be a number of seconds >= 0")
    if opts.artifact_root is not None and not Path(opts.artifact_root).is_dir():
        raise ToolError(Exit.USAGE, f"--artifacts {opts.artifact_root} is not a directory")


async def run_engine(
    opts: EngineOptions,
    *,
    on_ready: Callable[[str], None] | None = None,
    stop: anyio.Event | None = None,
) -> None:
    """Serve one local engine until SIGINT/SIGTERM (or ``stop``); ``on_ready(url)`` once it
    listens."""
    check_options(opts)
    _check_port(opts.port)  # before the model loads: a taken port fails in a moment
    try:
        from engines.local.engine import LocalEngine
        from engines.local.server import serve
    except ImportError as exc:
        raise ToolError(
            Exit.ENGINE_UNAVAILABLE,
            f"the local engine needs the engine extra (pip install 'loraledger[engine]'): {exc}",
        ) from None
    engine = LocalEngine(opts.engine_id, artifact_root=opts.artifact_root, threads=opts.threads)
    drain = Drain(opts.engine_id)
    async with engine:
        try:
            async with serve(
                engine, host=HOST, port=opts.port, token=opts.token, drain=drain
            ) as url:
                log.info("engine.listening", engine=opts.engine_id, url=url)
                with _stop_signals(stop) as signals:
                    # Listening for SIGTERM before saying "ready": a signal sent as soon as
                    # the caller read that line drains, it does not kill the process.
                    if on_ready is not None:
                        on_ready(url)
                    await _until_stopped(stop, signals)
                drain.begin()
                log.info("engine.draining", engine=opts.engine_id, in_flight=drain.in_flight)
                left = await drain.wait(opts.drain_timeout_s)
                if left:
                    log.warning(
                        "engine.drain_timed_out",
                        engine=opts.engine_id,
                        after_s=opts.drain_timeout_s,
                        cut=left,
                    )
        except OSError as exc:  # the port: nothing else in this block touches the OS
            raise ToolError(
                Exit.FAILED, f"cannot listen on {HOST}:{opts.port}: {exc.strerror or exc}"
            ) from None
    log.info("engine.stopped", engine=opts.engine_id)


def _check_port(port: int) -> None:
    if port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((HOST, port))
        except OSError as exc:
            raise ToolError(
                Exit.FAILED, f"cannot listen on {HOST}:{port}: {exc.strerror or exc}"
            ) from None


def _stop_signals(
    stop: anyio.Event | None,
) -> contextlib.AbstractContextManager[AsyncIterator[int] | None]:
    """SIGINT and SIGTERM, received from now on; none when the caller stops it (``stop``)."""
    if stop is not None:
        return contextlib.nullcontext()
    return anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM)


async def _until_stopped(stop: anyio.Event | None, signals: AsyncIterator[int] | None) -> None:
    if stop is not None:
        await stop.wait()
        return
    assert signals is not None
    async for _ in signals:
        return
