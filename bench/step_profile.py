"""Decode-step profiler: per-op breakdown and the step time against GEMM rooflines from the same run.

Builds a ModelRunner on the embedded SmolLM2-135M, fills the KV cache tables of `--batch` requests
with contexts of `--context` tokens (uniform, fixed seed) and times one decode step (forward plus
logits). Two rooflines, both measured here and now: the step's own linear GEMMs (same M, K, N,
timed alone through the same `linear` path) and the step's FLOPs at a large square GEMM's rate.

    python bench/step_profile.py [--batch 32] [--context 150,200] [--dtype float32] [--repeats 10] [--threads N]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoConfig

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from cluster.config import EngineConfig  # noqa: E402
from workers.layers.linear import linear  # noqa: E402
from workers.model_files import resolve_model  # noqa: E402
from workers.runner import DTYPES, ModelRunner, RequestState, _Batch  # noqa: E402


def build_runner(dtype: str, batch: int, ctx: tuple[int, int], seed: int = 7) -> tuple[ModelRunner, _Batch]:
    """A runner whose requests sit one token before their end: the next step is a pure decode."""
    engine = EngineConfig(dtype=dtype, device="cpu", kv_cache_memory_gb=0.5, load_progress=False)
    runner = ModelRunner(engine.runner_config(resolve_model("default"), max_model_len=4096))
    bs = runner.config.block_size
    rng = random.Random(seed)
    lengths = [rng.randint(*ctx) for _ in range(batch)]
    runner.init_kv_cache(sum(-(-n // bs) for n in lengths) + 1, 0)
    step, next_block = _Batch(), 0
    for i, n in enumerate(lengths):
        blocks = list(range(next_block, next_block + -(-n // bs)))
        next_block += len(blocks)
        rid = f"r{i}"
        runner.requests[rid] = RequestState([rng.randrange(1000) for _ in range(n)], blocks, n - 1, None)
        runner._add_to_batch(step, rid, runner.requests[rid], 1)
    return runner, step


def step_gemms(runner: ModelRunner, m: int, hidden: int, vocab: int) -> Counter:
    """(M, K, N) of every weight GEMM of one decode step (layers and logits), with multiplicity."""
    shapes: Counter = Counter()
    for module in runner.model.modules():
        w = getattr(module, "weight", None)
        if "Linear" in type(module).__name__ and isinstance(w, torch.Tensor) and w.dim() == 2:
            shapes[(m, w.shape[1], w.shape[0])] += 1
    shapes[(m, hidden, vocab)] += 1
    return shapes


def best_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def gemm_roofline(shapes: Counter, dtype: torch.dtype, repeats: int) -> tuple[float, float]:
    """Seconds for the step's GEMMs timed alone at their own shapes, and their total FLOPs."""
    total_s = total_flop = 0.0
    for (m, k, n), count in shapes.items():
        x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
        total_s += count * best_time(lambda: linear(x, w), repeats)
        total_flop += count * 2.0 * m * k * n
    return total_s, total_flop


def square_rate(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2.0 * n ** 3 / best_time(lambda: a @ b, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", default="150,200", help="min,max context tokens per request")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--top", type=int, default=12, help="ops shown in the breakdown")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lo, hi = (int(v) for v in args.context.split(","))
    runner, step = build_runner(args.dtype, args.batch, (lo, hi))
    hf = AutoConfig.from_pretrained(runner.config.model_dir)
    dtype = DTYPES[args.dtype]
    with torch.inference_mode():
        forward = lambda: runner._forward(step)  # noqa: E731
        forward()
        step_times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            forward()
            step_times.append(time.perf_counter() - t0)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                forward()
        shapes = step_gemms(runner, args.batch, hf.hidden_size, hf.vocab_size)
        own_s, flop = gemm_roofline(shapes, dtype, args.repeats)
    rate = square_rate(dtype)
    step_s = statistics.median(step_times)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
          f"batch {args.batch}, context {lo}-{hi}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    print(f"step median       {step_s * 1e3:8.1f} ms  (min {min(step_times) * 1e3:.1f}, {args.repeats} runs)")
    print(f"step GEMMs alone  {own_s * 1e3:8.1f} ms  -> step is {step_s / own_s:.2f}x its own-shape roofline")
    print(f"step FLOPs        {flop / 1e9:8.2f} GFLOP at {rate / 1e9:.0f} GFLOP/s (2048^2 GEMM) = "
          f"{flop / rate * 1e3:.1f} ms -> step is {step_s / (flop / rate):.2f}x the large-GEMM bound")
    print(f"own-shape GEMM rate {flop / own_s / 1e9:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
