"""Engine tests: peft calls a transformers method deprecated in 5.x on every adapter injection
(its warning, not ours); the local engine filters it at import, pytest re-enables it per test."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("filterwarnings", "ignore:.*is_gradient_checkpointing.*:FutureWarning")
