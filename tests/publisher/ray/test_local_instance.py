"""The local Ray instance's workers run at the machine's own priority: Ray's default nice 15
lets any ordinary busy process outrank the control plane's actors (publisher/ray/local.py)."""

from __future__ import annotations

import os
from typing import Any

import ray


def _niceness() -> int:
    return os.nice(0)


class _Actor:
    def niceness(self) -> int:
        return os.nice(0)


def test_tasks_and_actors_run_at_the_drivers_priority(ray_instance: dict[str, Any]) -> None:
    ours = os.nice(0)
    assert ray.get(ray.remote(_niceness).remote()) == ours
    actor = ray.remote(_Actor).remote()
    try:
        assert ray.get(actor.niceness.remote()) == ours
    finally:
        ray.kill(actor)
