"""A local, loopback-only Ray instance for the demo, the benchmark and the tests.

``ray.init(address="local")`` always starts a NEW instance (it never joins another session's
cluster, even when ``RAY_ADDRESS`` is set), without the dashboard, and everything it started
is stopped when the block exits (``ray.shutdown`` ends the GCS, the raylet and every worker,
detached actors included).

Loopback only. On Linux, Ray turns ``_node_ip_address="127.0.0.1"`` into the machine's
routable address and its gRPC servers listen on every interface. Ray's single-machine mode
(the one it uses on macOS and Windows, switched by ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``)
instead advertises 127.0.0.1 and has every server listen on loopback only (checked with
``ss``/psutil: GCS, raylet, workers and the runtime-env agent all bind 127.0.0.1). The
variable is read when ``ray`` is imported, so it is set in the environment (inherited by every
process Ray spawns) and in this process's already-imported constant, for the block only.

Workers at the machine's own priority. Ray starts its workers at nice 15 by default, so any
ordinary busy process outranks them about thirty to one: on a loaded laptop or CI runner the
ledger actor then misses its owners' renewals and publications time out, although nothing is
wrong but the priority (seen with two busy processes on two cores: an actor's ``__init__``
alone took minutes). The instance started here is the control plane, not a batch job, so its
workers run at nice 0 (``worker_niceness``), as the processes it serves do.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray
from ray._private import ray_constants

from publisher.ray.link import DEFAULT_NAMESPACE

LOOPBACK = "127.0.0.1"
_SINGLE_MACHINE = ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR  # "0": loopback-only mode


@contextmanager
def loopback_only() -> Iterator[None]:
    """Ray's single-machine mode for the block (see the module docstring): every Ray process
    started meanwhile listens on loopback only. Also what a test needs to run several Ray
    nodes on one machine (``ray.cluster_utils.Cluster``) without leaving loopback."""
    saved_env = os.environ.get(_SINGLE_MACHINE)
    saved_flag = ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_SINGLE_MACHINE] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(_SINGLE_MACHINE, None)
        else:
            os.environ[_SINGLE_MACHINE] = saved_env


@contextmanager
def local_ray(
    *,
    num_cpus: int = 2,
    namespace: str = DEFAULT_NAMESPACE,
    object_store_memory: int = 256 * 1024 * 1024,
    **options: Any,
) -> Iterator[dict[str, Any]]:
    """Start a local loopback-only Ray instance for the block; yields its address info."""
    if ray.is_initialized():
        raise RuntimeError("Ray is already initialized in this process: shut it down first")
    options["_system_config"] = {"worker_niceness": 0, **options.get("_system_config", {})}
    with loopback_only():
        context = ray.init(
            address="local",
            num_cpus=num_cpus,
            namespace=namespace,
            include_dashboard=False,
            object_store_memory=object_store_memory,
            _node_ip_address=LOOPBACK,
            **options,
        )
        try:
            info = dict(context.address_info)
            if info.get("node_ip_address") != LOOPBACK:
                raise RuntimeError(f"Ray advertises {info.get('node_ip_address')}, not loopback")
            yield info
        finally:
            ray.shutdown()
