"""One local, loopback-only Ray instance for the ``tests/publisher/ray`` package (starting one costs
seconds on 2 cores), stopped after its last test with everything it ran. Each test kills the
actors it created (fixtures below), so tests do not see each other's actors."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from publisher.ray.ledger_actor import LedgerConfig, start_ledger
from publisher.ray.local import LOOPBACK, local_ray


@pytest.fixture(scope="package")
def ray_instance() -> Iterator[dict[str, Any]]:
    with local_ray(num_cpus=2, log_to_driver=False) as info:
        assert info["node_ip_address"] == LOOPBACK
        yield info
    assert not ray.is_initialized()


class LedgerUnderTest:
    """A bare ledger actor on a fresh SQLite file, under a name of its own."""

    def __init__(self, path: Path, **config: Any) -> None:
        self.name = f"ledger-{uuid.uuid4().hex[:8]}"
        self.config = LedgerConfig(path=str(path), **config)
        self.handle = start_ledger(self.config, name=self.name)

    def restart(self) -> None:
        """Kill the actor and recreate it under the same name (a new actor, same file)."""
        ray.kill(self.handle, no_restart=True)
        self.handle = start_ledger(self.config, name=self.name)

    def stop(self) -> None:
        ray.kill(self.handle, no_restart=True)


@pytest.fixture
def ledger_factory(ray_instance: dict[str, Any], tmp_path: Path) -> Iterator[Any]:
    started: list[LedgerUnderTest] = []

    def start(**config: Any) -> LedgerUnderTest:
        ledger = LedgerUnderTest(tmp_path / f"ledger-{len(started)}.db", **config)
        started.append(ledger)
        return ledger

    yield start
    for ledger in started:
        ledger.stop()
