"""``loraledger replay`` on the fault run: state at a seq or time, timelines, incidents, plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from evlog.events import SessionReleased
from tests.support.runs import read_back, write_repeat_run
from tests.tools import tamper
from tests.tools.conftest import Cli
from tools.exitcodes import Exit
from tools.plot import DPI, SIZE_INCHES, STATE_COLOURS


def _rows(stdout: str) -> list[dict[str, Any]]:  # JSON lines
    return [json.loads(line) for line in stdout.splitlines()]


def _state(cli: Cli, log: Path, *args: str) -> dict[str, object]:
    result = cli("replay", log, "--json", *args)
    assert result.returncode == 0, result.stderr
    (state,) = [r for r in _rows(result.stdout) if r["row"] == "state"]
    return state


def _versions(state: dict[str, object]) -> dict[int, str]:
    return {v["version_id"]: v["state"] for v in state["versions"]}  # type: ignore[attr-defined]


def test_state_at_the_end_at_a_seq_and_at_a_time(cli: Cli, fault_log: Path) -> None:
    end = _state(cli, fault_log)
    assert (end["seq"], end["log_last_seq"], end["default"]) == (82, 82, 4)
    assert _versions(end) == {1: "RECLAIMED", 2: "RETIRED", 3: "RECLAIMED", 4: "PUBLISHED"}
    assert end["sessions_bound"] == 1

    # Right after the lease expiry (seq 36): v2 is the default, v1 still pins s-b.
    mid = _state(cli, fault_log, "--seq", "36")
    assert (mid["seq"], mid["default"], mid["sessions_bound"]) == (36, 2, 2)
    assert _versions(mid) == {1: "RETIRED", 2: "PUBLISHED"}

    # --at resolves to the last seq recorded at or before it: 1200 s is the fatal resolution
    # (seqs 46-48 share that time), 1199.9 s is just before it (seq 45, v3 FAILED_FATAL).
    assert _state(cli, fault_log, "--at", "1200")["seq"] == 48
    before = _state(cli, fault_log, "--at", "1970-01-01T00:19:59.900Z")
    assert before["seq"] == 45 and _versions(before)[3] == "FAILED_FATAL"
    assert before["blocked_by"] == [3]
    assert _state(cli, fault_log, "--at", "1970-01-01T00:20:00+00:00")["seq"] == 48


def test_human_output_names_the_position_and_the_tables(cli: Cli, fault_log: Path) -> None:
    result = cli("replay", fault_log, "--seq", "45")
    assert result.returncode == 0
    out = result.stdout
    assert "at seq 45 of 82" in out
    assert "publication blocked by unresolved versions v3" in out
    assert "FAILED_FATAL" in out and "versions" in out and "engines" in out


def test_timelines_show_each_transition_with_time_and_cause(cli: Cli, fault_log: Path) -> None:
    result = cli("replay", fault_log, "--json", "--version", "3", "--engine", "e1")
    rows = [r for r in _rows(result.stdout) if r["row"] == "timeline"]
    v3 = [(r["seq"], r["from_state"], r["to_state"]) for r in rows if r["subject_of"] == "v3"]
    changes = [(s, a, b) for s, a, b in v3 if a != b]
    assert [(a, b) for _, a, b in changes] == [
        (None, "LOADING"),
        ("LOADING", "FAILED_FATAL"),
        ("FAILED_FATAL", "FAILED_RETRYABLE"),
        ("FAILED_RETRYABLE", "LOADING"),
        ("LOADING", "PUBLISHED"),
        ("PUBLISHED", "RETIRED"),
        ("RETIRED", "RECLAIMING"),
        ("RECLAIMING", "RECLAIMED"),
    ]
    fatal = next(r for r in rows if r["to_state"] == "FAILED_FATAL")
    assert fatal["at"] == 1110.0 and "ambiguous: AMBIGUOUS: load timed out" in fatal["detail"]
    e1 = [r["event"] for r in rows if r["subject_of"] == "e1"]
    assert "EngineRestarted" in e1 and e1.index("EngineRestarted") < e1.index("VersionRestored")
    # a timeline stops where the replay stops
    short = cli("replay", fault_log, "--json", "--version", "3", "--seq", "45")
    assert max(r["seq"] for r in _rows(short.stdout) if r["row"] == "timeline") == 45
    human = cli("replay", fault_log, "--version", "3")
    assert "timeline of v3" in human.stdout and "FAILED_FATAL" in human.stdout


def test_incidents_with_threshold(cli: Cli, fault_log: Path) -> None:
    result = cli("replay", fault_log, "--incidents", "--json", "--stuck-after", "1m")
    incidents = [r for r in _rows(result.stdout) if r["row"] == "incident"]
    kinds = {(r["kind"], r["subject"]) for r in incidents}
    assert {
        ("retried", "v2"),
        ("receipt_rejected", "v2"),
        ("fatal", "v3"),
        ("stuck", "v3"),
        ("skipped", "v5"),
        ("lease_expired", "owner w2"),
        ("engine_restart", "e1"),
        ("reclaim_ambiguous", "v3"),
        ("pinned_retired", "session s-d"),
    } <= kinds
    lenient = cli("replay", fault_log, "--incidents", "--json", "--stuck-after", "2m")
    assert not [r for r in _rows(lenient.stdout) if r.get("kind") == "stuck"]
    human = cli("replay", fault_log, "--incidents")
    assert "incidents" in human.stdout and "engine_restart" in human.stdout


def test_incidents_list_lost_adapters_and_suspensions(cli: Cli, health_log: Path) -> None:
    result = cli("replay", health_log, "--incidents", "--json")
    incidents = [r for r in _rows(result.stdout) if r["row"] == "incident"]
    health = [
        (r["kind"], r["subject"], r["resolution"])
        for r in incidents
        if r["kind"] in ("adapter_lost", "engine_suspended")
    ]
    assert health == [
        ("adapter_lost", "e1", "reloaded under its name after the engine restarted"),
        ("engine_suspended", "e1", "repaired: holds exactly the needed versions"),
        ("engine_suspended", "e2", "removed by an operator"),
        ("engine_suspended", "e0", "still suspended"),
    ]
    human = cli("replay", health_log, "--incidents")
    out = " ".join(human.stdout.split())
    assert "adapter_lost" in out and "engine_suspended" in out
    assert "suspended (lost_adapter)" in out and "removed by an operator" in out
    # replayed up to before the repair, e1's suspension is still open
    e1 = next(r for r in incidents if (r["kind"], r["subject"]) == ("engine_suspended", "e1"))
    repaired = e1["seqs"][-1]  # its last seq: the EngineRepaired that closed it
    early = cli("replay", health_log, "--incidents", "--json", "--seq", str(repaired - 1))
    open_ones = [
        (r["kind"], r["subject"], r["resolved"])
        for r in _rows(early.stdout)
        if r.get("kind") == "engine_suspended"
    ]
    assert open_ones == [("engine_suspended", "e1", False)]


def test_incidents_list_each_repeat_of_one_subject(cli: Cli, tmp_path: Path) -> None:
    """Two expired lives of one owner, a crash loop (two restarts before a repair), two
    suspensions and two losses of one version on one engine: every one is a row."""
    log = anyio.run(write_repeat_run, tmp_path / "repeat.db")
    result = cli("replay", log, "--incidents", "--json")
    assert result.returncode == 0, result.stderr
    rows = [
        (r["kind"], r["subject"], r["summary"].split(":")[0], r["resolution"])
        for r in _rows(result.stdout)
        if r["row"] == "incident" and r["kind"] != "pinned_retired"
    ]
    assert rows == [
        (
            "lease_expired",
            "owner w",
            "no renewal for 9.0s (incarnation a); 1 sessions released",
            "",
        ),
        (
            "lease_expired",
            "owner w",
            "no renewal for 9.0s (incarnation b); 1 sessions released",
            "",
        ),
        (
            "engine_restart",
            "e1",
            "restarted (e1-i1 -> e1-i2)",
            "restarted again (e1-i2 -> e1-i3) before it was repaired",
        ),
        (
            "engine_restart",
            "e1",
            "restarted (e1-i2 -> e1-i3)",
            "repaired: 1 needed versions reloaded, routable",
        ),
        (
            "engine_suspended",
            "e0",
            "suspended (unhealthy)",
            "resumed by an operator, then suspended again (unhealthy) before a repair",
        ),
        (
            "engine_suspended",
            "e0",
            "suspended (unhealthy)",
            "repaired: holds exactly the needed versions",
        ),
        (
            "adapter_lost",
            "e0",
            "v1 missing from its inventory (e0-i1); no longer routed there",
            "back in its inventory without a reload by the ledger",
        ),
        (
            "adapter_lost",
            "e0",
            "v1 missing from its inventory (e0-i1); no longer routed there",
            "reloaded under its name",
        ),
        (
            "adapter_lost",
            "e0",
            "v1 missing from its inventory (e0-i1); no longer routed there",
            "reclaimed: no longer needed",
        ),
    ]
    # the table a person reads has a row for each too (its cells wrap: count the kinds)
    human = cli("replay", log, "--incidents").stdout
    counts = {kind: human.count(kind) for kind, *_ in rows}
    assert counts == {
        "lease_expired": 2,
        "engine_restart": 2,
        "engine_suspended": 2,
        "adapter_lost": 3,
    }


def test_plot_writes_a_png_of_the_expected_size(cli: Cli, fault_log: Path, tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image as mpimg

    png = tmp_path / "life.png"
    result = cli("replay", fault_log, "--plot", png, "--json")
    assert result.returncode == 0, result.stderr
    assert {"row": "plot", "path": str(png)} in _rows(result.stdout)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = mpimg.imread(png)
    assert pixels.shape[:2] == (int(SIZE_INCHES[1] * DPI), int(SIZE_INCHES[0] * DPI))
    rgb = (pixels[..., :3] * 255).round().astype(int)
    non_white = np.any(rgb < 250, axis=-1).mean()
    assert non_white > 0.05, "the plot is (nearly) blank"

    def share(colour: str) -> float:
        want = np.array([int(colour[i : i + 2], 16) for i in (1, 3, 5)])
        return float(np.all(np.abs(rgb - want) <= 2, axis=-1).mean())

    # the bands are drawn in their state's colour, in proportion to the time spent there
    assert share(STATE_COLOURS["PUBLISHED"]) > 0.02
    assert share(STATE_COLOURS["RETIRED"]) > 0.02
    assert share(STATE_COLOURS["RECLAIMED"]) > 0.01
    assert share(STATE_COLOURS["FAILED_FATAL"]) > 0.002


def test_replay_of_a_tampered_log_stops_at_the_bad_seq(cli: Cli, fault_log: Path) -> None:
    tamper.flip_payload_byte(fault_log, 40)
    broken = cli("replay", fault_log)
    assert broken.returncode == Exit.TAMPERED
    assert "(seq 40)" in broken.stderr and "Traceback" not in broken.stderr
    # everything before the damage is still readable, and says so
    assert _state(cli, fault_log, "--seq", "39")["seq"] == 39


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--seq", "83"), "past the end of the log (82)"),
        (("--seq", "0"), "--seq must be >= 1"),
        (("--seq", "3", "--at", "1000"), "not both"),
        (("--at", "999"), "before the first record"),
        (("--at", "yesterday"), "cannot read time"),
        (("--stuck-after", "soon", "--incidents"), "cannot read duration"),
    ],
)
def test_bad_arguments_are_usage_errors(
    cli: Cli, fault_log: Path, args: tuple[str, ...], message: str
) -> None:
    result = cli("replay", fault_log, *args)
    assert result.returncode == Exit.USAGE
    assert message in result.stderr


def test_at_takes_a_time_of_day_and_a_relative_time(cli: Cli, fault_log: Path) -> None:
    # The log's last record is at t=1400 s (1970-01-01T00:23:20Z): a time of day is read on
    # that UTC date, a relative time before that record.
    assert _state(cli, fault_log, "--at", "00:20:00")["seq"] == 48
    assert _state(cli, fault_log, "--at", "00:19:59.900Z")["seq"] == 45
    assert _state(cli, fault_log, "--at", "-200s")["seq"] == 48
    human = cli("replay", fault_log, "--at", "-200s")
    assert "(--at -200s = 1970-01-01T00:20:00.000Z)" in human.stdout
    bad = cli("replay", fault_log, "--at", "25:99")
    assert bad.returncode == Exit.USAGE and "time" in bad.stderr


def test_why_a_version_stalled_names_the_slot_holders_and_when_each_cleared(
    cli: Cli, fault_log: Path
) -> None:
    result = cli("replay", fault_log, "--version", "5", "--json")
    assert result.returncode == 0, result.stderr
    (stall,) = [r for r in _rows(result.stdout) if r["row"] == "stall"]
    assert (stall["version_id"], stall["code"], stall["event"]) == (
        5,
        "CAPACITY_ERROR",
        "PublicationSkipped",
    )
    holders = {o["version_id"]: o for o in stall["obstacles"]}
    assert {v: (o["state"], o["reason"]) for v, o in holders.items()} == {
        2: ("RETIRED", "sessions_bound"),
        3: ("RETIRED", "awaiting_reclaim"),
        4: ("PUBLISHED", "default"),
    }
    assert holders[2]["bound"] == 1 and holders[2]["cleared_seq"] is None  # s-d never left
    assert (holders[3]["cleared_by"], holders[3]["cleared_to"]) == ("ReclaimClaimed", "RECLAIMING")
    assert holders[3]["cleared_seq"] > stall["seq"]
    human = cli("replay", fault_log, "--version", "5").stdout
    assert "why v5 stalled" in human and "sessions bound" in human  # (wrapped to the width)
    assert "awaiting reclaim" in human and "RECLAIMING" in human


def test_a_reclaim_names_the_release_that_made_it_possible(cli: Cli, fault_log: Path) -> None:
    """``replay --version N`` says what let N go: v1's last session (s-b, owner w1, closed)
    or, for v3 which no session ever held, its retirement, with the seqs."""
    result = cli("replay", fault_log, "--version", "1", "--version", "3", "--json")
    assert result.returncode == 0, result.stderr
    rows = _rows(result.stdout)
    reclaims = {r["version_id"]: r for r in rows if r["row"] == "reclaim"}
    assert set(reclaims) == {1, 3}
    v1 = reclaims[1]
    released = next(
        r
        for r in read_back(fault_log)
        if isinstance(r.event, SessionReleased) and r.event.session == "s-b"
    )
    assert v1["enabled_by"] == "release"
    assert {k: v1["last_release"][k] for k in ("session", "owner", "cause", "seq")} == {
        "session": "s-b",
        "owner": "w1",
        "cause": "closed",
        "seq": released.seq,
    }
    assert (reclaims[3]["enabled_by"], reclaims[3]["last_release"]) == ("retirement", None)
    human = cli("replay", fault_log, "--version", "1").stdout
    assert "made possible by the release of s-b (owner w1, closed)" in " ".join(human.split())


def test_a_skip_names_the_sessions_holding_the_slots(cli: Cli, fault_log: Path) -> None:
    result = cli("replay", fault_log, "--version", "5", "--json")
    (stall,) = [r for r in _rows(result.stdout) if r["row"] == "stall"]
    holders = {o["version_id"]: o["sessions"] for o in stall["obstacles"]}
    assert holders == {2: ["s-d"], 3: [], 4: []}
    human = cli("replay", fault_log, "--version", "5").stdout
    assert "s-d" in human
