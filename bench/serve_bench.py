"""Serving benchmark in the manner of `vllm bench serve`, plus the offline engine on the same
workload.

Streams completions over HTTP with Poisson (gamma) arrivals at --request-rate (or all at once,
capped by
--max-concurrency), and reports TTFT, TPOT, ITL and end-to-end percentiles, output tokens/s and
goodput
under SLOs. Two scenarios by default, each run through the full Serve stack (ingress, handle,
replica)
and through an in-process EngineCore with the same config, printing the overhead of the stack:
  low load    one request at a time, alternating paths: what Serve adds to median TTFT, paired
              request by request (target <= 30 ms)
  saturation  every request at once, rounds in alternating order: throughput kept by the stack
              (target >= 90% of the engine's)
Interleaving keeps a busy, shared machine from favouring whichever path ran in a quieter minute.

  python bench/serve_bench.py                        # both scenarios, embedded SmolLM2 on CPU
  python bench/serve_bench.py --base-url http://127.0.0.1:8000/v1 --model SmolLM2-135M-Instruct \\
      --request-rate 4 --num-prompts 100             # only a client against a running server
Timings are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@dataclass(slots=True)
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


@dataclass(slots=True)
class Report:
    name: str
    duration: float
    results: list[RequestResult]
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds by process kind

    def summary(self, slo_ttft: float, slo_tpot: float) -> dict:
        ok = [r for r in self.results if r.ok]
        out = sum(r.output_tokens for r in ok)
        good = [r for r in ok if r.ttft <= slo_ttft and r.tpot <= slo_tpot]

        def pct(values: list[float]) -> dict:
            if not values:
                return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
            a = np.asarray(values) * 1000
            return {
                "mean": float(a.mean()),
                "p50": float(np.percentile(a, 50)),
                "p90": float(np.percentile(a, 90)),
                "p99": float(np.percentile(a, 99)),
            }

        return {
            "name": self.name,
            "completed": len(ok),
            "failed": len(self.results) - len(ok),
            "cpu_s": dict(self.cpu),
            "cpu_s_per_1k_tokens": 1000 * sum(self.cpu.values()) / out if out else 0.0,
            "duration_s": self.duration,
            "output_tok_s": out / self.duration if self.duration else 0.0,
            "request_s": len(ok) / self.duration if self.duration else 0.0,
            "goodput_req_s": len(good) / self.duration if self.duration else 0.0,
            "ttft_ms": pct([r.ttft for r in ok]),
            "tpot_ms": pct([r.tpot for r in ok if r.output_tokens > 1]),
            "itl_ms": pct([x for r in ok for x in r.itl]),
            "e2e_ms": pct([r.e2e for r in ok]),
        }


# ---- workload ------------------------------------------------------------------------------------
def make_prompts(
    vocab: int, num: int, input_len: int, seed: int, shared_prefix: int = 0
) -> list[list[int]]:
    """Random token prompts (fixed length, so both paths see exactly the same tokens)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1000, vocab) for _ in range(shared_prefix)]
    return [
        prefix + [rng.randrange(1000, vocab) for _ in range(input_len - shared_prefix)]
        for _ in range(num)
    ]


