"""Real ``loraledger`` processes whose every output is kept in files, and the grep that proves
no secret reached any of them.

Every process a security test starts writes its stdout and stderr to files in one folder (the
run); :func:`assert_no_secret_in` reads every file of that folder back and fails naming the
file and the secret found. A test ends with it, so what it checks is everything the real
processes printed, not what one assertion happened to look at."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote, quote_plus

from tests.tools.conftest import console_script, script_env


def assert_no_secret_in(run: Path, secrets: Sequence[str], *, every_file: bool = False) -> None:
    """No file of ``run`` (the outputs of its processes; with ``every_file``, every file under
    it: logs, JSON, databases) holds any of ``secrets``, as written or in a form that would
    still give it away (:func:`giveaways`: percent-encoded, base64)."""
    files = sorted(
        p for p in run.rglob("*") if p.is_file() and (every_file or p.suffix in (".out", ".err"))
    )
    assert files, f"no outputs in {run}"
    found = [
        f"{p.relative_to(run)} holds {secret[:3]}… as {form}"
        for p in files
        for secret in secrets
        for form, text in giveaways(secret).items()
        if text.encode() in p.read_bytes()
    ]
    assert not found, found


def giveaways(secret: str) -> dict[str, str]:
    """The texts that give ``secret`` away: itself, percent-encoded (a URL, a query string)
    and base64 (a Basic ``Authorization`` header, a JSON bytes field). Base64 of a secret
    inside a longer text depends on where it falls in a 3-byte group, so each of the three
    alignments is kept, trimmed to the characters that come from the secret alone."""
    forms = {"text": secret, "percent": quote(secret, safe=""), "form": quote_plus(secret)}
    raw = secret.encode()
    for shift in range(3):
        encoded = base64.b64encode(b"\0" * shift + raw).decode()
        start = 4 if shift else 0  # the first group mixes in the padding bytes
        end = (shift + len(raw)) // 3 * 4  # the last, partial group depends on what follows
        forms[f"base64+{shift}"] = encoded[start:end]
    return {form: text for form, text in forms.items() if len(text) >= 8}


def command(
    run: Path, name: str, *args: str, timeout: float = 60.0, **env: str
) -> subprocess.CompletedProcess[str]:
    """``loraledger ARGS`` to completion, its outputs kept as ``run/NAME.out`` and ``.err``."""
    done = subprocess.run(
        [*console_script(), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=run,
        env=_env(env),
    )
    (run / f"{name}.out").write_text(done.stdout)
    (run / f"{name}.err").write_text(done.stderr)
    return done


@contextmanager
def listening(
    run: Path, name: str, *args: str, json_row: bool = True, within: float = 120.0, **env: str
) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, Any] | str]]:
    """``loraledger ARGS`` started in the background, outputs to ``run/NAME.out`` and ``.err``;
    yields the process and its first stdout line (parsed when ``json_row``) once it printed
    one; SIGTERM on exit (SIGKILL if it does not stop), reaped."""
    out, err = run / f"{name}.out", run / f"{name}.err"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        process = subprocess.Popen(
            [*console_script(), *args], cwd=run, stdout=stdout, stderr=stderr, env=_env(env)
        )
    try:
        deadline = time.monotonic() + within
        while not out.read_bytes().endswith(b"\n"):
            assert process.poll() is None, f"{name} exited {process.returncode}: {err.read_text()}"
            assert time.monotonic() < deadline, f"{name} did not listen: {err.read_text()}"
            time.sleep(0.05)
        line = out.read_text().splitlines()[0]
        yield process, (json.loads(line) if json_row else line)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGKILL)
                process.wait(timeout=10)


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = script_env(**extra)
    for name in ("LORALEDGER_TOKEN", "LORALEDGER_ENGINE_TOKEN", "LORALEDGER_AGENT_TOKEN"):
        if name not in extra:
            env.pop(name, None)
    return env
