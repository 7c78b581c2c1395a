"""Decode-step profiler: per-op breakdown and the step time against GEMM rooflines from the same
run.

Builds a ModelRunner on the embedded SmolLM2-135M, fills the KV cache tables of `--batch` requests
with contexts of `--context` tokens (uniform, fixed seed) and times one decode step (forward plus
logits). Two rooflines, both measured here and now: the step's own linear GEMMs (same M, K, N,
timed alone through the same `linear` path the model takes, with its CPU-packed weights) and the
step's FLOPs at a large square GEMM's rate. Per shape it also times the unpacked `linear` (W @ x^T
for few rows) and plain F.linear, interleaved, so the reader sees what packing buys; the packed
path once more over as many distinct weights as the step has (weights cold, streamed from memory
as in a real step, where a reused weight stays in cache); and the layer shapes at `--prefill-rows`
rows (a prefill chunk; logits are taken for few rows only).

    python bench/step_profile.py [--batch 32] [--context 150,200] [--dtype float32] [--repeats 10]
    [--threads N]
                                 [--prefill-rows 2048] [--ab-rounds 0]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections import Counter

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from transformers import AutoConfig

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from engine.config import EngineConfig
from workers.layers.linear import CpuPackedWeight, cpu_pack, linear
from workers.model_files import resolve_model
from workers.runner import DTYPES, ModelRunner, RequestState, _Batch


def build_runner(
    dtype: str, batch: int, ctx: tuple[int, int], seed: int = 7, quantization: str = "none"
) -> tuple[ModelRunner, _Batch]:
    """A runner whose requests sit one token before their end: the next step is a pure decode.
    quantization `gguf` keeps the embedded model's GGUF blocks (the C++ block kernel)."""
    engine = EngineConfig(
        dtype=dtype,
        device="cpu",
        kv_cache_memory_gb=0.5,
        load_progress=False,
        quantization=quantization,
    )
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
        runner.requests[rid] = RequestState(
            [rng.randrange(1000) for _ in range(n)], blocks, n - 1, None
        )
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


# How each GEMM is timed: the model's path (packed weight), the unpacked `linear`, plain F.linear,
# each on one weight that stays in cache; and the model's path over as many distinct weights as the
# step has layers of that shape, so weights stream from memory as they do in the step ("cold").
PATHS = ("packed", "unpacked", "F.linear", "packed cold")


def time_paths(
    m: int, k: int, n: int, count: int, dtype: torch.dtype, repeats: int
) -> dict[str, float]:
    """Best seconds of one (m, k, n) GEMM along each path, the paths interleaved over two rounds."""
    x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    packed = cpu_pack(w)
    cold = [(v, cpu_pack(v)) for v in torch.randn(count, n, k, dtype=dtype)]
    fns = {
        "packed": lambda: linear(x, w, packed=packed),
        "unpacked": lambda: linear(x, w),
        "F.linear": lambda: F.linear(x, w),
        "packed cold": lambda: [linear(x, v, packed=p) for v, p in cold],
    }
    per_call = {"packed cold": count}
    best = dict.fromkeys(PATHS, float("inf"))
    for _ in range(2):
        for path in PATHS:
            best[path] = min(best[path], best_time(fns[path], repeats) / per_call.get(path, 1))
    return best


def gemm_roofline(
    shapes: Counter, dtype: torch.dtype, repeats: int
) -> tuple[dict[str, float], float]:
    """Seconds per path for the step's GEMMs timed alone at their own shapes, and their total
    FLOPs."""
    totals, total_flop = dict.fromkeys(PATHS, 0.0), 0.0
    for (m, k, n), count in sorted(shapes.items()):
        best = time_paths(m, k, n, count, dtype, repeats)
        for path in PATHS:
            totals[path] += count * best[path]
        total_flop += count * 2.0 * m * k * n
        print(
            f"  GEMM {m:5d} x {k:5d} x {n:6d} (x{count:2d})  "
            + "  ".join(f"{path} {best[path] * 1e3:8.3f} ms" for path in PATHS),
            flush=True,
        )
    return totals, total_flop


