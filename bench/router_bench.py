"""Fleet router benchmark: a multi-tenant shared-prefix workload against two LLMReplicas.

The workload follows llm-d's shared-prefix benchmarks: several tenants, each with a long system
prompt, ask many short questions; arrivals are Poisson. Each router gets two fresh replicas (empty
prefix caches) and replays the same request sequence through a DeploymentHandle, exactly as the
OpenAI ingress calls the replicas, so the router runs in this process and HTTP is left out.

Routers compared in one run: FleetRouter prefix_affinity (ours), FleetRouter round_robin, Serve's
default PowerOfTwoChoicesRequestRouter, and Ray's PrefixCacheAffinityRouter when it imports.

    RAY_AUTH_MODE=disabled .venv/bin/python bench/router_bench.py [--rounds 2] [--tenants 12 --rate
    1.0 ...]

Prints a markdown table and ratios against power-of-two; writes router_bench.{json,png} to --out.
Figures are measurements, never pass/fail.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import logging
import math
import os
import random
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray
from ray import serve

from cluster.replica import LLMReplica
from cluster.serve_router import ROUTER_CLASS_PATH
from deploy.config import AppConfig
from router.stats import ROUTING_STATS_PERIOD_S
from scheduler import SamplingParams, hash_prompt_blocks
from scheduler.request import EngineRequest

logger = logging.getLogger("router_bench")

# the public path pulls in ray.llm's cloud-storage helpers (pyarrow); the class itself does not
try:
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
        PrefixCacheAffinityRouter,
    )
except ImportError as exc:  # pragma: no cover - depends on the installed Ray
    PrefixCacheAffinityRouter = None
    _RAY_PREFIX_IMPORT_ERROR = repr(exc)
else:
    _RAY_PREFIX_IMPORT_ERROR = None

    class TokenPrefixCacheAffinityRouter(PrefixCacheAffinityRouter):
        """Ray's router matches prompt text; ours carry token ids, so each id becomes one
        character."""

        def _extract_text_from_request(self, pending_request) -> str:
            return "".join(map(chr, pending_request.args[0].prompt_token_ids))


@dataclass(slots=True)
class Workload:
    """Tenants with long system prompts, short questions, Poisson arrivals."""

    tenants: int = 12
    prefix_tokens: int = 256
    question_tokens: int = 16
    max_tokens: int = 16
    requests: int = 120
    rate: float = 1.0  # requests per second, the Poisson arrival rate
    seed: int = 0
    vocab_low: int = 200  # token ids stay clear of the special tokens
    vocab_high: int = 40_000

    def build(self, block_size: int) -> list[tuple[float, EngineRequest]]:
        """(arrival offset in seconds, request) pairs; the same sequence for every router."""
        rng = random.Random(self.seed)
        systems = [
            [rng.randrange(self.vocab_low, self.vocab_high) for _ in range(self.prefix_tokens)]
            for _ in range(self.tenants)
        ]
        at, out = 0.0, []
        for i in range(self.requests):
            at += rng.expovariate(self.rate)
            tenant = rng.randrange(self.tenants)
            question = [
                rng.randrange(self.vocab_low, self.vocab_high) for _ in range(self.question_tokens)
            ]
            prompt = systems[tenant] + question
            out.append(
                (
                    at,
                    EngineRequest(
                        request_id=f"bench-{i}",
                        prompt_token_ids=prompt,
                        tenant=f"tenant-{tenant}",
                        sampling_params=SamplingParams(
                            max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True
                        ),
                        block_hashes=hash_prompt_blocks(prompt, block_size),
                    ),
                )
            )
        return out


@dataclass(slots=True)
class Sample:
    """One request's outcome."""

    tenant: str
    sent_s: float  # since the start of the run
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    error: str | None = None


