"""``loraledger check-engine`` against live engines that run here.

* The installed command against a local engine *process* over HTTP, on both of its faces: the
  SGLang face (``--kind sglang``: path loads, stock SGLang's implicit reload reproduced, so the
  hazard is reported but is not a failure; path and tensor-route loads compared) and the
  staged face (``--kind local``: staged and path loads compared token for token). Both pass,
  and the engine holds nothing afterwards.
* The checks against deliberately misbehaving engines (the fault wrapper around a real local
  engine served over HTTP): an unload that answers without acting, and a restart in the middle
  of the incarnation probe. Each makes a property the ledger needs fail, the report says which,
  and the engine is still left as found.
* An engine that does not answer: one line on stderr and exit 12, no table.

Every server binds 127.0.0.1 on a port the OS picks and is stopped by its PID.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from engines.artifacts import ArtifactStore
from engines.local.admission import ServingLimits
from engines.local.server import running_server
from engines.local.tinymodel import ModelShapes, ensure_tiny_model
from engines.sglang import SGLangEngine
from engines.testing import RestartableEngine
from tests.engines.faulty_engine import FaultyEngine, Restart, Swallow
from tests.support.paths import REPO
from tests.tools.conftest import run_script, script_env
from tools.check_engine import Report, Target, render, run_checks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # peft's active-adapter notes

NEEDED = {
    "incarnation",
    "load_and_list",
    "digest_confirmed",
    "adapter_applied",
    "same_name_reload",
    "unload_in_flight",
    "refused_after_unload",
    "prefix_cache",
    "left_as_found",
}


@pytest.fixture(scope="module")
def engine_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A local engine process (``python -m engines.local.server``) and its artifact root."""
    root = tmp_path_factory.mktemp("check-artifacts")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engines.local.server",
            "--port",
            "0",
            "--engine-id",
            "checked",
            "--artifact-root",
            str(root),
            "--max-lora-rank",
            "32",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
        env=script_env(),
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline().strip())
        yield f"http://127.0.0.1:{port}", root
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _check(url: str, root: Path, kind: str) -> tuple[int, dict[str, object]]:
    result = run_script(
        "check-engine", url, "--kind", kind, "--artifacts", root, "--json", timeout=300
    )
    assert result.stdout, result.stderr
    data = json.loads(result.stdout)
    assert data["row"] == "check"  # every --json row names its kind
    return result.returncode, data


def _by_check(data: dict[str, object]) -> dict[str, dict[str, object]]:
    findings = data["findings"]
    assert isinstance(findings, list)
    return {f["check"]: f for f in findings}


def _adapters(url: str) -> list[str]:
    cards = httpx.get(f"{url}/v1/models", timeout=10, trust_env=False).json()["data"]
    return [c["id"] for c in cards if c.get("parent") is not None]


def test_the_sglang_face_passes_and_shows_its_implicit_reload_hazard(
    engine_process: tuple[str, Path],
) -> None:
    url, root = engine_process
    code, data = _check(url, root, "sglang")
    findings = _by_check(data)
    assert code == 0, findings
    assert data["ok"] is True and "SGLang 0.5.23" in str(data["engine_version"])
    assert {name for name, f in findings.items() if f["holds"] is True} >= NEEDED
    assert findings["unload_drains"]["holds"] is True
    # stock SGLang's hazard, reproduced by the face: reported, not needed
    assert findings["no_implicit_reload"] == {
        "check": "no_implicit_reload",
        "holds": False,
        "required": False,
        "detail": findings["no_implicit_reload"]["detail"],
    }
    assert findings["tensor_vs_path"]["holds"] is True  # the face has SGLang's tensor route
    assert "artifact vs staged" in str(findings["tensor_vs_path"]["detail"])
    assert _adapters(url) == []
    assert os.listdir(root) == []  # the throwaway directories are deleted too


def test_the_staged_face_passes_and_matches_path_loads(engine_process: tuple[str, Path]) -> None:
    url, root = engine_process
    code, data = _check(url, root, "local")
    findings = _by_check(data)
    assert code == 0, findings
    assert NEEDED | {"tensor_vs_path", "no_implicit_reload"} <= {
        name for name, f in findings.items() if f["holds"] is True
    }
    assert "staged vs artifact" in str(findings["tensor_vs_path"]["detail"])
    assert _adapters(url) == []