def packing_ab(runner: ModelRunner, step: _Batch, rounds: int) -> tuple[list[float], list[float]]:
    """Step seconds with the packed weights and with them set aside (the unpacked path), alternating
    in rounds of three steps, so both see the same machine load."""
    layers = [m for m in runner.model.modules() if isinstance(m, CpuPackedWeight)]
    packed = [m.packed for m in layers]
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for _ in range(rounds):
            for use in (True, False):
                for m, p in zip(layers, packed):
                    m.packed = p if use else None
                runner._forward(step)
                for _ in range(3):
                    t0 = time.perf_counter()
                    runner._forward(step)
                    times[use].append(time.perf_counter() - t0)
    finally:
        for m, p in zip(layers, packed):
            m.packed = p
    return times[True], times[False]


def square_rate(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2.0 * n**3 / best_time(lambda: a @ b, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", default="150,200", help="min,max context tokens per request")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--top", type=int, default=12, help="ops shown in the breakdown")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--ab-rounds",
        type=int,
        default=0,
        help="also time the step packed vs unpacked, alternating, this many rounds",
    )
    parser.add_argument(
        "--prefill-rows", type=int, default=2048, help="rows of the prefill GEMM table (0: none)"
    )
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
        print(f"own-shape GEMMs, batch {args.batch}, best of {args.repeats} (x: per step):")
        own, flop = gemm_roofline(shapes, dtype, args.repeats)
        if args.prefill_rows:
            print(f"layer GEMMs at {args.prefill_rows} rows (a prefill chunk), best of 3:")
            layers = Counter(
                {
                    (args.prefill_rows, k, n): c
                    for (_, k, n), c in shapes.items()
                    if n != hf.vocab_size
                }
            )
            prefill, prefill_flop = gemm_roofline(layers, dtype, 3)
        if args.ab_rounds:
            ab_packed, ab_unpacked = packing_ab(runner, step, args.ab_rounds)
    rate = square_rate(dtype)
    step_s = statistics.median(step_times)
    own_s = own["packed"]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
        f"batch {args.batch}, context {lo}-{hi}"
    )
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    print(
        f"step median       {step_s * 1e3:8.1f} ms  (min {min(step_times) * 1e3:.1f}, "
        f"{args.repeats} runs)"
    )
    print(
        f"step GEMMs alone  {own_s * 1e3:8.1f} ms  -> step is {step_s / own_s:.2f}x its own-shape "
        "roofline"
    )
    print(
        f"  weights cold    {own['packed cold'] * 1e3:8.1f} ms  -> step is "
        f"{step_s / own['packed cold']:.2f}x "
        f"its own GEMMs with weights streamed from memory"
    )
    print(
        f"step FLOPs        {flop / 1e9:8.2f} GFLOP at {rate / 1e9:.0f} GFLOP/s (2048^2 GEMM) = "
        f"{flop / rate * 1e3:.1f} ms -> step is {step_s / (flop / rate):.2f}x the large-GEMM bound"
    )
    print(
        "own-shape GEMMs   "
        + ", ".join(
            f"{path} {own[path] * 1e3:.1f} ms ({flop / own[path] / 1e9:.0f} GFLOP/s)"
            for path in PATHS
        )
    )
    if args.ab_rounds:
        p, u = statistics.median(ab_packed), statistics.median(ab_unpacked)
        print(
            f"step A/B          packed {p * 1e3:.1f} ms (min {min(ab_packed) * 1e3:.1f}), "
            f"unpacked {u * 1e3:.1f} ms "
            f"(min {min(ab_unpacked) * 1e3:.1f}) -> unpacked / packed {u / p:.2f}x median, "
            f"{min(ab_unpacked) / min(ab_packed):.2f}x min"
        )
    if args.prefill_rows:
        print(
            f"prefill GEMMs     {args.prefill_rows} rows: "
            + ", ".join(
                f"{path} {prefill[path] * 1e3:.1f} ms ({prefill_flop / prefill[path] / 1e9:.0f} "
                "GFLOP/s)"
                for path in PATHS
            )
        )


if __name__ == "__main__":
    main()
