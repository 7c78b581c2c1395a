"""Overload: offered load at 2x what one replica sustains; what is served, what is refused, how
fast.

1. Sustained rate: a closed loop at --concurrency (= max_ongoing_requests) for --measure-s seconds.
2. Overload: Poisson arrivals at --factor x that rate for --overload-s seconds, streamed.
Reports the share served (200), the share refused (429/503, with Retry-After), any other outcome,
p50/p99 TTFT of the served requests, and the ingress actor's resident memory before and after.

  python bench/overload_bench.py                      # embedded SmolLM2 on CPU, one replica
Timings are printed, never asserted.
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
import psutil
import ray
from ray import serve

from bench.stats import pct
from deploy.app import build_app

MODEL = "SmolLM2-135M-Instruct"


async def one(client: httpx.AsyncClient, i: int, max_tokens: int) -> tuple[int, float | None]:
    """(status, TTFT of a served request); a transport error counts as status 0."""
    body = {
        "model": MODEL,
        "prompt": f"Request {i}: tell me about the number {i}.",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    try:
        async with client.stream("POST", "/completions", json=body) as r:
            ttft = None
            async for line in r.aiter_lines():
                if ttft is None and line.startswith("data: {") and r.status_code == 200:
                    ttft = time.perf_counter() - start
            return r.status_code, ttft
    except httpx.HTTPError:
        return 0, None


async def sustained_rate(
    client: httpx.AsyncClient, concurrency: int, seconds: float, max_tokens: int
) -> float:
    done, deadline, counter = 0, time.perf_counter() + seconds, iter(range(10**9))

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            status, _ = await one(client, next(counter), max_tokens)
            done += status == 200

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.perf_counter() - start)


async def overload(
    client: httpx.AsyncClient, rate: float, seconds: float, max_tokens: int, seed: int
) -> list[tuple[int, float | None]]:
    rng, tasks, t, i = random.Random(seed), [], 0.0, 0
    start = time.perf_counter()
    while t < seconds:
        await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
        tasks.append(asyncio.create_task(one(client, i, max_tokens)))
        t += rng.expovariate(rate)
        i += 1
    return await asyncio.gather(*tasks)


def ingress_rss_mb() -> float:
    """Resident memory of the ingress replica's process (Ray names it
    ray::ServeReplica:<app>:OpenAIIngress)."""
    for proc in psutil.process_iter(["cmdline", "memory_info"]):
        if any("OpenAIIngress" in part for part in proc.info["cmdline"] or ()):
            return proc.info["memory_info"].rss / 2**20
    return float("nan")


async def run(args: argparse.Namespace, url: str) -> None:
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        await one(client, -1, 4)  # warm-up
        rate = await sustained_rate(client, args.concurrency, args.measure_s, args.max_tokens)
        rss_before = ingress_rss_mb()
        results = await overload(
            client, args.factor * rate, args.overload_s, args.max_tokens, args.seed
        )
        rss_after = ingress_rss_mb()
    statuses = [s for s, _ in results]
    served = [t for s, t in results if s == 200 and t is not None]
    refused = sum(s in (429, 503) for s in statuses)
    other = len(statuses) - statuses.count(200) - refused
    print(
        f"sustained: {rate:.2f} req/s at concurrency {args.concurrency}; offered "
        f"{args.factor:.1f}x = "
        f"{args.factor * rate:.2f} req/s for {args.overload_s:.0f} s ({len(results)} requests)"
    )
    print(
        "| offered | served (200) | refused (429/503) | other | TTFT p50 served | TTFT p99 served "
        "| "
        "ingress RSS before -> after |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print(
        f"| {args.factor:.1f}x {rate:.2f} req/s | {statuses.count(200) / len(statuses):.0%} | "
        f"{refused / len(statuses):.0%} | {other} | "
        f"{statistics.median(served) if served else float('nan'):.2f} s | "
        f"{pct(served, 0.99):.2f} s | {rss_before:.0f} -> {rss_after:.0f} MB |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--concurrency", type=int, default=8, help="max_ongoing_requests of the replica"
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--measure-s", type=float, default=20.0)
    parser.add_argument("--overload-s", type=float, default=30.0)
    parser.add_argument("--factor", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    port = 8123
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(
        build_app(
            {
                "served_model_name": MODEL,
                "device": "cpu",
                "max_num_seqs": args.concurrency,
                "max_ongoing_requests": args.concurrency,
                "replica_num_cpus": 1,
                "ingress_num_cpus": 0.5,
                "overload_status": 429,
            }
        ),
        name="overload",
        route_prefix="/",
    )
    try:
        asyncio.run(run(args, f"http://127.0.0.1:{port}/v1"))
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