def arrival_gaps(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps between arrivals: gamma-distributed (Poisson when burstiness is 1); zeros for
    rate=inf."""
    if rate == float("inf"):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    return list(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num))


# ---- the HTTP client
# -------------------------------------------------------------------------------
async def one_http_request(
    client, url: str, model: str, prompt: list[int], output_len: int
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    last = start
    result = RequestResult(ok=False)
    try:
        async with client.stream("POST", f"{url}/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
        result.e2e = time.perf_counter() - start
        result.ok = True
    except Exception as exc:
        result.error = repr(exc)
    return result


async def run_http(
    url: str,
    model: str,
    prompts: list[list[int]],
    output_len: int,
    rate: float,
    burstiness: float,
    max_concurrency: int | None,
    seed: int,
    name: str,
) -> Report:
    import httpx

    limit = asyncio.Semaphore(max_concurrency or len(prompts))
    gaps = arrival_gaps(len(prompts), rate, burstiness, seed)
    limits = httpx.Limits(
        max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8
    )
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def limited(prompt):
            async with limit:
                return await one_http_request(client, url, model, prompt, output_len)

        start = time.perf_counter()
        tasks = []
        for prompt, gap in zip(prompts, gaps):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(prompt)))
        results = await asyncio.gather(*tasks)
    report = Report(name, time.perf_counter() - start, list(results))
    if len(report.results) > 1:
        print(f"  ... {name}: {report.duration:.1f} s", file=sys.stderr, flush=True)
    return report


# ---- the offline engine
# ------------------------------------------------------------------------------
def run_offline(
    engine, prompts: list[list[int]], output_len: int, concurrency: int | None, name: str
) -> Report:
    """Drive EngineCore.step() directly: `concurrency` requests in flight (None: all at once)."""
    from scheduler import EngineRequest, SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    pending = list(enumerate(prompts))
    starts: dict[str, float] = {}
    results: dict[str, RequestResult] = {}
    last: dict[str, float] = {}
    limit = concurrency or len(prompts)
    begin = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and len(starts) - sum(1 for r in results.values() if r.ok) < limit:
            i, prompt = pending.pop(0)
            rid = f"{name}-{i}-{time.monotonic_ns()}"
            starts[rid] = time.perf_counter()
            results[rid] = RequestResult(ok=False)
            engine.add_request(EngineRequest(rid, prompt, params))
        for out in engine.step():
            now = time.perf_counter()
            r = results[out.request_id]
            if out.new_token_ids:
                if r.ttft == 0.0:
                    r.ttft = now - starts[out.request_id]
                else:
                    r.itl.append(now - last[out.request_id])
                last[out.request_id] = now
                r.output_tokens += len(out.new_token_ids)
            if out.finished:
                r.e2e = now - starts[out.request_id]
                r.ok = True
    report = Report(name, time.perf_counter() - begin, list(results.values()))
    if len(report.results) > 1:
        print(f"  ... {name}: {report.duration:.1f} s", file=sys.stderr, flush=True)
    return report


# ---- CPU accounting: what each path burns, independent of how busy the machine is ----------------
_KINDS = {
    "ServeReplica:bench:LLMReplica": "replica",
    "ServeReplica:bench:OpenAIIngress": "ingress",
    "ProxyActor": "proxy",
    "ServeController": "controller",
}


def cpu_by_kind() -> dict[str, float]:
    """CPU seconds so far of this process ("client") and of this cluster's Serve processes."""
    import psutil

    me = psutil.Process()
    totals = {"client": sum(me.cpu_times()[:2])}
    raylets = _our_raylets()
    if not raylets:
        return totals
    for proc in raylets[0].children(recursive=True):
        try:
            cmd = " ".join(proc.cmdline())
            kind = next((k for marker, k in _KINDS.items() if marker in cmd), None)
            if kind is not None:
                totals[kind] = totals.get(kind, 0.0) + sum(proc.cpu_times()[:2])
        except psutil.Error:
            pass
    return totals


def _our_raylets() -> list:
    """The raylet of the cluster this process started (other people's clusters may share the
    machine)."""
    import psutil
    import ray

    node = ray._private.worker._global_node
    if node is None:
        return []
    return [psutil.Process(p.process.pid) for p in node.all_processes.get("raylet", [])]


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


# ---- printing
# --------------------------------------------------------------------------------------
def print_summary(s: dict) -> None:
    print(
        f"  {s['name']:<24} {s['completed']:>4} ok {s['failed']:>3} failed  "
        f"{s['duration_s']:7.2f} s  "
        f"{s['output_tok_s']:8.1f} out tok/s  goodput {s['goodput_req_s']:6.2f} req/s"
    )
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        v = s[key]
        print(
            f"      {key[:-3].upper():<5} mean {v['mean']:8.1f}  p50 {v['p50']:8.1f}  p90 "
            f"{v['p90']:8.1f}  "
            f"p99 {v['p99']:8.1f} ms"
        )


# ---- main
# ------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        default="default",
        help="model arg of the app (or the served name with --base-url)",
    )
    p.add_argument("--base-url", default=None, help="benchmark a running server only (…/v1)")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per saturation round")
    p.add_argument("--rounds", type=int, default=2, help="saturation rounds per path, alternating")
    p.add_argument("--num-low", type=int, default=10, help="requests in the low-load scenario")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="saturation arrivals/s (inf: all at once)",
    )
    p.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)"
    )
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--cpu-threads",
        type=int,
        default=1,
        help="torch threads, both paths (1: what Ray gives a 1-CPU replica; more thrash on a busy "
        "box)",
    )
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    p.add_argument(
        "--worker-niceness",
        type=int,
        default=0,
        help="nice of Ray's worker processes (Ray's default: 15; this process runs at 0)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--vocab-size",
        type=int,
        default=32000,
        help="with --base-url: random prompt ids below this",
    )
    p.add_argument("--json", default=None, help="write the summaries here")
    return p.parse_args(argv)


def app_args(a: argparse.Namespace, threads: int) -> dict:
    return {
        "model": a.model,
        "served_model_name": "bench",
        "max_model_len": max(256, a.input_len + a.output_len + 16),
        "max_num_seqs": a.max_num_seqs,
        "max_num_batched_tokens": a.max_num_batched_tokens,
        "cpu_threads": threads,
        "max_ongoing_requests": 4 * max(a.num_prompts, a.max_num_seqs),
        "kv_cache_memory_gb": a.kv_cache_memory_gb,
        "enable_prefix_caching": False,
    }


