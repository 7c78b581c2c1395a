"""Tenants and the prefix cache (issue 45, finding 2): what a second tenant learns from a prompt
the first one cached.

Serves the embedded SmolLM2 on CPU with two tenants' keys under --scope (`tenant`, the default
with keys, or `shared`, the leak as it was), then, --trials times, with fresh random prompts of
--prompt-tokens token ids:
  1. tenant one sends prompt P (cold);
  2. tenant two sends P: what the finding measured;
  3. tenant two sends a prompt Q nobody sent (cold, the reference);
  4. tenant one sends P again (its own cache: warm).
Prints the median TTFT (first streamed chunk) and cached_tokens of each, and the ratios of (2)
and (4) to (3). Timings are printed, never asserted.

  python bench/tenant_cache.py                 # scope tenant
  python bench/tenant_cache.py --scope shared  # the leak, for comparison
"""

from __future__ import annotations

import argparse
import json
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

from deploy.app import build_app
from workers.distributed import free_port

MODEL = "SmolLM2-135M-Instruct"
KEYS = {"one": "bench-key-one", "two": "bench-key-two"}
STEPS = ("cold (tenant one, P)", "tenant two, P", "cold (tenant two, Q)", "tenant one, P again")


def send(client: httpx.Client, tenant: str, prompt: list[int]) -> tuple[float, int]:
    """(TTFT in seconds, cached_tokens) of one streamed one-token completion."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    start = time.perf_counter()
    ttft, cached = None, None
    with client.stream("POST", "/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk["choices"]:
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert ttft is not None and cached is not None
    return ttft, cached


def trial(client: httpx.Client, rng: random.Random, n: int) -> list[tuple[float, int]]:
    p, q = ([rng.randrange(100, 40_000) for _ in range(n)] for _ in range(2))
    return [
        send(client, "one", p),
        send(client, "two", p),
        send(client, "two", q),
        send(client, "one", p),
    ]


def report(args: argparse.Namespace, runs: list[list[tuple[float, int]]]) -> None:
    ttft = [statistics.median(run[i][0] for run in runs) for i in range(4)]
    cached = [sorted({run[i][1] for run in runs}) for i in range(4)]
    print(
        f"\nscope {args.scope}, {args.prompt_tokens}-token prompts, {args.trials} trials (medians)"
    )
    print("| request | TTFT | cached_tokens | TTFT / cold |")
    print("| --- | --- | --- | --- |")
    for i, name in enumerate(STEPS):
        print(f"| {name} | {ttft[i] * 1000:.0f} ms | {cached[i]} | {ttft[i] / ttft[2]:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scope", choices=("tenant", "shared"), default="tenant")
    parser.add_argument("--prompt-tokens", type=int, default=1680)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--seed", type=int, default=45)
    args = parser.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = {
        "served_model_name": MODEL,
        "device": "cpu",
        "api_keys": {key: {"tenant": tenant} for tenant, key in KEYS.items()},
        "prefix_cache_scope": args.scope,
        "replica_num_cpus": 1,
        "ingress_num_cpus": 0.5,
    }
    serve.run(build_app(app), name="tenant-cache", route_prefix="/")
    try:
        rng = random.Random(args.seed)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}/v1", timeout=600) as client:
            send(client, "one", [5] * 64)  # warm-up: the first request's one-off costs
            runs = [trial(client, rng, args.prompt_tokens) for _ in range(args.trials)]
        report(args, runs)
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
