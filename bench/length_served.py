"""A served run of length-aware scheduling: one replica, the length evaluation set, Poisson arrivals
at a share of measured capacity, FCFS against SRPT on predicted lengths in the same run.

    flock /tmp/raylm-ray.lock timeout 600 python bench/length_served.py [--warm 12 --requests 32]

Each policy gets its own app (one CPU replica of the embedded model, half a CPU, one torch
thread, max_num_seqs --max-num-seqs so requests queue, under its own route prefix), and both run
side by side, so the machine's other load falls on both alike:
1. Warm-up and capacity: --warm training prompts of the set (bench/length_accuracy.py's split,
   the same seed), all sent at once to each app; the srpt app's predictor learns their lengths.
   Capacity is completions per second of the FCFS app's warm-up (every request queued at once, as
   the simulator measures it, with the other app warming up beside it).
2. Measured: --requests held-out prompts, drawn with a seed, sent as streamed chat completions at
   Poisson times at --load x capacity, the same prompts at the same times to both apps; greedy,
   max_tokens 256 as the set was made, each kind a tenant (its own API key).
Reports E2E mean/p99, TTFT p50/p99 and the longest wait (the largest TTFT). Timings are printed,
never asserted. Other work on the machine shares its cores: say so beside the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import httpx
import ray
from ray import serve

from bench.length_accuracy import Row, load_set, split
from bench.stats import pct
from deploy.app import build_app

MODEL = "SmolLM2-135M-Instruct"
PORT = 8127


async def one(client: httpx.AsyncClient, row: Row, max_tokens: int) -> tuple[float, float]:
    """(TTFT, E2E) of one streamed chat completion; inf for a failed request."""
    body = {
        "model": MODEL,
        "messages": row.messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer key-{row.kind}"}
    start = time.perf_counter()
    ttft = None
    async with client.stream("POST", "/chat/completions", json=body, headers=headers) as r:
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: {") and r.status_code == 200:
                ttft = time.perf_counter() - start
        if r.status_code != 200:
            return float("inf"), float("inf")
    end = time.perf_counter() - start
    return (ttft if ttft is not None else end), end


async def warm(client: httpx.AsyncClient, rows: list[Row], max_tokens: int) -> float:
    """Send rows at once; completions per second."""
    start = time.perf_counter()
    await asyncio.gather(*(one(client, r, max_tokens) for r in rows))
    return len(rows) / (time.perf_counter() - start)


async def measured(
    client: httpx.AsyncClient, schedule: list[tuple[float, Row]], max_tokens: int
) -> list[tuple[float, float]]:
    start = time.perf_counter()

    async def at(t: float, row: Row) -> tuple[float, float]:
        await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
        return await one(client, row, max_tokens)

    return await asyncio.gather(*(at(t, r) for t, r in schedule))


def deploy(policy: str, max_num_seqs: int, kinds: list[str]) -> None:
    serve.run(
        build_app(
            {
                "served_model_name": MODEL,
                "device": "cpu",
                "policy": policy,
                "max_num_seqs": max_num_seqs,
                "max_ongoing_requests": 256,
                "replica_num_cpus": 0.5,
                "ingress_num_cpus": 0.25,
                "api_keys": {f"key-{k}": {"tenant": k} for k in kinds},
            }
        ),
        name=policy,
        route_prefix=f"/{policy}",
    )


def report(policy: str, results: list[tuple[float, float]]) -> None:
    ttft = [t for t, _ in results]
    e2e = [e for _, e in results]
    print(
        f"| {policy} | {len(results)} | {statistics.mean(e2e):.2f} | {pct(e2e, 0.99):.2f} | "
        f"{pct(ttft, 0.5):.2f} / {pct(ttft, 0.99):.2f} | {max(ttft):.2f} |",
        flush=True,
    )


async def run(a: argparse.Namespace) -> None:
    rows = load_set(a.set)
    train, test = split(rows, 1 / 3, a.seed)
    rng = random.Random(a.seed)
    warm_rows = rng.sample(train, a.warm)
    test_rows = rng.sample(test, a.requests)
    kinds = sorted({r.kind for r in rows})
    t0 = time.perf_counter()
    for policy in a.policies:
        deploy(policy, a.max_num_seqs, kinds)
    print(f"<!-- deployed {a.policies} in {time.perf_counter() - t0:.0f} s -->", flush=True)
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    clients = [
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{PORT}/{p}/v1", timeout=600, limits=limits)
        for p in a.policies
    ]
    rates = await asyncio.gather(*(warm(c, warm_rows, a.max_tokens) for c in clients))
    capacity = rates[0]
    schedule: list[tuple[float, Row]] = []
    t = 0.0
    for row in test_rows:
        t += rng.expovariate(a.load * capacity)
        schedule.append((t, row))
    print(
        f"<!-- capacity {capacity:.3f} req/s ({a.policies[0]} warm-up, {a.warm} at once; the "
        f"others' {', '.join(f'{r:.3f}' for r in rates[1:])}); arrivals at {a.load:.0%}: "
        f"{a.load * capacity:.3f} req/s over {t:.0f} s; {time.perf_counter() - t0:.0f} s so far "
        "-->",
        flush=True,
    )
    results = await asyncio.gather(*(measured(c, schedule, a.max_tokens) for c in clients))
    for c in clients:
        await c.aclose()
    print(
        "| policy | requests | E2E mean (s) | E2E p99 (s) | TTFT p50 / p99 (s) | longest wait (s) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for policy, res in zip(a.policies, results):
        report(policy, res)
    print(f"<!-- {time.perf_counter() - t0:.0f} s in all -->", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", default="sim/traces/length_eval.jsonl")
    parser.add_argument("--policies", nargs="+", default=["fcfs", "srpt"])
    parser.add_argument("--load", type=float, default=0.8)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--warm", type=int, default=24, help="training prompts sent first")
    parser.add_argument("--requests", type=int, default=40, help="held-out prompts measured")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    try:
        asyncio.run(run(a))
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
