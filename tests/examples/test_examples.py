"""Every example of ``examples/`` runs as a user runs it (``python examples/NAME.py``), as a
subprocess that starts and stops its own ``loraledger serve`` over a local CPU engine, and
prints what it promises to show. An example that no longer runs fails CI instead of a reader."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO
from tests.tools.conftest import script_env

EXAMPLES = REPO / "examples"


def run_example(name: str, workdir: Path) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), "--workdir", str(workdir)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=workdir.parent,
        env=script_env(),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_the_rollout_loop_keeps_each_episodes_version_and_reads_its_staleness(
    tmp_path: Path,
) -> None:
    """Two episodes bind version 1 before version 2 is published: every one of their streamed
    turns says version 1; an episode started after the publication says version 2, staleness
    0."""
    out = run_example("rollout_loop.py", tmp_path / "run")
    turns = re.findall(r"^(episode-\S+) turn (\d): version (\d+) staleness (\d+) ", out, re.M)
    assert len(turns) == 9, out
    versions = {(episode, version) for episode, _, version, _ in turns}
    assert versions == {("episode-0", "1"), ("episode-1", "1"), ("episode-late", "2")}, out
    assert {s for e, _, _, s in turns if e == "episode-late"} == {"0"}, out


def test_the_rl_loop_publishes_as_it_trains_and_every_episode_is_on_one_version(
    tmp_path: Path,
) -> None:
    """The RL loop publishes versions 1, 2 and 4 over 4 updates, prints each sample's version,
    staleness and weight, and its audit finds every episode served by the version it bound."""
    out = run_example("rl_loop.py", tmp_path / "run")
    published = re.findall(r"^published version (\d+): PUBLISHED$", out, re.M)
    assert published == ["1", "2", "4"], out
    samples = re.findall(r"^step \d: step\d-ep\d +\d +v(\d+) +(\d+) +([\d.]+) ", out, re.M)
    assert len(samples) == 4 * 4 * 2, out
    assert all(float(w) == 0.5 ** int(s) for _, s, w in samples), out
    assert "audit: every episode on one version: yes" in out, out
    assert len(re.findall(r"^audit: step\d-ep\d ", out, re.M)) == 16, out