@dataclass(slots=True)
class Result:
    """One router's figures over the whole run."""

    router: str
    hit_rate: float
    ttft_p50_s: float
    ttft_p90_s: float
    output_tok_s: float
    completed: int
    errors: int
    wall_s: float
    split: list[int] | None = (
        None  # requests per replica, where the router counts them (FleetRouter)
    )
    samples: list[Sample] = dataclasses.field(default_factory=list)

    def headline(self) -> str:
        return (
            f"hit rate {self.hit_rate:.1%}, TTFT p50 {self.ttft_p50_s:.2f} s, p90 "
            f"{self.ttft_p90_s:.2f} s, "
            f"{self.output_tok_s:.1f} output tok/s, {self.completed} ok, {self.errors} errors, "
            f"split {self.split}"
        )


def router_configs(threshold: float) -> dict[str, dict[str, Any] | None]:
    """request_router_config per router name (None: Serve's default power-of-two)."""
    fleet = {
        "request_router_class": ROUTER_CLASS_PATH,
        "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
    }
    configs: dict[str, dict[str, Any] | None] = {
        "prefix_affinity": {
            **fleet,
            "request_router_kwargs": {
                "router_policy": "prefix_affinity",
                "imbalance_threshold": threshold,
            },
        },
        "round_robin": {**fleet, "request_router_kwargs": {"router_policy": "round_robin"}},
        "power_of_two": None,
    }
    if PrefixCacheAffinityRouter is not None:
        # Same load threshold as ours (Ray's default is infinite: affinity always wins).
        configs["ray_prefix_cache"] = {
            "request_router_class": TokenPrefixCacheAffinityRouter,
            "request_router_kwargs": {"imbalanced_threshold": threshold},
        }
    else:
        logger.warning("Ray's PrefixCacheAffinityRouter left out: %s", _RAY_PREFIX_IMPORT_ERROR)
    return configs


def replica_options(config: AppConfig, router_config: dict[str, Any] | None) -> dict[str, Any]:
    """LLMReplica deployment options as deploy/app.py builds them, with the router under test."""
    options: dict[str, Any] = {
        **config.scaling_options(),
        "ray_actor_options": config.replica_actor_options(),
        "placement_group_bundles": config.placement_group_bundles(),
        "placement_group_strategy": config.placement_group_strategy(),
        "max_ongoing_requests": config.max_ongoing_requests,
        "health_check_timeout_s": 120,
    }
    if router_config is not None:
        options["request_router_config"] = router_config
    return options


async def one_request(handle, request: EngineRequest, run_start: float) -> Sample:
    start = time.perf_counter()
    ttft, prompt, cached, produced = math.nan, 0, 0, 0
    head = (request.tenant, start - run_start)
    try:
        async for out in handle.options(stream=True).generate.remote(request):
            if out.new_token_ids and math.isnan(ttft):
                ttft = time.perf_counter() - start
            produced += len(out.new_token_ids)
            prompt, cached = out.num_prompt_tokens or prompt, out.num_cached_tokens
    except Exception as exc:
        return Sample(
            *head,
            ttft,
            time.perf_counter() - start,
            len(request.prompt_token_ids),
            0,
            produced,
            repr(exc),
        )
    return Sample(
        *head,
        ttft,
        time.perf_counter() - start,
        prompt or len(request.prompt_token_ids),
        cached,
        produced,
    )


async def replay(handle, schedule: list[tuple[float, EngineRequest]]) -> tuple[list[Sample], float]:
    """Send each request at its arrival offset; all samples and the wall time of the run."""
    start = time.perf_counter()
    tasks = []
    for at, request in schedule:
        delay = at - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        # A fresh id per run: the schedule is shared by every router.
        fresh = dataclasses.replace(
            request, request_id=f"{request.request_id}-{uuid.uuid4().hex[:6]}"
        )
        tasks.append(asyncio.ensure_future(one_request(handle, fresh, start)))
    samples = await asyncio.gather(*tasks)
    return samples, time.perf_counter() - start


async def warm_up(handle, config: AppConfig, n: int) -> None:
    """Compile/allocate on every replica with prompts that share nothing with the workload."""
    reqs = [
        EngineRequest(
            request_id=f"warm-{uuid.uuid4().hex}",
            prompt_token_ids=[11 + i] * 20,
            sampling_params=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
        )
        for i in range(n)
    ]
    await asyncio.gather(*(one_request(handle, r, time.perf_counter()) for r in reqs))


