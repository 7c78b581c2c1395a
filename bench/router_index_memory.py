"""Memory of the router's exact KV index (router/kv_events.py) for a simulated fleet, beside the
approximate prefix index (router/prefix_index.py) holding the same device blocks.

Each simulated replica holds `--device-blocks` blocks in its device pool and `--cpu-blocks` in its
CPU tier (`--disk-blocks` on disk); a share `--shared` of each replica's blocks are common prefixes
(system prompts) drawn from a pool of `--prefixes` chains, the rest its own. Every replica is
synced by a snapshot through the RoutingStats dict, as Serve carries it; tracemalloc counts what
the index allocated. Also timed: one match of a 64-block prompt against every replica.

    python bench/router_index_memory.py [--replicas 8 64 512] [--device-blocks 2048] \
        [--cpu-blocks 4096] [--disk-blocks 0] [--shared 0.5]

Prints per fleet size: entries, distinct hashes, bytes in total, per replica and per entry.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from router.kv_events import KVIndex
from router.prefix_index import PrefixIndex
from router.stats import RoutingStats
from scheduler.kv_events import KVEventReport, KVSnapshot
from scheduler.outputs import SchedulerStats


def chain(rng: random.Random, n: int) -> list[int]:
    """n distinct 128-bit hashes (a prefix chain's blocks)."""
    return [rng.getrandbits(128) for _ in range(n)]


def replica_tiers(
    rng: random.Random, args: argparse.Namespace, prefixes: list[list[int]]
) -> tuple[list[int], list[int], list[int]]:
    """One replica's device, CPU and disk hashes: shared prefix chains, then its own blocks."""
    tiers = []
    for n in (args.device_blocks, args.cpu_blocks, args.disk_blocks):
        shared: list[int] = []
        while len(shared) < int(n * args.shared):
            shared += rng.choice(prefixes)
        shared = list(dict.fromkeys(shared))[: int(n * args.shared)]
        tiers.append(shared + chain(rng, n - len(shared)))
    return tiers[0], tiers[1], tiers[2]


def snapshot_stats(device: list[int], cpu: list[int], disk: list[int]) -> RoutingStats:
    stats = RoutingStats(
        SchedulerStats(0, 0, 0, 0.0, 0.0, 0),
        kv_events=KVEventReport([], KVSnapshot(0, device, cpu, disk)),
    )
    return RoutingStats.from_dict(stats.to_dict())


def measure(n: int, args: argparse.Namespace) -> str:
    rng = random.Random(args.seed)
    prefixes = [chain(rng, 64) for _ in range(args.prefixes)]
    reports = [snapshot_stats(*replica_tiers(rng, args, prefixes)) for _ in range(n)]
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = KVIndex()
    for i, stats in enumerate(reports):
        assert stats.kv_events is not None
        index.apply(f"replica-{i}", stats.kv_events)
    kv_bytes = tracemalloc.get_traced_memory()[0] - base
    approx = PrefixIndex(args.device_blocks)
    for i, stats in enumerate(reports):
        assert stats.kv_events is not None and stats.kv_events.snapshot is not None
        approx.insert(f"replica-{i}", stats.kv_events.snapshot.device, 0.0)
    approx_bytes = tracemalloc.get_traced_memory()[0] - base - kv_bytes
    tracemalloc.stop()
    names = [f"replica-{i}" for i in range(n)]
    prompt = prefixes[0]
    times = []
    for _ in range(20):  # the median: a garbage collection pass over the index can land in one
        t0 = time.perf_counter()
        runs = index.match(prompt, names)
        times.append(time.perf_counter() - t0)
    match_ms = statistics.median(times) * 1e3
    assert max(r.blocks for r in runs.values()) > 0
    entries = index.num_entries
    return (
        f"{n:4d} replicas: {entries:9d} entries, {len(index):9d} hashes, "
        f"{kv_bytes / 2**20:8.1f} MiB ({kv_bytes / n / 2**20:6.2f} MiB/replica, "
        f"{kv_bytes / entries:5.0f} B/entry); approximate index, device blocks only: "
        f"{approx_bytes / approx.num_entries:5.0f} B/entry; "
        f"a 64-block match (median) {match_ms:6.2f} ms"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[8, 64, 512])
    p.add_argument("--device-blocks", type=int, default=2048)
    p.add_argument("--cpu-blocks", type=int, default=4096)
    p.add_argument("--disk-blocks", type=int, default=0)
    p.add_argument("--shared", type=float, default=0.5)
    p.add_argument("--prefixes", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for n in args.replicas:
        print(measure(n, args), flush=True)


if __name__ == "__main__":
    main()
