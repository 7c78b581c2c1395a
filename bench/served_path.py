"""Where a served token's time goes: deploy.yaml's app against its own engine, offline.

Starts the app as deploy.yaml ships it (Serve on 127.0.0.1, this process's own Ray cluster),
streams `--concurrency` completions at once (random `--input-len`-token prompts, `--output-len`
tokens, greedy, ignore_eos) with an async HTTP client that stamps every chunk's arrival, and
reads at the same time the replica's engine-loop figures (steps, seconds inside step()) and each
Serve process's CPU time. Then runs the same workload through an EngineCore in this process
(the replica's settings, torch threads included) while the app idles. Prints:

  served ITL      per request (last token - first token) / (tokens - 1), GuideLLM's "ITL"; p50
                  and mean over requests; and the gaps between chunks
  served step     the replica's seconds inside step() / steps, and the engine thread's idle share
  offline step    the decode steps at the full batch, p50 and mean
  CPU ms/token    each Serve process (replica, ingress, proxy, controller) per generated token,
                  with the share its idle rate (nothing in flight) accounts for; the offline
                  engine's beside them
  ratio           served ITL p50 / offline step p50 (issue 53: <= 1.3 at concurrency 8)

  python bench/served_path.py                       # concurrency 8, then 1; 3 rounds each
  python bench/served_path.py --concurrency 8 --rounds 3 --py-spy /tmp/spy   # + flame graphs

Timings are printed, never asserted; the machine's load average is printed beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from bench.serve_bench import cpu_by_kind, cpu_delta

ROOT = Path(__file__).resolve().parents[1]
APP = "bench"  # the app name bench/serve_bench.py's CPU accounting knows


@dataclass(slots=True)
class Stream:
    """One streamed request as the client saw it: each text chunk's arrival, and the tokens the
    final usage counts."""

    start: float
    arrivals: list[float] = field(default_factory=list)
    num_tokens: int = 0

    def itl(self) -> float:
        """GuideLLM's ITL: the time from the first token to the last over the gaps between."""
        return (self.arrivals[-1] - self.arrivals[0]) / max(self.num_tokens - 1, 1)


async def one_stream(client, url: str, model: str, prompt: list[int], output_len: int) -> Stream:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    stream = Stream(time.perf_counter())
    async with client.stream("POST", f"{url}/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                stream.arrivals.append(now)
            if chunk.get("usage"):
                stream.num_tokens = chunk["usage"]["completion_tokens"]
    if stream.num_tokens != output_len:
        raise RuntimeError(f"{stream.num_tokens} tokens streamed, {output_len} asked")
    return stream


async def drive(url: str, model: str, prompts: list[list[int]], output_len: int) -> list[Stream]:
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        return list(
            await asyncio.gather(*(one_stream(client, url, model, p, output_len) for p in prompts))
        )


def app_args() -> dict:
    with open(ROOT / "deploy.yaml") as f:
        return yaml.safe_load(f)["applications"][0]["args"]


def make_prompts(vocab: int, num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab) for _ in range(length)] for _ in range(num)]


# ---- the offline engine ----------------------------------------------------------------------
def offline_steps(engine, prompts: list[list[int]], output_len: int) -> list[float]:
    """Durations of the steps that decode the whole batch (every prompt done)."""
    from scheduler import EngineRequest, SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"offline-{i}-{time.monotonic_ns()}", prompt, params))
    durations, started = [], set()
    while engine.has_unfinished_requests():
        begin = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - begin
        full = len(started) == len(prompts) and len(outputs) == len(prompts)
        if full and not any(o.finished for o in outputs):
            durations.append(elapsed)
        started.update(o.request_id for o in outputs if o.new_token_ids)
    return durations


# ---- one served round ---------------------------------------------------------------------------
def engine_figures(handle) -> dict:
    return handle.stats.remote().result().get("engine_loop")  # None before this bench's commit


