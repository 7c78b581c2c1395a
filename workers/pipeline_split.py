"""Which decoder layers each pipeline stage holds (pure: no torch, read by the engine's config
checks and by the workers; workers/pipeline.py runs the stages, workers/pipeline_cost.py prices a
model's parts).

The default split weighs each stage by what a decode step costs it: its layers, plus the embedding
on the first stage and the final norm, LM head and sampling on the last. It is the contiguous split
whose largest stage costs least, since with a micro-batch in flight per stage the costliest stage
sets the pace and every other one idles by the difference."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from settings import shown

# More stages than this is no deployment anyone runs (the largest published ones use 16).
MAX_PIPELINE_STAGES = 64
# A bound for one stage's layer count in pipeline_layer_split (the deepest models have ~120).
MAX_STAGE_LAYERS = 4096
# A bound for one part's cost (weights read per decode step): 2^50 is ~1,000x the largest model.
MAX_PART_COST = 1 << 50
MAX_MODEL_LAYERS = MAX_STAGE_LAYERS * MAX_PIPELINE_STAGES


@dataclass(frozen=True, slots=True)
class StageCosts:
    """What a decode step costs each part of a model, in one unit (workers/pipeline_cost.py counts
    weights read): each decoder layer, what only the first stage runs (the embedding) and what
    only the last one runs (final norm, LM head, sampling)."""

    layers: tuple[int, ...]
    first: int = 0
    last: int = 0

    def __post_init__(self) -> None:
        if not 1 <= len(self.layers) <= MAX_MODEL_LAYERS:
            raise ValueError(
                f"num_hidden_layers: must be in [1, {MAX_MODEL_LAYERS}], got {len(self.layers)}"
            )
        for cost in self.layers:
            _check_cost("a layer's", cost)
        _check_cost("the first stage's", self.first)
        _check_cost("the last stage's", self.last)

    @classmethod
    def by_count(cls, num_layers: int) -> StageCosts:
        """Every layer the same, nothing else: a split balanced by layer count."""
        return cls((1,) * num_layers)

    def extra(self, index: int, size: int) -> int:
        """What stage `index` of `size` runs beside its layers."""
        return (self.first if index == 0 else 0) + (self.last if index == size - 1 else 0)

    def stage(self, start: int, stop: int, index: int, size: int) -> int:
        """The cost of stage `index` of `size` holding layers [start, stop)."""
        return self.extra(index, size) + sum(self.layers[start:stop])


def _check_cost(name: str, cost: object) -> None:
    if not isinstance(cost, int) or isinstance(cost, bool) or not 0 <= cost <= MAX_PART_COST:
        raise ValueError(
            f"pipeline cost: {name} must be an integer in [0, {MAX_PART_COST}], got {shown(cost)}"
        )


def check_layer_split(split: object, size: int) -> list[int] | None:
    """pipeline_layer_split as given (None, or `size` layer counts in [1, MAX_STAGE_LAYERS]), or
    a ValueError naming it. Whether the counts sum to the model's layers is known only once the
    model is (split_layers)."""
    if split is None:
        return None
    if not isinstance(split, (list, tuple)) or len(split) != size:
        raise ValueError(
            f"pipeline_layer_split: must be a list of pipeline_parallel_size={size} layer counts, "
            f"got {shown(split)}"
        )
    for n in split:
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_STAGE_LAYERS:
            raise ValueError(
                f"pipeline_layer_split: each count must be an integer in [1, {MAX_STAGE_LAYERS}], "
                f"got {shown(n)}"
            )
    return list(split)


def split_layers(costs: StageCosts | int, size: int, split: list[int] | None = None) -> list[range]:
    """Each stage's layers: `split` (layers per stage, in order) when given, else the cheapest
    split for `costs` (a layer count alone: balanced by count). Every stage needs a layer."""
    if isinstance(costs, int):
        costs = StageCosts.by_count(costs)
    num_layers = len(costs.layers)
    if not 1 <= size <= MAX_PIPELINE_STAGES:
        raise ValueError(
            f"pipeline_parallel_size: must be in [1, {MAX_PIPELINE_STAGES}], got {size}"
        )
    if size > num_layers:
        raise ValueError(
            f"pipeline_parallel_size: {size} stages for {num_layers} decoder layers; every "
            "stage needs at least one layer"
        )
    split = check_layer_split(split, size)
    if split is None:
        split = cheapest_split(costs, size)
    elif sum(split) != num_layers:
        raise ValueError(
            f"pipeline_layer_split: {split} sums to {sum(split)}, the model has "
            f"num_hidden_layers={num_layers}"
        )
    return [range(a, b) for a, b in itertools.pairwise(itertools.accumulate(split, initial=0))]


def cheapest_split(costs: StageCosts, size: int) -> list[int]:
    """Layers per stage (contiguous, none empty) whose costliest stage costs least: the least
    limit that _pack can meet, found by bisection (costs are integers). Ties go to the earlier
    stages (they take as many layers as the limit allows)."""
    lo = max(costs.layers)
    hi = costs.first + costs.last + sum(costs.layers)
    while lo < hi:
        mid = (lo + hi) // 2
        if _pack(costs, size, mid) is None:
            lo = mid + 1
        else:
            hi = mid
    packed = _pack(costs, size, lo)
    assert packed is not None  # the whole model on one stage's limit always packs
    return packed


def _pack(costs: StageCosts, size: int, limit: int) -> list[int] | None:
    """Layers per stage when each stage but the last takes as many layers as fit under `limit`
    (leaving one for each later stage), or None if some stage cannot. Taking the most never hurts
    a later stage: each starts no earlier than in any split that meets the limit."""
    layers, counts, start = costs.layers, [], 0
    for index in range(size - 1):
        room = len(layers) - (size - 1 - index)  # a layer left for each later stage
        stop = _fill(layers, start, room, limit - costs.extra(index, size))
        if stop == start:
            return None
        counts.append(stop - start)
        start = stop
    if costs.stage(start, len(layers), size - 1, size) > limit:
        return None
    return [*counts, len(layers) - start]


def _fill(layers: Sequence[int], start: int, end: int, budget: int) -> int:
    """The furthest stop <= end such that layers [start, stop) cost at most budget."""
    stop, spent = start, 0
    while stop < end and spent + layers[stop] <= budget:
        spent += layers[stop]
        stop += 1
    return stop
