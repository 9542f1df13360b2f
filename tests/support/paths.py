"""Where the repository is, for tests that run its files or commands: one definition, so a test
file can move between folders without counting its parents again."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
