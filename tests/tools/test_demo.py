"""``loraledger demo --quick``, run as a user runs it, and its story checked against the log it
wrote, with the tools a user would use next (verify, replay, audit)."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import anyio
import pytest
from rich.console import Console

from publisher.gateway.provenance import ProvenanceRow, read_rows
from tests.tools.conftest import Cli, run_script
from tools.demo import QUICK, DemoRun, DemoStats
from tools.exitcodes import Exit
from tools.logfile import open_log
from tools.render import story_view
from tools.story import FAILED_OUTCOMES, Story, tell


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict:  # type: ignore[type-arg]
    folder = tmp_path_factory.mktemp("demo") / "run"
    result = run_script("demo", "--quick", "--json", "--dir", folder, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = result.stdout.splitlines()
    out = json.loads(line)
    assert out["row"] == "demo" and Path(out["log"]).parent == folder
    return out  # type: ignore[no-any-return]


def _json_lines(stdout: str) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in stdout.splitlines()]


def test_the_story_matches_the_log(quick_run: dict, cli: Cli) -> None:  # type: ignore[type-arg]
    story, log = quick_run["story"], quick_run["log"]
    cfg = QUICK
    sessions = cfg.workers * cfg.sessions * cfg.waves
    assert story["sessions"] == sessions and story["owners"] == cfg.workers
    assert story["generations"] == sessions * cfg.turns
    assert story["pinned"] is True and story["mismatches"] == 0 and story["sessions_open"] == 0
    # failed requests are exactly the ones the rollout retried (each retry is a new request)
    assert story["failed_requests"] <= sum(quick_run["rollout"]["retried"].values())

    # sticky routing: later turns stay on their session's first engine and find their prefix
    # in its cache; the only ones that move are turns of e1's sessions during its restart
    assert story["later_turns"] == sessions * (cfg.turns - 1)
    assert story["cached_same"] is not None and story["cached_same"] > 0.3
    (restart,) = story["restarts"]
    down = story["started_at"] + restart["at"] - 1.0
    up = story["started_at"] + restart["repaired_at"] + 1.0
    completed: dict[str, list[ProvenanceRow]] = {}
    for row in read_rows(quick_run["provenance"]):
        if row.finish_reason not in FAILED_OUTCOMES:
            completed.setdefault(row.session, []).append(row)
    moved = 0
    for turns in completed.values():
        first, *later = sorted(turns, key=lambda r: r.turn or 0)
        for row in later:
            if row.engine != first.engine:
                moved += 1
                assert first.engine == "e1" and down <= row.started_at <= up, (first, row)
    assert story["later_on_first_engine"] == story["later_turns"] - moved

    # the log is intact and every state along it legal
    assert cli("verify", log, "--deep").returncode == 0

    # versions: every old one reclaimed, the last published one is the default
    end = next(r for r in _json_lines(cli("replay", log, "--json").stdout) if r["row"] == "state")
    final = {v["version_id"]: v["state"] for v in end["versions"]}
    assert final == {v["version_id"]: v["state"] for v in story["versions"]}
    published = [v for v in story["versions"] if v["published_at"] is not None]
    assert len(published) >= cfg.waves + 1
    assert end["default"] == published[-1]["version_id"]
    assert [vid for vid, s in final.items() if s != "RECLAIMED"] == [end["default"]]
    assert end["sessions_bound"] == 0 and end["capacity_used"] == 1

    # each reclaimed version's timeline ends with the reclaim, at the time the story says
    for v in story["versions"]:
        if v["reclaimed_at"] is None:
            continue
        rows = _json_lines(cli("replay", log, "--json", "--version", str(v["version_id"])).stdout)
        timeline = [r for r in rows if r["row"] == "timeline"]
        assert timeline[-1]["event"] == "VersionReclaimed"
        assert timeline[-1]["at"] == pytest.approx(story["started_at"] + v["reclaimed_at"])
        unloaded = {r["detail"].split()[0] for r in timeline if r["event"] == "EngineUnloaded"}
        assert unloaded <= {"e0", "e1"}

    # the restart was repaired: an incident, resolved, with the versions it restored
    (restart,) = story["restarts"]
    assert restart["engine"] == "e1" and restart["repaired_at"] is not None
    incidents = _json_lines(cli("replay", log, "--json", "--incidents").stdout)
    (incident,) = [r for r in incidents if r.get("kind") == "engine_restart"]
    assert incident["resolved"] is True and incident["subject"] == "e1"
    assert incident["duration_s"] == pytest.approx(restart["unroutable_s"])
    e1 = _json_lines(cli("replay", log, "--json", "--engine", "e1").stdout)
    events = [r["event"] for r in e1 if r["row"] == "timeline"]
    assert events.index("EngineRestarted") < events.index(
        "EngineRepaired", events.index("EngineRestarted")
    )
    assert events.count("VersionRestored") == len(restart["restored"]) >= 1

    # the audit of every session agrees: one binding each, every generation on it
    audit = cli("audit", log, "--all", "--provenance", quick_run["provenance"], "--json")
    assert audit.returncode == 0, audit.stdout[-2000:]
    lives = _json_lines(audit.stdout)
    assert len(lives) == sessions
    # every request that reached an engine has its row, the failed ones (retried) included
    assert (
        sum(len(r["generations"]) for r in lives) == story["generations"] + story["failed_requests"]
    )
    # the same rows are in the store beside the log: no file needs naming
    beside = cli("audit", log, "--all", "--json")
    assert beside.returncode == 0 and "note:" not in beside.stderr, beside.stderr
    assert _json_lines(beside.stdout) == lives
    per_version: dict[int, int] = {}
    for r in lives:
        assert r["released_seq"] is not None
        assert {g["version_id"] for g in r["generations"]} == {r["version_id"]}
        per_version[r["version_id"]] = per_version.get(r["version_id"], 0) + 1
    assert {str(k): n for k, n in per_version.items()} == story["sessions_per_version"]


def test_the_suggested_commands_work(quick_run: dict, cli: Cli) -> None:  # type: ignore[type-arg]
    assert quick_run["plot"] and Path(quick_run["plot"]).read_bytes()[:4] == b"\x89PNG"
    commands = quick_run["try"]
    assert any(c.startswith("loraledger audit") for c in commands)
    for command in commands:
        argv = shlex.split(command)
        assert argv[0] == "loraledger"
        result = cli(*argv[1:])
        assert result.returncode == 0, (command, result.stderr)


def test_the_human_story(quick_run: dict) -> None:  # type: ignore[type-arg]
    async def records() -> list:  # type: ignore[type-arg]
        async with open_log(quick_run["log"]) as store:
            return await store.read()

    story = tell(anyio.run(records), read_rows(quick_run["provenance"]))
    assert Story.__struct_fields__ and story.generations == quick_run["story"]["generations"]
    run = DemoRun(
        directory=quick_run["directory"],
        log=quick_run["log"],
        provenance=quick_run["provenance"],
        plot=quick_run["plot"],
        stats=DemoStats(**quick_run["rollout"]),
    )
    console = Console(width=1000, no_color=True)
    with console.capture() as captured:
        console.print(story_view(story, run, fleet="2 local engines"))
    text = captured.get()
    assert "told from the log" in text and f"{story.generations} generations" in text
    assert "Engine e1 restarted" in text and "made it routable again" in text
    assert "0 mismatches" in text and "Reclaim: v1" in text
    assert f"{story.later_on_first_engine} of {story.later_turns} later turns" in text
    assert "served no generation" not in text  # both engines served
    assert set(story.per_engine) == {"e0", "e1"} == set(story.fleet)


def test_refusals(cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "something").write_text("x")
    result = cli("demo", "--quick", "--dir", busy)
    assert result.returncode == Exit.USAGE and "not empty" in result.stderr
    # a file where the folder should be, or on its way: were internal errors
    result = cli("demo", "--quick", "--dir", busy / "something")
    assert result.returncode == Exit.USAGE and "is a file" in result.stderr, result.stderr
    result = cli("demo", "--quick", "--dir", busy / "something" / "run")
    assert result.returncode == Exit.FAILED and "cannot create --dir" in result.stderr
    assert "internal error" not in result.stderr
    monkeypatch.setenv("VLLM_VENV", str(tmp_path / "no-venv"))
    result = cli("demo", "--engine", "vllm", "--dir", tmp_path / "v")
    assert result.returncode == Exit.ENGINE_UNAVAILABLE
    assert "vllm_env.sh" in result.stderr and "Install it with" in result.stderr
    assert cli("demo", "--engine", "tgi").returncode == Exit.USAGE


@pytest.mark.vllm
def test_the_same_story_on_a_real_vllm_server(slow: bool, tmp_path: Path, cli: Cli) -> None:
    """e0 is a real vLLM CPU server (about a minute to start, hence --slow): it must serve its
    share of the generations and the story must hold on it too."""
    if not slow:
        pytest.skip("starts its own vLLM server (~1 min): runs with --slow")
    result = run_script(
        "demo", "--quick", "--json", "--engine", "vllm", "--dir", tmp_path / "run", timeout=600
    )
    if (
        result.returncode == Exit.ENGINE_UNAVAILABLE
        and os.environ.get("LORALEDGER_REQUIRE_VLLM") != "1"
    ):
        pytest.skip(f"real vLLM engine not available here: {result.stderr.strip()[-300:]}")
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    story = out["story"]
    assert story["per_engine"].get("e0", 0) > 0  # vLLM really served
    assert story["pinned"] is True and story["restarts"][0]["repaired_at"] is not None
    assert cli("verify", out["log"]).returncode == 0