def nice_by_kind() -> dict[str, int]:
    """Each Serve process's nice value (the proxy's is Ray's 15 unless the ingress moved it)."""
    import psutil

    from bench.serve_bench import _KINDS, _our_raylets

    nices = {}
    for proc in _our_raylets()[0].children(recursive=True):
        cmd = " ".join(proc.cmdline())
        kind = next((k for marker, k in _KINDS.items() if marker in cmd), None)
        if kind is not None:
            nices[kind] = psutil.Process(proc.pid).nice()
    return nices


def idle_cpu_rate(seconds: float = 5.0) -> dict[str, float]:
    """CPU seconds per second each process burns with no request in flight (Serve's polls and
    metrics pushes)."""
    before = cpu_by_kind()
    time.sleep(seconds)
    return {k: v / seconds for k, v in cpu_delta(before, cpu_by_kind()).items()}


def served_round(url, model, handle, prompts, output_len, spy_dir, tag) -> dict:
    idle = idle_cpu_rate()
    loop_before, cpu_before = engine_figures(handle), cpu_by_kind()
    spies = start_spies(spy_dir, tag) if spy_dir else []
    begin = time.perf_counter()
    streams = asyncio.run(drive(url, model, prompts, output_len))
    wall = time.perf_counter() - begin
    for spy in spies:
        spy.wait(timeout=120)
    # The client's own CPU is this process's, the offline engine's too: left out.
    cpu = {k: v for k, v in cpu_delta(cpu_before, cpu_by_kind()).items() if k != "client"}
    loop_after = engine_figures(handle)
    steps = (loop_after or {}).get("steps", 0) - (loop_before or {}).get("steps", 0)
    busy = (loop_after or {}).get("step_s", 0.0) - (loop_before or {}).get("step_s", 0.0)
    tokens = sum(s.num_tokens for s in streams)
    gaps = [b - a for s in streams for a, b in zip(s.arrivals, s.arrivals[1:])]
    return {
        "itl": [s.itl() for s in streams],
        "chunk_gap_p50": statistics.median(gaps) if gaps else 0.0,
        "tokens_per_chunk": tokens / sum(len(s.arrivals) for s in streams),
        "served_step": busy / steps if steps else 0.0,
        "engine_idle": max(0.0, 1 - busy / wall) if steps else float("nan"),
        "cpu_ms_per_token": {k: 1000 * v / tokens for k, v in cpu.items()},
        # What each process burns with nothing in flight (Serve's polls, metrics pushes), as the
        # share of the round's CPU: the rest is the tokens'.
        "idle_share": {k: min(1.0, idle.get(k, 0.0) * wall / v) for k, v in cpu.items() if v},
        "tok_s": tokens / wall,
        "load": os.getloadavg()[0],
        "nice": nice_by_kind(),
    }