def percentile(values: list[float], q: float) -> float:
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return math.nan
    k = (len(values) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def fleet_routed(handle) -> Counter[str] | None:
    """Requests per replica so far, as counted by the FleetRouter Serve built in this process."""
    try:
        fleet = (
            handle._router._asyncio_router.request_router.fleet
        )  # private path: a bench, not an API
    except AttributeError:
        return None
    return Counter(fleet.routed)


@dataclass(slots=True)
class Run:
    """One replay of the schedule on two fresh replicas."""

    samples: list[Sample]
    wall_s: float
    routed: Counter[str] | None  # per replica, FleetRouter only


def summarize(router: str, runs: list[Run]) -> Result:
    """Figures over every run of one router: all samples pooled, throughput over the summed wall
    time."""
    samples = [s for run in runs for s in run.samples]
    ok = [s for s in samples if s.error is None]
    prompt = sum(s.prompt_tokens for s in ok)
    wall = sum(run.wall_s for run in runs)
    split = None
    if all(run.routed is not None for run in runs):
        # Replica ids differ between runs: add up the busiest, the second busiest, ...
        per_run = [sorted(run.routed.values(), reverse=True) for run in runs]
        split = [sum(col) for col in itertools.zip_longest(*per_run, fillvalue=0)]
    return Result(
        router=router,
        hit_rate=sum(s.cached_tokens for s in ok) / prompt if prompt else 0.0,
        ttft_p50_s=percentile([s.ttft_s for s in ok], 0.5),
        ttft_p90_s=percentile([s.ttft_s for s in ok], 0.9),
        output_tok_s=sum(s.output_tokens for s in ok) / wall,
        completed=len(ok),
        errors=len(samples) - len(ok),
        wall_s=wall,
        split=split,
        samples=samples,
    )


def run_router(
    name: str,
    router_config: dict[str, Any] | None,
    config: AppConfig,
    schedule: list[tuple[float, EngineRequest]],
) -> Run:
    app = f"router_bench_{name}"
    logger.info("%s: starting two fresh replicas", name)
    handle = serve.run(
        LLMReplica.options(**replica_options(config, router_config)).bind(config.engine),
        name=app,
        route_prefix=None,
    )
    try:
        asyncio.run(warm_up(handle, config, n=4))
        before = fleet_routed(handle)
        samples, wall = asyncio.run(replay(handle, schedule))
        after = fleet_routed(handle)
    finally:
        serve.delete(app)
    errors = [s.error for s in samples if s.error]
    if errors:
        logger.warning("%s: %d errors, first: %s", name, len(errors), errors[0])
    routed = after - before if before is not None and after is not None else None
    run = Run(samples, wall, routed)
    logger.info("%s: %s", name, summarize(name, [run]).headline())
    return run


def table(results: list[Result]) -> str:
    base = next((r for r in results if r.router == "power_of_two"), None)
    lines = [
        "| router | prefix-cache hit rate | TTFT p50 (s) | TTFT p90 (s) | output tok/s | completed "
        "| requests per replica |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        split = "/".join(map(str, r.split)) if r.split else "n/a"
        lines.append(
            f"| {r.router} | {r.hit_rate:.1%} | {r.ttft_p50_s:.2f} | {r.ttft_p90_s:.2f} "
            f"| {r.output_tok_s:.1f} | {r.completed}/{r.completed + r.errors} | {split} |"
        )
    if base is not None:
        lines.append("")
        for r in results:
            if r is base:
                continue
            lines.append(
                f"{r.router} vs power_of_two: hit rate x{_ratio(r.hit_rate, base.hit_rate)}, "
                f"TTFT p90 x{_ratio(r.ttft_p90_s, base.ttft_p90_s)}, "
                f"throughput x{_ratio(r.output_tok_s, base.output_tok_s)}"
            )
    return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "inf"


def plot(results: list[Result], workload: Workload, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.router for r in results]
    colors = ["#2b7bb9" if n == "prefix_affinity" else "#9aa5b1" for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = [
        ("prefix-cache hit rate", [r.hit_rate * 100 for r in results], "%"),
        ("TTFT p90 (p50 hatched)", [r.ttft_p90_s for r in results], "s"),
        ("output tokens/s", [r.output_tok_s for r in results], "tok/s"),
    ]
    for ax, (title, values, unit) in zip(axes, panels):
        ax.bar(names, values, color=colors)
        if title.startswith("TTFT"):
            ax.bar(
                names, [r.ttft_p50_s for r in results], color="none", edgecolor="black", hatch="//"
            )
        ax.set_title(title)
        ax.set_ylabel(unit)
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle(
        f"Two replicas, {workload.tenants} tenants x {workload.prefix_tokens}-token system prompt, "
        f"{workload.requests} requests at {workload.rate}/s (Poisson)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    w = Workload()
    for name in ("tenants", "prefix_tokens", "question_tokens", "max_tokens", "requests", "seed"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(w, name))
    p.add_argument("--rate", type=float, default=w.rate)
    p.add_argument("--routers", default="", help="comma-separated subset (default: all available)")
    p.add_argument(
        "--threshold", type=float, default=4.0, help="imbalance threshold of both prefix routers"
    )
    p.add_argument("--model", default="default")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=0,
        help="KV blocks per replica (0: about half the tenants' prefixes plus four requests)",
    )
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--cpu-threads", type=int, default=1)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="replays per router, the order reversed every other round (evens out a noisy machine)",
    )
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # Ray's root handler would print these as JSON

    workload = Workload(
        **{
            k: getattr(args, k)
            for k in (
                "tenants",
                "prefix_tokens",
                "question_tokens",
                "max_tokens",
                "requests",
                "rate",
                "seed",
            )
        }
    )
    prefix_blocks = workload.prefix_tokens // args.block_size
    request_blocks = math.ceil(
        (workload.prefix_tokens + workload.question_tokens + workload.max_tokens) / args.block_size
    )
    per_request = request_blocks - prefix_blocks
    # Each replica caches about half the tenants' system prompts (plus one) and four requests' own
    # blocks: enough when each tenant sticks to one replica, too little when every replica sees them
    # all.
    kv_blocks = args.kv_blocks or (workload.tenants // 2 + 1) * prefix_blocks + 4 * per_request
    config = AppConfig.from_args(
        {
            "model": args.model,
            "device": "cpu",
            "num_replicas": 2,
            "block_size": args.block_size,
            "num_gpu_blocks": kv_blocks,
            "max_num_seqs": args.max_num_seqs,
            "cpu_threads": args.cpu_threads,
            "max_model_len": request_blocks * args.block_size,
            "enable_prefix_caching": True,
            "replica_num_cpus": 1,
        }
    )
    schedule = workload.build(args.block_size)
    configs = router_configs(args.threshold)
    chosen = [n for n in args.routers.split(",") if n] or list(configs)

    # Logical CPUs: two replicas at one CPU each fit even on a two-core machine.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(proxy_location="Disabled")
    runs: dict[str, list[Run]] = {name: [] for name in chosen}
    try:
        for i in range(args.rounds):
            for name in chosen if i % 2 == 0 else chosen[::-1]:
                runs[name].append(run_router(name, configs[name], config, schedule))
    finally:
        serve.shutdown()
        ray.shutdown()
    results = [summarize(name, runs[name]) for name in chosen]

    report = table(results)
    print(
        f"\nworkload: {asdict(workload)}; kv blocks per replica: {kv_blocks}; "
        f"max_num_seqs: {args.max_num_seqs}; cpu threads per replica: {args.cpu_threads}; "
        f"rounds: {args.rounds}\n"
    )
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "router_bench.json").write_text(
        json.dumps(
            {
                "workload": asdict(workload),
                "kv_blocks": kv_blocks,
                "max_num_seqs": args.max_num_seqs,
                "rounds": args.rounds,
                "results": [asdict(r) for r in results],
            },
            indent=2,
        )
    )
    plot(results, workload, args.out / "router_bench.png")
    print(f"\nwrote {args.out / 'router_bench.json'} and {args.out / 'router_bench.png'}")


if __name__ == "__main__":
    main()
