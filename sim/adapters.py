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
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from sim.workload import SimRequest

MAX_ADAPTERS = 1 << 20
MAX_LOAD_S = 3600.0


@dataclass(frozen=True, slots=True)
class AdapterSlotsConfig:
    """Each replica's adapter slots and what loading one costs."""

    slots: int = 4
    load_s: float = 0.05  # seconds a load adds to the replica's next step

    def __post_init__(self) -> None:
        if isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 1:
            raise ValueError(f"slots: must be an integer >= 1, got {self.slots!r}")
        if not 0 <= self.load_s <= MAX_LOAD_S:
            raise ValueError(f"load_s: must be in [0, {MAX_LOAD_S:.0f}] seconds, got {self.load_s}")


@dataclass(slots=True)
class AdapterSlots:
    """One replica's device slots: LRU order, the adapters admitted requests use, and counters."""

    config: AdapterSlotsConfig
    loaded: OrderedDict[str, None] = field(default_factory=OrderedDict)  # least recent first
    in_use: Counter[str] = field(default_factory=Counter)  # admitted, unfinished requests
    load_due_s: float = 0.0  # load time the next step pays
    requests: int = 0  # requests for an adapter that reached the replica
    hits: int = 0  # those whose adapter was loaded when they arrived
    loads: int = 0
    evictions: int = 0

    def arrive(self, adapter: str) -> None:
        """Count a request for adapter reaching the replica: a hit if the adapter is loaded."""
        self.requests += 1
        self.hits += adapter in self.loaded

    def admit(self, adapter: str) -> bool:
        """Take a slot for a request's adapter (loading it if need be); False: every slot is in use,
        the request must wait."""
        if adapter not in self.loaded:
            if not self._make_room():
                return False
            self.loaded[adapter] = None
            self.loads += 1
            self.load_due_s += self.config.load_s
        self.loaded.move_to_end(adapter)
        self.in_use[adapter] += 1
        return True

    def release(self, adapter: str) -> None:
        """A request that used adapter finished."""
        self.in_use[adapter] -= 1
        if not self.in_use[adapter]:
            del self.in_use[adapter]

    def take_load_s(self) -> float:
        """The load time the step starting now pays (and clears)."""
        due, self.load_due_s = self.load_due_s, 0.0
        return due

    def _victim(self) -> str | None:
        return next((a for a in self.loaded if a not in self.in_use), None)

    def _make_room(self) -> bool:
        if len(self.loaded) < self.config.slots:
            return True
        victim = self._victim()
        if victim is None:
            return False
        del self.loaded[victim]
        self.evictions += 1
        return True


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
