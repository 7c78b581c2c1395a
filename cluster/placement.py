"""Where a replica's placement group may go, and a clear error where it can go nowhere.

A replica reserves one placement group: its own bundle, then one per tensor-parallel rank. Ranks
all-reduce twice per layer, so they belong on one node (STRICT_PACK): over NVLink or PCIe rather
than the network. SPREAD_STRATEGY puts each rank (or pipeline stage) on a node of its own, for
what must cross nodes (stages, a model larger than a node, the multi-node tests). Ray waits
without end for a group no node can hold; `unplaceable` says so up front from the nodes' total
resources (pure, tested without Ray), and `wait_until_placeable` gives an autoscaler a bounded
time to add a node that can.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import placement_group, remove_placement_group

logger = logging.getLogger(__name__)

STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")
TP_STRATEGY = "STRICT_PACK"
SPREAD_STRATEGY = "STRICT_SPREAD"

Resources = Mapping[str, float]


class UnplaceableError(ValueError):
    """No node of the cluster can hold a replica's bundles (by its total resources)."""


def check_strategy(strategy: str) -> str:
    """strategy, when Ray knows it; else a ValueError naming placement_strategy."""
    if strategy not in STRATEGIES:
        raise ValueError(f"placement_strategy: must be one of {STRATEGIES}, got {strategy!r}")
    return strategy


def default_strategy(tensor_parallel_size: int) -> str:
    """Every rank of a tensor-parallel replica on one node; a one-bundle group fits either way."""
    return TP_STRATEGY if tensor_parallel_size > 1 else "PACK"


def spread_warning(strategy: str, tensor_parallel_size: int) -> str | None:
    """What an operator should hear when a tensor-parallel replica's ranks may leave one node."""
    if tensor_parallel_size == 1 or strategy == TP_STRATEGY:
        return None
    how = "will" if strategy == "STRICT_SPREAD" else "may"
    return (
        f"placement_strategy: {strategy} with tensor_parallel_size {tensor_parallel_size}: a "
        f"replica's ranks {how} sit on different nodes, and their all-reduces (two per layer, "
        f"every step) then cross the network through NCCL; {TP_STRATEGY} keeps them on one node"
    )


def unplaceable(
    bundles: Sequence[Resources], strategy: str, nodes: Sequence[Resources]
) -> str | None:
    """Why no arrangement of `bundles` fits the nodes' total resources under `strategy`, or None
    where one may. Never a false alarm: for the best-effort strategies the check is necessary,
    not sufficient (whether the bundles pack is left to Ray)."""
    check_strategy(strategy)
    what = _unmet(bundles, strategy, nodes)
    if what is None:
        return None
    return (
        f"no node of this Ray cluster can hold a replica's placement group: bundles "
        f"[{', '.join(_shown(b) for b in bundles)}] under {strategy}, and {what}; the largest "
        f"node has "
        f"{_shown(_largest(nodes, bundles), keys=_keys(bundles))}"
    )


def _unmet(bundles: Sequence[Resources], strategy: str, nodes: Sequence[Resources]) -> str | None:
    """The strategy's demand the nodes cannot meet, in words; None where they may meet it."""
    if strategy == "STRICT_PACK":
        if any(_fits(_sum(bundles), node) for node in nodes):
            return None
        return f"one node must hold them all ({_shown(_sum(bundles))})"
    if strategy == "STRICT_SPREAD":
        if _match_each_to_its_own_node(bundles, nodes):
            return None
        return f"each must sit on a node of its own ({len(bundles)} nodes)"
    total = _sum(nodes)
    if all(any(_fits(b, n) for n in nodes) for b in bundles) and _fits(_sum(bundles), total):
        return None
    return "some bundle fits no node, or the cluster holds less than their sum"


def wait_until_placeable(bundles: Sequence[Resources], strategy: str, timeout_s: float) -> None:
    """Return once a node of the cluster can hold the bundles; raise UnplaceableError when none
    joins within timeout_s (0: at once). While waiting, a probe group of the same bundles is the
    demand an autoscaler answers with a node; it is removed before returning."""
    problem = unplaceable(bundles, strategy, live_nodes())
    if problem is None:
        return
    if timeout_s <= 0:
        raise UnplaceableError(problem)
    logger.warning(
        "%s; waiting up to %.0fs for a node that can (an autoscaler's)", problem, timeout_s
    )
    probe = placement_group([dict(b) for b in bundles], strategy=strategy)
    try:
        ray.get(probe.ready(), timeout=timeout_s)
    except GetTimeoutError:
        problem = unplaceable(bundles, strategy, live_nodes())  # a node may have just joined
        if problem is not None:
            raise UnplaceableError(
                f"{problem} (waited {timeout_s:.0f}s: placement_timeout_s)"
            ) from None
    finally:
        remove_placement_group(probe)


def live_nodes() -> list[dict[str, float]]:
    """Total resources of each live node."""
    return [dict(n["Resources"]) for n in ray.nodes() if n["Alive"]]


def _fits(need: Resources, have: Resources) -> bool:
    return all(have.get(k, 0.0) >= v for k, v in need.items() if v > 0)


def _sum(bundles: Sequence[Resources]) -> dict[str, float]:
    total: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            total[k] = total.get(k, 0.0) + v
    return total


def _match_each_to_its_own_node(bundles: Sequence[Resources], nodes: Sequence[Resources]) -> bool:
    """A node for every bundle, no node twice (augmenting paths over a few bundles)."""
    owner: dict[int, int] = {}  # node -> bundle

    def place(b: int, seen: set[int]) -> bool:
        for n, node in enumerate(nodes):
            if n not in seen and _fits(bundles[b], node):
                seen.add(n)
                if n not in owner or place(owner[n], seen):
                    owner[n] = b
                    return True
        return False

    return all(place(b, set()) for b in range(len(bundles)))


def _keys(bundles: Sequence[Resources]) -> list[str]:
    return sorted({k for b in bundles for k, v in b.items() if v > 0})


def _largest(nodes: Sequence[Resources], bundles: Sequence[Resources]) -> Resources:
    """The node with the most of what the bundles ask for (GPUs first, where they ask for any)."""
    keys = sorted(_keys(bundles), key=lambda k: k != "GPU")
    return max(nodes, key=lambda n: [n.get(k, 0.0) for k in keys], default={})


def _shown(resources: Resources, keys: list[str] | None = None) -> str:
    keys = keys if keys is not None else sorted(k for k, v in resources.items() if v > 0)
    return "{" + ", ".join(f"{k}: {resources.get(k, 0.0):g}" for k in keys) + "}"
