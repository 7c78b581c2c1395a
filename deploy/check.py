"""Fail fast: what an app reserves in all, measured against what the cluster has, and
`python -m deploy check deploy.yaml`, which validates a Serve config file before anything starts.

A replica that no node can hold is cluster/placement.py's concern; here it is the whole app: every
replica's placement group plus the ingress replicas. Serve would otherwise deploy what fits and
leave the rest "taking more than 30s to be scheduled" for ever, with raylm saying nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.placement import UnplaceableError, live_nodes, unplaceable
from deploy.config import AppConfig
from deploy.fleet_config import FleetConfig

logger = logging.getLogger(__name__)

Resources = Mapping[str, float]
# How often a build that waits for nodes looks at the cluster again.
POLL_S = 5.0
# How long a check waits for its probe of each node's environment.
PROBE_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class Demand:
    """What an app reserves when it starts, in all, and how that adds up."""

    total: dict[str, float]
    parts: list[str]  # "2 x {CPU: 1}" per deployment, for the message

    def shortfall(self, have: Resources, where: str = "the cluster") -> str | None:
        """Why `have` cannot hold the app, or None where it can (by totals: necessary, not
        sufficient, so never a false alarm)."""
        short = [k for k, v in self.total.items() if v > 0 and have.get(k, 0.0) + 1e-9 < v]
        if not short:
            return None
        return (
            f"the app needs {resources_text(self.total)} in all ({' + '.join(self.parts)}); "
            f"{where} has {resources_text({k: have.get(k, 0.0) for k in self.total})}"
        )


def app_demand(fleet: FleetConfig) -> Demand:
    """Every model's replicas at start (at least one each) and the ingress replicas."""
    total: dict[str, float] = {}
    parts: list[str] = []
    for model in fleet.models:
        group = add_resources(model.placement_group_bundles())
        count = starting_replicas(model)
        parts.append(f"{count} x {resources_text(group)} ({model.model_name})")
        for key, value in group.items():
            total[key] = total.get(key, 0.0) + count * value
    ingress = fleet.ingress
    parts.append(
        f"{ingress.ingress_replicas} x {{CPU: {_num(ingress.ingress_num_cpus)}}} (ingress)"
    )
    total["CPU"] = total.get("CPU", 0.0) + ingress.ingress_replicas * ingress.ingress_num_cpus
    return Demand(total, parts)


def starting_replicas(model: AppConfig) -> int:
    """Replicas a model starts with; at least one, which its first request needs anyway."""
    if model.disaggregation is not None:
        return model.disaggregation.prefill_replicas + model.disaggregation.decode_replicas
    if model.autoscaling is not None:
        scaling = model.autoscaling
        start = scaling.initial_replicas if scaling.initial_replicas is not None else 0
        return max(1, start, scaling.min_replicas)
    return model.num_replicas or 1


def wait_for_capacity(fleet: FleetConfig) -> None:
    """Return once the running cluster's total resources can hold the whole app; otherwise wait
    up to placement_timeout_s for nodes to join (an autoscaler's, asked for the app's bundles),
    then raise UnplaceableError with what the app needs and what the cluster has."""
    import ray

    demand = app_demand(fleet)
    problem = demand.shortfall(ray.cluster_resources())
    if problem is None:
        return
    timeout_s = min(m.placement_timeout_s for m in fleet.models)
    if timeout_s <= 0:
        raise UnplaceableError(f"{problem} (placement_timeout_s: 0)")
    logger.warning(
        "%s: waiting up to %.0fs (placement_timeout_s) for nodes to join", problem, timeout_s
    )
    if not _wait_for(demand, app_bundles(fleet), timeout_s):
        problem = demand.shortfall(ray.cluster_resources()) or problem
        raise UnplaceableError(f"{problem} (waited {timeout_s:.0f}s: placement_timeout_s)")


def app_bundles(fleet: FleetConfig) -> list[dict[str, float]]:
    """Every bundle of every replica the app starts with."""
    return [
        dict(bundle)
        for model in fleet.models
        for _ in range(starting_replicas(model))
        for bundle in model.placement_group_bundles()
    ]


def _wait_for(demand: Demand, bundles: list[dict[str, float]], timeout_s: float) -> bool:
    """Whether the cluster grows to hold `demand` within timeout_s, an autoscaler asked for the
    bundles meanwhile (the request is withdrawn after: the replicas' own groups then hold it)."""
    import ray
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=bundles)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
            if demand.shortfall(ray.cluster_resources()) is None:
                return True
        return False
    finally:
        request_resources(bundles=[])


def placement_problems(fleet: FleetConfig, nodes: list[dict[str, float]], where: str) -> list[str]:
    """Every reason `nodes` cannot hold the app: a replica no node can hold, or the app in all."""
    problems = []
    for model in fleet.models:
        problem = unplaceable(
            model.placement_group_bundles(), model.placement_group_strategy(), nodes
        )
        if problem is not None:
            problems.append(f"{model.model_name}: {problem}")
    total = app_demand(fleet).shortfall(add_resources(nodes), where)
    if total is not None:
        problems.append(total)
    return problems


@dataclass(frozen=True, slots=True)
class Target:
    """What a check measures against: a Ray cluster (connected while the check runs) or this
    machine."""

    nodes: list[dict[str, float]]
    where: str
    connected: bool


@contextlib.contextmanager
def cluster_or_machine() -> Iterator[Target]:
    """The live nodes of the Ray cluster this shell reaches (RAY_ADDRESS, or one started on this
    machine), connected until the block ends; else this machine alone."""
    import ray

    try:
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), logging_level=logging.ERROR)
    except (ConnectionError, RuntimeError, ValueError):
        yield Target([machine_resources()], "this machine (no Ray cluster is running)", False)
        return
    try:
        yield Target(live_nodes(), "the Ray cluster", True)
    finally:
        ray.shutdown()


def nodes_lacking(names: list[str], timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, list[str]]:
    """node address -> the variables of `names` unset (or empty) in the environment Ray gives
    tasks on that node (that of its `ray start`): where Serve could build an app that reads
    them. Needs a connected cluster."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe = ray.remote(num_cpus=0)(unset_variables)
    refs = {
        node["NodeManagerAddress"]: probe.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
        ).remote(names)
        for node in ray.nodes()
        if node["Alive"]
    }
    found = ray.get(list(refs.values()), timeout=timeout_s)
    return {address: unset for address, unset in zip(refs, found, strict=True) if unset}


def unset_variables(names: list[str]) -> list[str]:
    """The variables of `names` this process's environment lacks or holds empty."""
    return [name for name in names if not os.environ.get(name)]


def machine_resources() -> dict[str, float]:
    """CPUs and NVIDIA GPUs of this machine, as `ray start` would count them."""
    gpus = [d for d in Path("/dev").glob("nvidia[0-9]*")]
    return {"CPU": float(os.cpu_count() or 1), "GPU": float(len(gpus))}


def resources_text(resources: Resources) -> str:
    """{CPU: 2.5, GPU: 1}, in Ray's own names."""
    return "{" + ", ".join(f"{k}: {_num(v)}" for k, v in sorted(resources.items())) + "}"


def _num(value: float) -> str:
    return f"{value:g}"


def add_resources(bundles: Any) -> dict[str, float]:
    """The sum of bundles (or nodes), resource by resource."""
    total: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            total[key] = total.get(key, 0.0) + float(value)
    return total
