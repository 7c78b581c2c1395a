"""LoRA adapters in the simulator: Zipf popularity over the workload, and each replica's device
slots with their load time.

The model: a replica holds at most `slots` adapters. A request for an adapter the replica holds is
a hit and enters the scheduler at once. Otherwise the replica loads the adapter into a free slot,
or into the least recently used slot that no admitted, unfinished request uses (evicting its
adapter), and the replica's next step takes `load_s` longer (an engine loads an adapter between
steps, holding up the batch). With every slot in use by admitted requests the request waits,
first come first served, until one of them finishes; it is never failed.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from dataclasses import dataclass

from sim.workload import SimRequest

MAX_ADAPTERS = 1 << 20
MAX_LOAD_S = 3600.0


@dataclass(frozen=True, slots=True)
class AdapterSlotsConfig:
    """Each replica's adapter slots and what loading one costs."""

    slots: int = 4  # the engine's max_loras
    load_s: float = 0.05  # seconds each load adds to the step that loads it

    def __post_init__(self) -> None:
        if isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 1:
            raise ValueError(f"slots: must be an integer >= 1, got {self.slots!r}")
        if not 0 <= self.load_s <= MAX_LOAD_S:
            raise ValueError(f"load_s: must be in [0, {MAX_LOAD_S:.0f}] seconds, got {self.load_s}")


@dataclass(frozen=True, slots=True)
class AdapterMix:
    """Which adapter each request of a workload names: Zipf(s) over `adapters` adapters, a
    base_share of requests naming none."""

    adapters: int = 32
    zipf_s: float = 1.0
    base_share: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.adapters <= MAX_ADAPTERS:
            raise ValueError(f"adapters: must be in [1, {MAX_ADAPTERS}], got {self.adapters}")
        if not (math.isfinite(self.zipf_s) and 0 <= self.zipf_s <= 10):
            raise ValueError(f"zipf_s: must be in [0, 10], got {self.zipf_s}")
        if not 0 <= self.base_share <= 1:
            raise ValueError(f"base_share: must be in [0, 1], got {self.base_share}")


def adapter_name(rank: int) -> str:
    """The adapter of popularity rank `rank` (0: the most popular)."""
    return f"lora-{rank}"


def with_adapters(workload: list[SimRequest], mix: AdapterMix) -> list[SimRequest]:
    """The workload with each request's adapter drawn from mix (arrivals and lengths unchanged)."""
    rng = random.Random(mix.seed)
    cum = list(itertools.accumulate((k + 1) ** -mix.zipf_s for k in range(mix.adapters)))
    ranks = range(mix.adapters)
    out = []
    for r in workload:
        rank = rng.choices(ranks, cum_weights=cum)[0]
        base = rng.random() < mix.base_share
        out.append(dataclasses.replace(r, lora_name="" if base else adapter_name(rank)))
    return out
