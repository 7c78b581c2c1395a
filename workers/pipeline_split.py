"""Which decoder layers each pipeline stage holds (pure: no torch, read by the engine's config
checks and by the workers; workers/pipeline.py runs the stages)."""

from __future__ import annotations

import itertools

from settings import shown

# More stages than this is no deployment anyone runs (the largest published ones use 16).
MAX_PIPELINE_STAGES = 64
# A bound for one stage's layer count in pipeline_layer_split (the deepest models have ~120).
MAX_STAGE_LAYERS = 4096


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


def split_layers(num_layers: int, size: int, split: list[int] | None = None) -> list[range]:
    """Each stage's layers: `split` (layers per stage, in order) when given, else balanced by
    count (the first num_layers % size stages take one more). Every stage needs a layer."""
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
        base, extra = divmod(num_layers, size)
        split = [base + (i < extra) for i in range(size)]
    elif sum(split) != num_layers:
        raise ValueError(
            f"pipeline_layer_split: {split} sums to {sum(split)}, the model has "
            f"num_hidden_layers={num_layers}"
        )
    bounds = [0]
    for n in split:
        bounds.append(bounds[-1] + n)
    return [range(a, b) for a, b in itertools.pairwise(bounds)]
