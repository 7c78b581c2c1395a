"""Prefix routing at scale: the routing study's fleet under prefix affinity at a fixed per-replica
load, with the figures the per-replica index bound is judged by.

    python bench/routing_scale.py --sizes 8 64 512 [--rate 10.70] [--seconds 10] \
        [--router-kwargs '{"imbalance_ratio": 1.5}']
    python bench/routing_scale.py --chat --sizes 10 1000 --rate 0.347 --seconds 180

Prints one line per fleet size: the prefix-cache hit rate, TTFT p50/p90, goodput (TTFT <= 1 s,
ITL p90 <= 0.5 s, as in the study), the max/min ratio of requests served and of busy time across
replicas, and the router's prefix index (entries, distinct blocks, bytes per replica by
tracemalloc's count of what the index allocated). The rate defaults to the routing study's 50% of
prefix affinity's measured capacity (sim/results/routing_at_scale.txt), so runs compare at the
same load without re-measuring capacity each time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tracemalloc
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from router.config import RoutingConfig
from router.prefix_index import PrefixIndex
from sim.cost import load_profile
from sim.fleet import FleetSim
from sim.studies import FLEET_PROFILE, chat_config, chat_workload, fleet_config, fleet_workload


def index_bytes(index: PrefixIndex) -> int:
    """Bytes the index holds, measured by rebuilding its entries under tracemalloc."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    copy = PrefixIndex(index.blocks_per_replica)
    for replica in sorted(index.replicas()):
        copy.set_bound(replica, index.bound(replica))
        copy.insert(replica, index.lru_order(replica), 0.0)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del copy
    return used


def run(n: int, rate: float, seconds: float, router_kwargs: dict, chat: bool = False) -> dict:
    cfg = chat_config(n) if chat else fleet_config(n)
    cfg.routing = RoutingConfig(**{"router_policy": "prefix_affinity", "seed": 0, **router_kwargs})
    t0 = time.perf_counter()
    sim = FleetSim(cfg, load_profile(FLEET_PROFILE))
    if chat:  # the scale study's run: arrivals for seconds + 1, stopped at seconds + 1
        result = sim.run(chat_workload(n, seconds + 1, rate), until_s=seconds + 1)
    else:
        result = sim.run(fleet_workload(n, seconds, rate))
    wall = time.perf_counter() - t0
    s = result.summary(slo_ttft_s=1.0, slo_itl_s=0.5)
    served = Counter(r.replica for r in result.records if r.finish_s is not None)
    counts = [served.get(rep.name, 0) for rep in result.replicas]
    busy = [rep.busy_s for rep in result.replicas]
    index = sim.fleet.index
    size = getattr(index, "num_entries", len(index))  # the old index: one entry per block
    row = {
        "replicas": n,
        "hit_rate": s["hit_rate"],
        "ttft_p50_s": s["ttft_p50_s"],
        "ttft_p90_s": s["ttft_p90_s"],
        "goodput_rps": s["goodput_rps"],
        "offered_rps": rate * n,
        "served_max_min": max(counts) / max(min(counts), 1),
        "busy_max_min": max(busy) / max(min(busy), 1e-9),
        "index_entries": size,
        "index_blocks": len(index),
        "index_bytes_per_replica": index_bytes(index) / n if hasattr(index, "lru_order") else 0.0,
        "wall_s": wall,
    }
    print(
        f"{n:5d} replicas: hit {row['hit_rate']:.3f} ttft p50/p90 {row['ttft_p50_s']:.3f}/"
        f"{row['ttft_p90_s']:.3f} s goodput {row['goodput_rps']:.1f} of {row['offered_rps']:.1f}"
        f" req/s; served max/min {row['served_max_min']:.2f}, busy max/min "
        f"{row['busy_max_min']:.2f}; index {size} entries, {len(index)} blocks, "
        f"{row['index_bytes_per_replica']:.0f} B/replica; {wall:.0f} s wall",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python bench/routing_scale.py")
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--rate", type=float, default=10.70, help="requests/s per replica")
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds of arrivals")
    parser.add_argument("--router-kwargs", type=json.loads, default={})
    parser.add_argument(
        "--chat",
        action="store_true",
        help="the scale study's chat workload and fleet (use --rate 0.347 --seconds 180)",
    )
    a = parser.parse_args(argv)
    print(
        f"{'chat' if a.chat else 'routing'} workload, rate {a.rate} req/s per replica, "
        f"{a.seconds} s, router_kwargs {a.router_kwargs}"
    )
    for n in a.sizes:
        run(n, a.rate, a.seconds, a.router_kwargs, a.chat)


if __name__ == "__main__":
    main()