def test_the_table_names_every_check(engine_process: tuple[str, Path]) -> None:
    url, root = engine_process
    result = run_script("check-engine", url, "--kind", "sglang", "--artifacts", root, timeout=300)
    assert result.returncode == 0, result.stderr
    for name in (*NEEDED, "unload_drains", "no_implicit_reload", "tensor_vs_path"):
        assert name in result.stdout
    assert "HAZARD" in result.stdout and "every property the ledger needs holds" in result.stdout


def test_a_failing_restart_command_fails_the_check(engine_process: tuple[str, Path]) -> None:
    url, root = engine_process
    result = run_script(
        "check-engine",
        url,
        "--kind",
        "local",
        "--artifacts",
        root,
        "--restart-command",
        "echo no restart here >&2; exit 3",
        "--json",
        timeout=300,
    )
    findings = _by_check(json.loads(result.stdout))
    assert result.returncode == 1
    assert findings["run"]["holds"] is False
    assert "exit 3" in str(findings["run"]["detail"]) and "no restart here" in str(
        findings["run"]["detail"]
    )
    assert findings["left_as_found"]["holds"] is True and _adapters(url) == []


def test_an_unreachable_engine_is_one_line_and_exit_12(tmp_path: Path) -> None:
    result = run_script("check-engine", "http://127.0.0.1:9", "--kind", "sglang")
    assert result.returncode == 12
    assert result.stdout == ""
    assert result.stderr.startswith("error") and len(result.stderr.strip().splitlines()) == 1


def test_a_bad_kind_is_a_usage_error() -> None:
    result = run_script("check-engine", "http://127.0.0.1:9", "--kind", "tgi")
    assert result.returncode == 2 and "tgi" in result.stderr


# --- misbehaving engines (in process: the fault wrapper around a real served engine) --------


def _target(engine: FaultyEngine, root: Path) -> Target:
    config = json.loads((ensure_tiny_model() / "config.json").read_text())
    return Target(
        engine=engine,
        store=ArtifactStore(root),
        shapes=ModelShapes.from_config(config),
        kind="sglang",
        long_tokens=64,
    )


def _failed(report: Report) -> set[str]:
    return {f.check for f in report.failures}


@pytest.mark.anyio
async def test_an_unload_that_never_acts_fails_loudly(tmp_path: Path) -> None:
    root = tmp_path / "artifacts"
    root.mkdir()
    limits = ServingLimits(max_lora_rank=32)
    async with running_server("bad", limits=limits, artifact_root=root) as (served, url):
        client = SGLangEngine(url, "bad")
        faulty = FaultyEngine(client)
        faulty.inject("unload", Swallow())  # the first unload answers, the engine never acts
        target = _target(faulty, root)

        async def hold() -> None:
            served.pause_generation()

        async def release() -> None:
            served.continue_generation()

        async def admitted() -> bool:
            return served.in_flight >= 1

        target.hold, target.release, target.admitted = hold, release, admitted
        try:
            report = await run_checks(target)
        finally:
            await client.aclose()
        assert not report.ok, report
        assert "refused_after_unload" in _failed(report)
        drains = {f.check: f for f in report.findings}["unload_drains"]
        assert drains.holds is False  # it "answered" while the request still ran
        assert served.loaded_adapters() == {}  # still left as found
        assert {f.check: f for f in report.findings}["left_as_found"].holds is True
    text = _rendered(report)
    assert "NO" in text and "do not hold" in text


@pytest.mark.anyio
async def test_a_restart_between_probes_fails_the_incarnation_check(tmp_path: Path) -> None:
    from engines.local.engine import LocalEngine

    root = tmp_path / "artifacts"
    root.mkdir()

    def fresh() -> LocalEngine:
        return LocalEngine("r0", limits=ServingLimits(max_lora_rank=32), artifact_root=root)

    async with RestartableEngine(fresh) as host:
        faulty = FaultyEngine(host, restart=host.restart)
        faulty.inject("incarnation", Restart(after=True), call=1)
        report = await run_checks(_target(faulty, root))
    assert "incarnation" in _failed(report)
    assert not report.ok


