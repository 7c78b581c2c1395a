"""Chaos: steady load over two replicas while one replica is killed every --kill-every seconds.

Two runs in one invocation, the same closed-loop load (--concurrency clients; of the 50 prompts, the
even ones are greedy and the odd ones seeded temperature sampling, which must resume exactly too):
no faults, then a replica killed every --kill-every seconds (at most --kills times; Serve replaces
it).
Reports requests completed and lost, the share whose text equals the no-fault run's, e2e p50 / p99
of both runs, the requests in flight at each kill, and the added e2e latency of a request that was
in flight at a kill (its migration) against the no-fault median.

  python bench/chaos_bench.py                  # embedded SmolLM2 on CPU, two replicas
Timings are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import httpx
import ray
from ray import serve

from bench.stats import pct
from deploy.app import build_app

MODEL = "SmolLM2-135M-Instruct"
APP = "chaos"


@dataclass(slots=True)
class Outcome:
    index: int
    start: float
    end: float
    ok: bool
    text: str


def sampling(prompt: int) -> dict:
    """Greedy for even prompts, seeded temperature sampling (seed = prompt) for odd ones."""
    return {"temperature": 0} if prompt % 2 == 0 else {"temperature": 0.8, "seed": prompt}


async def one(client: httpx.AsyncClient, index: int, max_tokens: int) -> Outcome:
    start = time.perf_counter()
    body = {
        "model": MODEL,
        "prompt": f"Fact number {index % 50} about the sea:",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **sampling(index % 50),
    }
    try:
        r = await client.post("/completions", json=body)
        ok, text = (
            r.status_code == 200,
            r.json()["choices"][0]["text"] if r.status_code == 200 else "",
        )
    except (httpx.HTTPError, ValueError):
        ok, text = False, ""
    return Outcome(index, start, time.perf_counter(), ok, text)


async def load(
    url: str, args: argparse.Namespace, kill: bool
) -> tuple[list[Outcome], list[tuple[float, int]]]:
    outcomes: list[Outcome] = []
    in_flight: set[int] = set()
    kills: list[tuple[float, int]] = []
    counter = iter(range(10**9))
    deadline = time.perf_counter() + args.duration_s

    async def client_loop(client: httpx.AsyncClient) -> None:
        while time.perf_counter() < deadline:
            index = next(counter)
            in_flight.add(index)
            outcomes.append(await one(client, index, args.max_tokens))
            in_flight.discard(index)

    async def killer() -> None:
        for _ in range(args.kills):
            await asyncio.sleep(args.kill_every_s)
            if time.perf_counter() >= deadline:
                return
            names = [
                a["name"]
                for a in ray.util.list_named_actors(all_namespaces=True)
                if f"{APP}#LLMReplica" in a["name"]
            ]
            if names:
                kills.append((time.perf_counter(), len(in_flight)))
                ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        tasks = [client_loop(client) for _ in range(args.concurrency)] + (
            [killer()] if kill else []
        )
        await asyncio.gather(*tasks)
    return outcomes, kills


def wait_running(timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while serve.status().applications[APP].status != "RUNNING" and time.monotonic() < deadline:
        time.sleep(1)


def report(
    calm: list[Outcome], chaos: list[Outcome], kills: list[tuple[float, int]], kill_every_s: float
) -> None:
    reference = {o.index % 50: o.text for o in calm if o.ok}
    done = [o for o in chaos if o.ok]
    comparable = [o for o in done if o.index % 50 in reference]
    same = [o for o in comparable if reference[o.index % 50] == o.text]
    greedy = sum(o.index % 2 == 0 for o in comparable), sum(o.index % 2 == 0 for o in same)
    calm_e2e = [o.end - o.start for o in calm if o.ok]
    chaos_e2e = [o.end - o.start for o in done]
    hit = [o.end - o.start for o in done if any(o.start <= t <= o.end for t, _ in kills)]
    print(f"kills: {len(kills)}, requests in flight at each: {[n for _, n in kills]}")
    print("| run | completed | lost | identical text | e2e p50 | e2e p99 |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(
        f"| no faults | {len(calm_e2e)} | {len(calm) - len(calm_e2e)} | - | "
        f"{statistics.median(calm_e2e):.2f} s | "
        f"{pct(calm_e2e, 0.99):.2f} s |"
    )
    print(
        f"| replica killed every {kill_every_s:.0f} s | {len(done)} | {len(chaos) - len(done)} | "
        f"{len(same)}/{len(comparable)} | {statistics.median(chaos_e2e):.2f} s | "
        f"{pct(chaos_e2e, 0.99):.2f} s |"
    )
    print(
        f"identical text: greedy {greedy[1]}/{greedy[0]}, seeded sampling "
        f"{len(same) - greedy[1]}/{len(comparable) - greedy[0]}"
    )
    if hit:
        print(
            f"requests in flight at a kill: {len(hit)}, their e2e median "
            f"{statistics.median(hit):.2f} s, "
            f"{statistics.median(hit) - statistics.median(calm_e2e):+.2f} s against the no-fault "
            "median"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--kill-every-s", type=float, default=20.0)
    parser.add_argument("--kills", type=int, default=2)
    args = parser.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1", num_cpus=8)
    port = 8124
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(
        build_app(
            {
                "served_model_name": MODEL,
                "device": "cpu",
                "num_replicas": 2,
                "replica_num_cpus": 1,
                "cpu_threads": 1,
                "ingress_num_cpus": 0.5,
            }
        ),
        name=APP,
        route_prefix="/",
    )
    url = f"http://127.0.0.1:{port}/v1"
    try:
        calm, _ = asyncio.run(load(url, args, kill=False))
        chaos, kills = asyncio.run(load(url, args, kill=True))
        wait_running()
        report(calm, chaos, kills, args.kill_every_s)
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
