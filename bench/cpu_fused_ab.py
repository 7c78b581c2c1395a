"""CPU decode step with the fused C++ layer ops against the torch path, same process, alternating.

For each quantization (`none`: fp32 weights; `gguf`: the embedded file's blocks kept quantized)
and batch size, builds a runner on the embedded SmolLM2-135M whose requests sit one token before
their end (bench/step_profile.py's `build_runner`), then:
- counts the profiler's ops per decode step (forward plus logits), fused and torch path, with the
  most frequent ops of each;
- times the step in rounds that alternate the two paths (`--rounds` rounds of `--steps` steps
  each), so both see the same machine load, and reports medians and their ratio.

The machine's load average is printed with every figure: on a shared machine only same-run ratios
compare.

    python bench/cpu_fused_ab.py [--threads 2] [--batch 1,8] [--quantization gguf,none]
                                 [--rounds 10] [--steps 5] [--top 12]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from bench.step_profile import build_runner
from workers.layers.fused import cpu_fused_off

PATHS = ("fused", "torch")


def op_counts(forward, steps: int) -> tuple[Counter, float]:
    """Profiler events per step by name (top-level and nested ops alike, as the profiler's table
    counts them), and the top-level ops per step (those called from Python, each paying the
    dispatch from Python once)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            forward()
    top = sum(1 for e in prof.events() if e.cpu_parent is None)
    return Counter({e.key: e.count / steps for e in prof.key_averages()}), top / steps


def run_path(path: str, fn):
    if path == "torch":
        with cpu_fused_off():
            return fn()
    return fn()


def measure(quantization: str, batch: int, args) -> None:
    runner, step = build_runner("float32", batch, (150, 200), quantization=quantization)
    forward = lambda: runner._forward(step)  # noqa: E731
    counts: dict[str, Counter] = {}
    top_level: dict[str, float] = {}
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    with torch.inference_mode():
        for path in PATHS:
            run_path(path, forward)  # warm: builds, caches
            counts[path], top_level[path] = run_path(path, lambda: op_counts(forward, 4))

        def timed() -> list[float]:
            out = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                forward()
                out.append(time.perf_counter() - t0)
            return out

        for _ in range(args.rounds):
            for path in PATHS:
                times[path].extend(run_path(path, timed))
    load = os.getloadavg()[0]
    med = {p: statistics.median(times[p]) for p in PATHS}
    total = {p: sum(counts[p].values()) for p in PATHS}
    print(
        f"\n== quantization {quantization}, batch {batch}, {torch.get_num_threads()} threads, "
        f"load {load:.2f} =="
    )
    for p in PATHS:
        print(
            f"  {p:5s}: step median {med[p] * 1e3:7.2f} ms (min {min(times[p]) * 1e3:6.2f}), "
            f"{total[p]:6.0f} ops/step ({top_level[p]:.0f} called from Python)"
        )
    print(
        f"  torch / fused: {med['torch'] / med['fused']:.2f}x median step, "
        f"{total['torch'] / total['fused']:.2f}x ops, "
        f"{top_level['torch'] / top_level['fused']:.2f}x ops called from Python"
    )
    for p in PATHS:
        top = ", ".join(f"{k} {v:.0f}" for k, v in counts[p].most_common(args.top))
        print(f"  {p} top ops/step: {top}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--quantization", default="gguf,none")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, load {os.getloadavg()}")
    for quantization in args.quantization.split(","):
        for batch in (int(b) for b in args.batch.split(",")):
            measure(quantization, batch, args)


if __name__ == "__main__":
    main()
