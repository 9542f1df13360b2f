"""The projection returns to its size after session churn (CPython dicts never shrink on
deletion: the registry must rebuild them, or a long run leaks a dict sized for its peak)."""

from __future__ import annotations

import pytest

from tools.bench.memory import measure


@pytest.mark.parametrize("shape", ["flood", "waves"])
def test_sessions_bound_released_and_forgotten_leave_no_trace(shape: str, slow: bool) -> None:
    result = measure(1_000_000 if slow else 50_000, shape=shape, wave=5_000)
    assert result["peak_mib"] > 0.5  # the sessions really were held at some point
    assert result["growth_mib"] < 0.1, result