@pytest.mark.anyio
async def test_a_load_answered_but_never_carried_out_fails_as_a_publication_would(
    tmp_path: Path,
) -> None:
    """The check loads through the ledger's engine protocol, so a load the engine answers
    without acting (the second one: the adapter kept running during the unload) is caught by
    the inventory that confirms every load, with the code a publication would fail with
    (READY_UNCONFIRMED), before any request is sent to the missing adapter."""
    from engines.local.engine import LocalEngine
    from publisher.drivers.engine_protocol import READY_UNCONFIRMED

    root = tmp_path / "artifacts"
    root.mkdir()

    def fresh() -> LocalEngine:
        return LocalEngine("sw0", limits=ServingLimits(max_lora_rank=32), artifact_root=root)

    async with RestartableEngine(fresh) as host:
        faulty = FaultyEngine(host)
        faulty.inject("load", Swallow(), call=2)
        report = await run_checks(_target(faulty, root))
        held = (await host.inventory()).names()
    findings = {f.check: f for f in report.findings}
    assert not report.ok and findings["run"].holds is False
    stopped = findings["run"].detail
    assert READY_UNCONFIRMED in stopped and "-b-" in stopped, stopped  # the second adapter's
    assert "unload_in_flight" not in findings  # no request went to the missing adapter
    assert findings["left_as_found"].holds is True and held == frozenset()


def _rendered(report: Report) -> str:
    from rich.console import Console

    console = Console(width=200, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(render(report))
    return console.export_text()


# --- restarts (``--restart-command``; in process: a restartable local engine) ---------------


class StuckIncarnation:
    """A misbehaving engine (test double around a real one): it reports the incarnation of its
    first life forever, so a restart is invisible, as with an engine whose id is not per life."""

    def __init__(self, inner: RestartableEngine) -> None:
        self.inner = inner
        self.first: str | None = None

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def incarnation(self) -> str:
        now = await self.inner.incarnation()
        self.first = self.first or now
        return self.first

    async def inventory(self) -> object:
        inventory = await self.inner.inventory()
        return msgspec.structs.replace(inventory, incarnation=await self.incarnation())


def _restartable(root: Path) -> RestartableEngine:
    from engines.local.engine import LocalEngine

    return RestartableEngine(
        lambda: LocalEngine("rs0", limits=ServingLimits(max_lora_rank=32), artifact_root=root)
    )


@pytest.mark.anyio
async def test_a_restart_changes_the_incarnation_and_forgets_adapters(tmp_path: Path) -> None:
    root = tmp_path / "artifacts"
    root.mkdir()
    async with _restartable(root) as host:
        target = _target(host, root)  # type: ignore[arg-type]
        target.kind, target.restart = "local", host.restart
        report = await run_checks(target)
    findings = {f.check: f for f in report.findings}
    assert report.ok, report.failures
    assert findings["restart_detected"].holds is True
    assert findings["restart_forgets"].holds is True and not findings["restart_forgets"].required


@pytest.mark.anyio
async def test_an_incarnation_that_survives_a_restart_fails_loudly(tmp_path: Path) -> None:
    root = tmp_path / "artifacts"
    root.mkdir()
    async with _restartable(root) as host:
        target = _target(StuckIncarnation(host), root)  # type: ignore[arg-type]
        target.kind, target.restart, target.restart_timeout = "local", host.restart, 2.0
        report = await run_checks(target)
    assert "restart_detected" in _failed(report) and not report.ok


@pytest.mark.anyio
async def test_without_a_hold_an_unload_answered_late_is_inconclusive(tmp_path: Path) -> None:
    """An engine that cannot hold requests (vLLM) was reported draining whenever its request
    ended before the unload's answer came back, which a slow unload on a loaded CPU does too:
    a CI run had the check claim vLLM drains. Without a hold, that order proves nothing."""
    root = tmp_path / "artifacts"
    root.mkdir()
    limits = ServingLimits(max_lora_rank=32)
    async with running_server("nohold", limits=limits, artifact_root=root) as (served, url):
        client = SGLangEngine(url, "nohold")
        target = _target(FaultyEngine(client), root)

        async def admitted() -> bool:
            return served.in_flight >= 1

        target.admitted = admitted  # it can say a request runs, not hold it
        try:
            report = await run_checks(target)
        finally:
            await client.aclose()
    findings = {f.check: f for f in report.findings}
    assert report.ok, report.failures
    assert findings["unload_in_flight"].holds is True  # the unload overlapped the request
    drains = findings["unload_drains"]
    assert drains.holds is None and "inconclusive" in drains.detail, drains