def merged(name: str, reports: list[Report]) -> Report:
    cpu: dict[str, float] = {}
    for r in reports:
        for k, v in r.cpu.items():
            cpu[k] = cpu.get(k, 0.0) + v
    return Report(
        name, sum(r.duration for r in reports), [x for r in reports for x in r.results], cpu
    )


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    slo = (a.slo_ttft_ms / 1000, a.slo_tpot_ms / 1000)
    if a.base_url:
        prompts = make_prompts(a.vocab_size, a.num_prompts, a.input_len, a.seed)
        rep = asyncio.run(
            run_http(
                a.base_url,
                a.model,
                prompts,
                a.output_len,
                a.request_rate,
                a.burstiness,
                a.max_concurrency,
                a.seed,
                "serve",
            )
        )
        print_summary(rep.summary(*slo))
        return

    import ray
    import torch
    from ray import serve

    from deploy.app import build_app
    from deploy.config import AppConfig
    from engine.core import EngineCore
    from workers.distributed import free_port

    torch.set_num_threads(a.cpu_threads)
    # Ray starts worker processes at nice 15. This process (the offline engine) runs at nice 0, so
    # on a shared, oversubscribed machine the default would measure OS priority rather than the
    # stack.
    os.environ["RAY_worker_niceness"] = str(a.worker_niceness)  # noqa: SIM112 - Ray spells it so
    args = app_args(a, a.cpu_threads)
    print(
        f"model {a.model}: {a.input_len} prompt + {a.output_len} output tokens, {a.cpu_threads} "
        "torch "
        f"thread(s) per engine, Ray workers at nice {a.worker_niceness}; offline and Serve runs "
        "interleaved"
    )

    # Both engines live side by side; only the one being measured is busy.
    engine = EngineCore(AppConfig.from_args(args).engine)
    vocab = engine.vocab_size
    low_prompts = make_prompts(vocab, a.num_low, a.input_len, a.seed + 1)
    sat_prompts = make_prompts(vocab, a.num_prompts, a.input_len, a.seed + 2)
    ray.init(include_dashboard=False, log_to_driver=False, num_cpus=max(4, os.cpu_count() or 1))
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name="bench", route_prefix="/")
    url = f"http://127.0.0.1:{port}/v1"

    def serve_run(prompts, output_len, rate, concurrency, name):
        return asyncio.run(
            run_http(
                url, "bench", prompts, output_len, rate, a.burstiness, concurrency, a.seed, name
            )
        )

    try:
        run_offline(engine, low_prompts[:2], 4, 1, "warmup offline")
        serve_run(low_prompts[:2], 4, float("inf"), 1, "warmup serve")
        # Low load: request by request, alternating paths, so TTFTs can be compared pairwise.
        offline_low, serve_low = [], []
        for i, prompt in enumerate(low_prompts):
            offline_low.append(
                run_offline(engine, [prompt], a.output_len, 1, f"offline low load #{i}")
            )
            serve_low.append(
                serve_run([prompt], a.output_len, float("inf"), 1, f"serve low load #{i}")
            )
        # Saturation: rounds in alternating order (offline first, then Serve first, ...).
        offline_sat, serve_sat = [], []
        for r in range(a.rounds):
            for path in ("offline", "serve") if r % 2 == 0 else ("serve", "offline"):
                before = cpu_by_kind()
                if path == "offline":
                    rep = run_offline(
                        engine,
                        sat_prompts,
                        a.output_len,
                        a.max_concurrency,
                        f"offline saturation #{r}",
                    )
                    rep.cpu = {"engine": cpu_delta(before, cpu_by_kind())["client"]}
                    offline_sat.append(rep)
                else:
                    rep = serve_run(
                        sat_prompts,
                        a.output_len,
                        a.request_rate,
                        a.max_concurrency,
                        f"serve saturation #{r}",
                    )
                    rep.cpu = cpu_delta(before, cpu_by_kind())
                    serve_sat.append(rep)
    finally:
        serve.shutdown()
        ray.shutdown()
        engine.shutdown()

    reports = [
        merged("offline low load", offline_low),
        merged("serve low load", serve_low),
        merged("offline saturation", offline_sat),
        merged("serve saturation", serve_sat),
    ]
    summaries = [r.summary(*slo) for r in reports]
    print("\nlow load (one request at a time)")
    print_summary(summaries[0])
    print_summary(summaries[1])
    print(
        "\nsaturation"
        + (" (all at once)" if a.request_rate == float("inf") else f" ({a.request_rate} req/s)")
    )
    print_summary(summaries[2])
    print_summary(summaries[3])
    paired = [s.results[0].ttft - o.results[0].ttft for o, s in zip(offline_low, serve_low)]
    ttft_added = 1000 * statistics.median(paired)
    kept = (
        summaries[3]["output_tok_s"] / summaries[2]["output_tok_s"]
        if summaries[2]["output_tok_s"]
        else 0.0
    )
    for summary in summaries[2:]:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in summary["cpu_s"].items())
        print(
            f"  CPU seconds, {summary['name']}: {parts} ({summary['cpu_s_per_1k_tokens']:.2f} per "
            "1k output tokens)"
        )
    print(
        f"\nServe stack overhead: median TTFT +{ttft_added:.1f} ms at low load, paired request by "
        "request "
        f"(target <= 30 ms); throughput at saturation {100 * kept:.1f}% of the offline engine "
        "(target >= 90%)"
    )
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(
            json.dumps(
                {
                    "args": vars(a),
                    "summaries": summaries,
                    "ttft_added_ms": ttft_added,
                    "ttft_added_paired_ms": [1000 * x for x in paired],
                    "throughput_kept": kept,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
