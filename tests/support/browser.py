"""A real headless Chromium driven over the Chrome DevTools Protocol, with no dependency.

Chromium's ``--remote-debugging-pipe`` speaks CDP over two inherited file descriptors (it reads
commands from fd 3 and writes replies and events to fd 4, each message JSON ended by a NUL
byte), so no websocket client is needed. One browser process per :func:`browser` context,
stopped by its PID on exit. The binary is Debian's ``chromium`` (``./test.sh`` installs it):
without it the test fails under ``CI=true`` and skips elsewhere, as for PostgreSQL.

The calls block on the pipe, so they run in a worker thread (``anyio.to_thread``): the event
loop, which may be running the ``serve`` under test, keeps going meanwhile.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

CALL_TIMEOUT_S = 30.0


def chromium_binary() -> str:
    """The browser's path; fails under ``CI=true`` when it is missing, else skips."""
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    why = "no chromium here: install Debian's chromium package (./test.sh does)"
    if os.environ.get("CI"):
        pytest.fail(f"chromium is required in CI: {why}")
    pytest.skip(why)


class Page:
    """One tab of the browser: navigate, evaluate JavaScript, take a screenshot."""

    def __init__(self, write_fd: int, read_fd: int) -> None:
        self._write_fd, self._read_fd = write_fd, read_fd
        self._next_id = 0
        self._buffer = b""
        self._session: str | None = None

    def _call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Send one command and read until its reply (events in between are dropped)."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if self._session is not None:
            message["sessionId"] = self._session
        os.write(self._write_fd, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while True:
            while b"\0" in self._buffer:
                raw, _, self._buffer = self._buffer.partition(b"\0")
                reply = json.loads(raw)
                if reply.get("id") == self._next_id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    result: dict[str, Any] = reply.get("result", {})
                    return result
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"chromium did not answer {method} in {CALL_TIMEOUT_S} s")
            ready, _, _ = select.select([self._read_fd], [], [], left)
            if ready:
                chunk = os.read(self._read_fd, 1 << 20)
                if not chunk:
                    raise RuntimeError("chromium closed its DevTools pipe")
                self._buffer += chunk

    def _attach(self) -> None:
        targets = self._call("Target.getTargets")["targetInfos"]
        page = next((t for t in targets if t["type"] == "page"), None)
        target = page["targetId"] if page else self._call("Target.createTarget", {"url": ""})
        if not isinstance(target, str):
            target = target["targetId"]
        attached = self._call("Target.attachToTarget", {"targetId": target, "flatten": True})
        self._session = attached["sessionId"]
        self._call("Emulation.setDeviceMetricsOverride", _VIEWPORT)

    async def navigate(self, url: str) -> None:
        await anyio.to_thread.run_sync(self._call, "Page.navigate", {"url": url})

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-serializable)."""
        reply = await anyio.to_thread.run_sync(
            self._call,
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        if "exceptionDetails" in reply:
            raise RuntimeError(f"{expression}: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    async def screenshot(self) -> bytes:
        """The page as a PNG."""
        reply = await anyio.to_thread.run_sync(
            self._call, "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}
        )
        return base64.b64decode(reply["data"])


_VIEWPORT = {"width": 1280, "height": 860, "deviceScaleFactor": 1, "mobile": False}


def _launch(profile: Path) -> tuple[subprocess.Popen[bytes], Page, Path]:
    """Start Chromium with its DevTools pipe; the process, the page end, and its log file."""
    binary = chromium_binary()
    to_browser_r, to_browser_w = os.pipe()
    from_browser_r, from_browser_w = os.pipe()
    # bash places the pipes at the fds Chromium expects (dash cannot name fds above 9), then
    # becomes Chromium (same PID)
    command = (
        f'exec "$0" "$@" 3<&{to_browser_r} 4>&{from_browser_w} '
        f"{to_browser_r}<&- {from_browser_w}>&-"
    )
    args = [
        "--headless=new",
        "--no-sandbox",  # tests run as root in containers; the page under test is our own
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-extensions",
        "--remote-debugging-pipe",
        f"--user-data-dir={profile}",
        "about:blank",
    ]
    profile.mkdir(parents=True, exist_ok=True)
    log = profile / "chromium.log"  # named in a failure: why the browser went away
    with open(log, "wb") as out:
        process = subprocess.Popen(
            ["bash", "-c", command, binary, *args],
            pass_fds=(to_browser_r, from_browser_w),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    os.close(to_browser_r)
    os.close(from_browser_w)
    return process, Page(to_browser_w, from_browser_r), log


@asynccontextmanager
async def browser(profile: Path) -> AsyncIterator[Page]:
    """A headless Chromium (its profile in ``profile``) and its first tab; killed by PID."""
    process, page, log = await anyio.to_thread.run_sync(_launch, profile)
    try:
        try:
            await anyio.to_thread.run_sync(page._attach)
        except (OSError, RuntimeError) as exc:
            why = await anyio.Path(log).read_text()
            raise RuntimeError(f"chromium did not start: {exc}; {log}:\n{why}") from exc
        yield page
    finally:
        os.close(page._write_fd)
        os.close(page._read_fd)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # its group: the renderer processes too
        await anyio.to_thread.run_sync(process.wait)
