"""KV between two replica processes: torch.distributed pairs (gloo, workers/kv_collective.py)
against the Ray object store (cluster/disagg_transport.py), on CPU, per block and batched.

A sender (a Ray actor: a prefill rank's process) makes payloads of --blocks blocks of --block-kib
KiB (default 720 KiB: SmolLM2-135M's fp32 KV per 16-token block) and sends them through each
transport: one payload of all the blocks (batched), or one payload per block (per block, what a
peer pull of single blocks does). This process (a decode rank's) receives them. Timed: the send on
the sender (`ray.put` / the outbox's offer), the receive here (`ray.get` / the pull), and the whole
round from asking the sender to having every payload here (what a disaggregated request waits
for); transports alternate round by round, round 0 (forming the pair) is not counted.

    python bench/kv_collectives_bench.py [--blocks 1 16 64] [--block-kib 720] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import numpy as np
import ray
import torch

from cluster.disagg_transport import ObjectStoreTransport
from workers.kv_collective import CollectiveTransport
from workers.kv_transfer import KVPayload, KVTransport, TransferHandle

TRANSPORTS = ("object_store", "gloo")


def transport(kind: str) -> KVTransport:
    return ObjectStoreTransport() if kind == "object_store" else CollectiveTransport()


@ray.remote(num_cpus=0)
class Sender:
    """A prefill rank's process: its blocks, and both transports."""

    def __init__(self, max_blocks: int, block_bytes: int) -> None:
        torch.set_num_threads(1)
        rng = np.random.default_rng(0)
        self.blocks = rng.integers(0, 256, (max_blocks, block_bytes), dtype=np.uint8)
        self.transports = {kind: transport(kind) for kind in TRANSPORTS}

    def send(self, kind: str, blocks: int, batched: bool) -> tuple[list[TransferHandle], float]:
        rows = (
            [self.blocks[:blocks]] if batched else [self.blocks[i : i + 1] for i in range(blocks)]
        )
        payloads = [
            KVPayload(list(range(len(r))), [0] * len(r), "uint8", (r.shape[1],), r) for r in rows
        ]
        start = time.perf_counter()
        handles = [self.transports[kind].send(p) for p in payloads]
        return handles, time.perf_counter() - start


def one_round(sender, receiver: KVTransport, kind: str, blocks: int, batched: bool) -> dict:
    start = time.perf_counter()
    handles, send_s = ray.get(sender.send.remote(kind, blocks, batched))
    got_at = time.perf_counter()
    payloads = [receiver.receive(h, 60.0) for h in handles]
    end = time.perf_counter()
    if any(p is None for p in payloads) or sum(p.data.shape[0] for p in payloads) != blocks:
        raise RuntimeError(f"{kind}: a transfer did not arrive")
    for h in handles:
        receiver.release(h)
    return {"send": send_s, "receive": end - got_at, "round": end - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--block-kib", type=int, default=720)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"load average before {os.getloadavg()}", flush=True)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    sender = Sender.remote(max(args.blocks), args.block_kib * 1024)
    receivers = {kind: transport(kind) for kind in TRANSPORTS}
    print(
        f"{args.block_kib} KiB blocks, medians of {args.repeats} rounds (microseconds per block)\n"
        "| blocks | mode | transport | send | receive | round | GB/s (round) | store / gloo |"
    )
    print("| --- " * 8 + "|", flush=True)
    for blocks in args.blocks:
        for batched in (True, False):
            rows: dict[str, list[dict]] = {kind: [] for kind in TRANSPORTS}
            for r in range(args.repeats + 1):
                for kind in TRANSPORTS if r % 2 else TRANSPORTS[::-1]:
                    row = one_round(sender, receivers[kind], kind, blocks, batched)
                    if r:
                        rows[kind].append(row)
            report(rows, blocks, batched, args.block_kib * 1024)
    print(f"load average after {os.getloadavg()}")
    ray.shutdown()


def report(rows: dict[str, list[dict]], blocks: int, batched: bool, block_bytes: int) -> None:
    med = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in rows.items()}
    ratio = med["object_store"]["round"] / med["gloo"]["round"]
    mode = "batched" if batched else "per block"
    for kind in TRANSPORTS:
        us = {f: s / blocks * 1e6 for f, s in med[kind].items()}
        rate = blocks * block_bytes / med[kind]["round"] / 1e9
        shown = f"{ratio:.2f}x" if kind == "gloo" else ""
        print(
            f"| {blocks} | {mode} | {kind} | {us['send']:.0f} | {us['receive']:.0f} | "
            f"{us['round']:.0f} | {rate:.2f} | {shown} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
