"""The ledger outlives its node: on a PostgreSQL log, the ledger actor killed on one Ray node
and started again on ANOTHER node (the first one removed from the cluster, as a lost machine
would be) resumes the same log and loses nothing.

Two Ray worker nodes on this one machine (``ray.cluster_utils.Cluster``, loopback only as in
``publisher/ray/local.py``), each with a custom resource naming it, so each start of the
actor provably lands on the node asked for. Its own package: ``tests/publisher/ray`` keeps one plain
local Ray instance alive for all its tests, and a process holds one Ray connection at a time.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import ray
from ray.cluster_utils import Cluster

from evlog.errors import LoraLedgerError
from evlog.postgres import PostgresStore
from publisher.core.errors import Code
from publisher.ray.client import RayLedger
from publisher.ray.ledger_actor import LedgerConfig, LedgerInfo, start_ledger
from publisher.ray.link import DEFAULT_NAMESPACE
from publisher.ray.local import LOOPBACK, loopback_only
from tests.publisher.ray.kit import create
from tests.support.ledger import publish

pytestmark = pytest.mark.anyio

_NODE = {
    "num_cpus": 1,
    "node_ip_address": LOOPBACK,
    "object_store_memory": 96 * 1024 * 1024,
}

# w1's one life: the worker that lives on while the ledger moves holds its secret
INCARNATION, SECRET = "w1-life", "s" * 64


@pytest.fixture
def two_nodes() -> Iterator[tuple[Cluster, Any, Any]]:
    """A head without CPUs (nothing lands there by accident) and two worker nodes, ``zone-a``
    and ``zone-b``; everything is shut down after the test."""
    if ray.is_initialized():
        pytest.fail("Ray is already initialized in this process")
    with loopback_only():
        cluster = Cluster(
            initialize_head=True,
            head_node_args={**_NODE, "num_cpus": 0, "include_dashboard": False},
        )
        try:
            node_a = cluster.add_node(**_NODE, resources={"zone-a": 1})
            node_b = cluster.add_node(**_NODE, resources={"zone-b": 1})
            ray.init(address=cluster.address, namespace=DEFAULT_NAMESPACE, log_to_driver=False)
            nodes = (cluster.head_node, node_a, node_b)
            assert {node.node_ip_address for node in nodes} == {LOOPBACK}
            yield cluster, node_a, node_b
        finally:
            ray.shutdown()
            cluster.shutdown()


async def _bind_all(ledger: RayLedger, names: list[str]) -> dict[str, Any]:
    answers: dict[str, Any] = {}

    async def bind(name: str) -> None:
        try:
            answers[name] = await ledger.bind(name, "w1")
        except LoraLedgerError as exc:
            answers[name] = exc

    async with anyio.create_task_group() as tg:
        for name in names:
            tg.start_soon(bind, name)
    return answers


async def _log(url: str) -> list[tuple[int, bytes, bytes]]:
    async with PostgresStore.open(url) as store:
        assert (await store.verify()).ok
        return [(r.seq, r.event_id, r.hash) for r in await store.read()]


async def test_a_ledger_on_postgres_restarted_on_another_node_loses_nothing(
    two_nodes: tuple[Cluster, Any, Any], postgres_url: str
) -> None:
    cluster, node_a, node_b = two_nodes
    name = f"ledger-{uuid.uuid4().hex[:8]}"
    config = LedgerConfig(path=postgres_url)
    handle = start_ledger(config, name=name, resources={"zone-a": 0.01})
    first: LedgerInfo = ray.get(handle.describe.remote())
    assert first.node_id == node_a.node_id

    names = [f"s{i}" for i in range(30)]
    # deregister_on_exit=False: w1 stands for a worker that lives on while the ledger moves
    # (a clean exit of this client would end w1 and release its sessions).
    async with RayLedger.connect(name, reconnect_timeout=120, deregister_on_exit=False) as ledger:
        await create(ledger)
        await ledger.register_owner("w1", ttl_s=600, incarnation=INCARNATION, secret=SECRET)
        await publish(ledger, 1)
        bound = await _bind_all(ledger, names)
        for session in names[:10]:
            await ledger.release(session, "w1")
        await publish(ledger, 2)
        epoch = (await ledger.status()).epoch
    before = await _log(postgres_url)

    # The node is lost: its ledger actor with it (killed for good, Ray must not restart it
    # there), then the node itself leaves the cluster.
    ray.kill(handle, no_restart=True)
    cluster.remove_node(node_a)
    handle = start_ledger(config, name=name, resources={"zone-b": 0.01})
    second: LedgerInfo = ray.get(handle.describe.remote())
    assert second.node_id == node_b.node_id != first.node_id
    assert second.epoch == epoch + 1 and second.last_seq > before[-1][0]

    after = await _log(postgres_url)
    assert after[: len(before)] == before  # every record, unchanged, the chain continued
    async with RayLedger.connect(name, reconnect_timeout=120) as ledger:
        await ledger.register_owner(
            "w1", ttl_s=600, incarnation=INCARNATION, secret=SECRET
        )  # the same life, attached again
        status = await ledger.status()
        assert status.sessions_bound == 20
        again = await _bind_all(ledger, names)
        for session in names[:10]:
            assert isinstance(again[session], LoraLedgerError)
            assert again[session].code == Code.SESSION_CLOSED
        for session in names[10:]:
            assert again[session].new is False
            assert again[session].version_id == bound[session].version_id == 1
        fresh = await ledger.bind("late", "w1")
        assert (fresh.new, fresh.version_id) == (True, 2)
    ray.kill(handle, no_restart=True)
