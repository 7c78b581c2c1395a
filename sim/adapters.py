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
import random
from dataclasses import dataclass

from settings import check_settings, setting
from sim.workload import SimRequest

MAX_ADAPTERS = 1 << 20
MAX_LOAD_S = 3600.0


@dataclass(frozen=True, slots=True)
class AdapterSlotsConfig:
    """Each replica's adapter slots and what loading one costs."""

    slots: int = setting(
        4, "adapters a replica holds (the engine's max_loras)", ge=1, le=MAX_ADAPTERS
    )
    load_s: float = setting(
        0.05, "seconds each load adds to the step that loads it", ge=0, le=MAX_LOAD_S
    )

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True, slots=True)
class AdapterMix:
    """Which adapter each request of a workload names: Zipf(s) over `adapters` adapters, a
    base_share of requests naming none."""

    adapters: int = setting(32, "adapters named by the workload", ge=1, le=MAX_ADAPTERS)
    zipf_s: float = setting(1.0, "Zipf exponent of their popularity", ge=0, le=10)
    base_share: float = setting(0.0, "share of requests that name no adapter", ge=0, le=1)
    seed: int = setting(0, "seed of the draw", ge=0, lt=2**63)

    def __post_init__(self) -> None:
        check_settings(self)


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