def start_spies(spy_dir: str, tag: str) -> list[subprocess.Popen]:
    """py-spy record of the replica and the ingress for the round (8 s, from its start)."""

    from bench.serve_bench import _our_raylets

    spies = []
    for proc in _our_raylets()[0].children(recursive=True):
        cmd = " ".join(proc.cmdline())
        for marker in ("LLMReplica", "OpenAIIngress"):
            if f"ServeReplica:{APP}:{marker}" in cmd:
                out = Path(spy_dir) / f"{tag}-{marker}.txt"
                spies.append(
                    subprocess.Popen(
                        [str(Path(sys.executable).parent / "py-spy"), "record", "--pid"]
                        + [str(proc.pid), "--duration", "8", "--rate", "200", "--format", "raw"]
                        + ["--threads", "--nonblocking", "-o", str(out)],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
    return spies


# ---- main -----------------------------------------------------------------------------------
def summarise(rounds: list[dict], offline: list[float]) -> dict:
    itls = [statistics.median(r["itl"]) for r in rounds]
    kinds = sorted({k for r in rounds for k in r["cpu_ms_per_token"]})
    return {
        "served_itl_p50_ms": 1000 * statistics.median(itls),
        "served_itl_mean_ms": 1000 * statistics.median(statistics.fmean(r["itl"]) for r in rounds),
        "chunk_gap_p50_ms": 1000 * statistics.median(r["chunk_gap_p50"] for r in rounds),
        "tokens_per_chunk": statistics.median(r["tokens_per_chunk"] for r in rounds),
        "served_step_ms": 1000 * statistics.median(r["served_step"] for r in rounds),
        "engine_idle": statistics.median(r["engine_idle"] for r in rounds),
        "offline_step_p50_ms": 1000 * statistics.median(offline),
        "offline_step_mean_ms": 1000 * statistics.fmean(offline),
        "cpu_ms_per_token": {
            k: statistics.median(r["cpu_ms_per_token"].get(k, 0.0) for r in rounds) for k in kinds
        },
        "idle_share": {
            k: statistics.median(r["idle_share"].get(k, 0.0) for r in rounds) for k in kinds
        },
        "tok_s": statistics.median(r["tok_s"] for r in rounds),
        "load": [round(r["load"], 2) for r in rounds],
        "nice": rounds[-1]["nice"],
    }


def report(concurrency: int, s: dict) -> None:
    ratio = s["served_itl_p50_ms"] / s["offline_step_p50_ms"]
    cpu = ", ".join(
        f"{k} {v:.2f} ({100 * s['idle_share'].get(k, 0.0):.0f}% idle rate)"
        for k, v in s["cpu_ms_per_token"].items()
    )
    print(
        f"concurrency {concurrency}: served ITL p50 {s['served_itl_p50_ms']:.1f} ms "
        f"(mean {s['served_itl_mean_ms']:.1f}), {s['tok_s']:.0f} tok/s; chunk gap p50 "
        f"{s['chunk_gap_p50_ms']:.1f} ms at {s['tokens_per_chunk']:.2f} tokens/chunk\n"
        f"  served step {s['served_step_ms']:.1f} ms, "
        f"engine thread idle {100 * s['engine_idle']:.0f}%"
        f"; offline step at batch {concurrency} p50 {s['offline_step_p50_ms']:.1f} ms "
        f"(mean {s['offline_step_mean_ms']:.1f})\n"
        f"  served ITL / offline step: {ratio:.2f}x\n"
        f"  CPU ms per token: {cpu}\n"
        f"  load average (1 min) per round: {s['load']}; nice: {s['nice']}",
        flush=True,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 1])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--py-spy", default=None, help="folder for py-spy raw profiles of round 0")
    p.add_argument("--json", default=None)
    p.add_argument("--set", action="append", default=[], help="override a deploy.yaml arg: k=v")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    import ray
    import torch
    from ray import serve

    from deploy.app import build_app
    from deploy.config import AppConfig
    from engine.core import EngineCore
    from workers.distributed import free_port

    args = app_args()
    for kv in a.set:
        key, value = kv.split("=", 1)
        args[key] = yaml.safe_load(value)
    engine_config = AppConfig.from_args(args).engine
    torch.set_num_threads(engine_config.cpu_threads or 1)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name=APP, route_prefix="/")
    url, model = f"http://127.0.0.1:{port}/v1", args["served_model_name"]
    handle = serve.get_deployment_handle("LLMReplica", APP)
    results = {}
    try:
        engine = EngineCore(engine_config)
        vocab = engine.vocab_size
        asyncio.run(drive(url, model, make_prompts(vocab, 2, a.input_len, 99), 8))  # warm-up
        offline_steps(engine, make_prompts(vocab, 2, a.input_len, 98), 8)
        for c in a.concurrency:
            rounds, offline, offline_cpu = [], [], []
            for r in range(a.rounds):
                prompts = make_prompts(vocab, c, a.input_len, 1000 * c + r)
                spy = a.py_spy if r == 0 else None
                rounds.append(served_round(url, model, handle, prompts, a.output_len, spy, f"c{c}"))
                cpu_before = time.process_time()
                offline += offline_steps(engine, prompts, a.output_len)
                offline_cpu.append((time.process_time() - cpu_before) / (c * a.output_len))
            results[c] = summarise(rounds, offline)
            results[c]["cpu_ms_per_token"]["offline engine"] = 1000 * statistics.median(offline_cpu)
            report(c, results[c])
        engine.shutdown()
    finally:
        serve.shutdown()
        ray.shutdown()
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "results": results}, indent=2))


if __name__ == "__main__":
    main()
