"""The tensor-parallel tests' tiny Llama, and extra Ray nodes on this machine for the multi-node
tests (Ray and the other tiny models come from tests/conftest.py)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.random_checkpoint import TINY_TP_LLAMA, write_random_checkpoint
from workers.distributed import free_port


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """4 attention heads, 2 KV heads: TP=2 splits KV heads, TP=4 replicates them."""
    return write_random_checkpoint(TINY_TP_LLAMA, str(tmp_path_factory.mktemp("tiny-llama"))).path


@dataclass
class ExtraNode:
    """A Ray node started on this machine beside the session's head."""

    resource: str  # a custom resource only this node has: what pins a bundle to it
    node_id: str
    node: Any  # ray._private.node.Node: its raylet and agents

    def kill(self) -> None:
        """The node's death: its raylet and agents killed at once (as Cluster.remove_node does,
        without grace); its workers exit with their raylet."""
        self.node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)

    def stop(self, timeout_s: float = 120.0) -> None:
        """Leave the cluster cleanly (a raylet that is told to stop says so to the GCS), and wait
        until the cluster no longer counts this node or its resources: the next module's
        placements must not be promised its CPU."""
        import ray

        self.node.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)
        deadline = time.monotonic() + timeout_s
        while any(n["Alive"] and n["NodeID"] == self.node_id for n in ray.nodes()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {self.node_id} still alive {timeout_s:.0f}s after stop")
            time.sleep(0.5)


def _start_node(gcs_address: str, resource: str) -> ExtraNode:
    """A node joined to the session's cluster the way ray.cluster_utils.Cluster.add_node joins
    one (that class cannot join a head it did not start). Not `ray start`: it would record the
    cluster in /tmp/ray/ray_current_cluster, where every later ray.init() on the machine, other
    sessions' included, would try to join it."""
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    params = RayParams(
        num_cpus=1,
        num_gpus=0,
        resources={resource: 1},
        node_ip_address="127.0.0.1",
        gcs_address=gcs_address,
        include_log_monitor=False,
        node_manager_port=0,
        min_worker_port=0,
        max_worker_port=0,
        object_store_memory=150 * 1024 * 1024,
        metrics_export_port=free_port(),
    )
    params.dashboard_agent_listen_port = None  # not the head's
    node = Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)
    return ExtraNode(resource, _wait_for_node(resource), node)


def _wait_for_node(resource: str, timeout_s: float = 180.0) -> str:
    """The id of the live node that has `resource`, once it has joined."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for node in ray.nodes():
            if node["Alive"] and resource in node["Resources"]:
                return node["NodeID"]
        time.sleep(0.5)
    raise TimeoutError(f"the Ray node with {resource} did not join within {timeout_s:.0f}s")


@pytest.fixture(scope="module")
def extra_nodes(ray_cluster) -> Iterator[list[ExtraNode]]:
    """Two more Ray nodes on this machine, joined to the session's cluster: one CPU each and a
    resource of its own (`raylm_test_node_<i>_<pid>`), so that placements across nodes,
    cross-node collectives and a node's death can be tested on one machine. Stopped, and gone
    from the cluster, when the module ends."""
    nodes: list[ExtraNode] = []
    try:
        for i in range(2):
            nodes.append(_start_node(ray_cluster, f"raylm_test_node_{i}_{os.getpid()}"))
        yield nodes
    finally:
        for node in nodes:
            node.stop()
