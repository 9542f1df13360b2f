"""The mutation gate (``--slow`` only): no unexplained survivor in any campaign.

Each gated campaign runs mutmut over its module against the fast tests that claim to check it
(tests/mutation/campaign.py); a surviving mutant must be listed in survivors.toml with a reason.
An entry that no survivor matches any more is stale and fails the gate too, so the file stays
a true list. RELIABILITY.md ("Mutation testing") gives each campaign's figures.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.mutation import campaign


def test_the_survivors_file_is_well_formed() -> None:
    accepted = campaign.load_accepted()
    files = {path for c in campaign.CAMPAIGNS.values() for path in c.mutate}
    assert {key[0] for key in accepted} <= files


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, c in campaign.CAMPAIGNS.items() if c.gated])
def test_no_unexplained_mutant_survives(name: str, tmp_path: Path, slow: bool) -> None:
    if not slow:
        pytest.skip("mutation campaigns run under --slow (3 to 30 min each on two idle cores)")
    pytest.importorskip("mutmut", reason="mutation testing needs the dev extra (mutmut)")
    report = campaign.run_campaign(
        campaign.CAMPAIGNS[name], workdir=tmp_path, max_children=os.cpu_count() or 1
    )
    print(campaign.summary(report))
    unexplained = report.classify()["new"]
    assert report.generated > 0
    assert not report.stale(), (
        "survivors.toml lists survivors that no longer survive; delete them:\n"
        + campaign.summary(report)
    )
    assert not unexplained, (
        f"{len(unexplained)} mutant(s) survived that survivors.toml does not explain; kill them "
        "with a test, or add them (python -m tests.mutation.campaign NAME --toml):\n"
        + campaign.summary(report)
    )
