"""``loraledger agent``: the engine-host agent as a command, and its fleet-member spec in
``serve`` (``ID=agent:AGENT_URL,KIND:ENGINE_URL``).

The command runs as a process beside a local engine served over HTTP (its SGLang face), prints
one ``listening`` row, publishes through the staged protocol into its own directory, and stops
cleanly on SIGTERM. Every process is stopped by its PID.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

from engines.agent import AgentEngine
from engines.artifacts import ArtifactStore
from engines.local.server import running_server
from engines.sglang import SGLangEngine
from tests.engines.contract import GREEDY, PROMPT, candidate_for, publish
from tests.engines.test_contract_local import LIMITS
from tests.support.paths import REPO
from tests.tools.conftest import console_script, run_script, script_env
from tools.service_options import parse_engine

pytestmark = [pytest.mark.anyio, pytest.mark.filterwarnings("ignore::UserWarning")]


def _start_agent(engine_url: str, host: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            *console_script(),
            "agent",
            "--engine",
            f"sglang:{engine_url}",
            "--artifacts",
            str(host),
            "--id",
            "h0",
            "--port",
            "0",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
        env=script_env(),
    )


async def test_the_agent_command_publishes_into_its_own_directory(tmp_path: Path) -> None:
    host = tmp_path / "host"
    host.mkdir()
    async with running_server("h0", limits=LIMITS, artifact_root=host) as (engine, url):
        proc = _start_agent(url, host)
        try:
            assert proc.stdout is not None
            row = json.loads(proc.stdout.readline())
            assert row["row"] == "listening" and row["engine"] == "h0"
            member = AgentEngine(row["url"], SGLangEngine(url, "h0"))
            try:
                p = candidate_for(ArtifactStore(tmp_path / "trainer"), 21)
                await publish(member, p)
                assert engine.loaded_adapters() == {p.name: str(host / p.candidate.digest)}
                out = await member.generate(PROMPT, p.name, GREEDY)
                assert len(out.token_ids) == GREEDY.max_tokens
                assert (await member.unload(p.name, attempt=1)).was_loaded is True
            finally:
                await member.aclose()
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=20) == 0


def test_bad_agent_options_are_usage_errors(tmp_path: Path) -> None:
    result = run_script("agent", "--engine", "tgi:http://x", "--artifacts", tmp_path)
    assert result.returncode == 2 and "sglang:URL or vllm:URL" in result.stderr
    result = run_script("agent", "--engine", "sglang:http://x", "--artifacts", tmp_path / "no")
    assert result.returncode == 2 and "not a directory" in result.stderr


def test_serve_takes_an_agent_member() -> None:
    spec = parse_engine("e0=agent:http://127.0.0.1:30100,sglang:http://127.0.0.1:30000")
    assert (spec.kind, spec.url) == (
        "agent",
        "http://127.0.0.1:30100,sglang:http://127.0.0.1:30000",
    )
    assert parse_engine("e1=sglang-tensors:http://127.0.0.1:30000").kind == "sglang-tensors"
