"""Prefill throughput: the Triton backend's varlen paged-prefill kernel against its previous
path, one SDPA call per prefill chunk (the context gathered and masked when part of it is cached).

Llama 3.2 1B attention shapes (bf16, 32 query / 8 KV heads, head size 64, 16-token blocks):
1. Attention alone, one layer's forward on a whole step: 8 fresh 2,048-token prompts, and 8
   512-token chunks that continue 1,536 cached tokens (a prefix hit or chunked prefill). Each
   kernel output is checked against the SDPA path (max abs difference), then a few tile shapes of
   the kernel are timed.
2. The engine (random-weight Llama-3.2-1B checkpoint written here): wall time of prefilling 8 x
   2,048-token prompts (max_tokens=1), all in one step (budget 16,384) and chunked (budget 1,536),
   with the switch `TritonBackend.varlen_prefill` flipped on the live engine.

Needs torch, triton and transformers (no Ray, flash-attn, gguf or FastAPI).

    python bench/prefill_gpu.py                 # CUDA, about a minute on an H200
    python bench/prefill_gpu.py --smoke         # CPU, Triton's interpreter, tiny shapes
    python bench/prefill_gpu.py --json out.json

The GPU check in one line (kernel parity tests compiled, the backend in the engine against HF
greedy tokens with the torch backend as control, then this benchmark; about 4 minutes on an H200):

    python -m pytest -q -p no:cacheprovider tests/workers/test_triton_prefill.py
    tests/workers/test_attention.py tests/workers/test_backend_choice.py 2>&1 | tail -15;
    python -m pytest -q -p no:cacheprovider tests/workers/test_cuda.py -k greedy_matches_hf 2>&1 |
    tail -15; python bench/prefill_gpu.py --json "${OUT:-/tmp}/prefill_gpu.json"
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # before triton is imported (tests/workers/triton_env.py says why)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_bench import GiB, make_llm, release
from scheduler import SamplingParams
from tests.random_checkpoint import SHAPES, random_prompts, write_random_checkpoint
from workers.layers.attention import AttentionMetadata, AttentionParams, LayerKV, write_kv
from workers.layers.backends.triton_prefill import (
    PrefillTiles,
    TritonBackend,
    default_tiles,
)

PARITY_TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4}
# Tile shapes timed beside the default (rows = (token, query head) pairs, keys, warps, stages).
TILE_SWEEP = (
    PrefillTiles(128, 64, 8, 3),
    PrefillTiles(64, 64, 4, 3),
    PrefillTiles(128, 32, 4, 3),
    PrefillTiles(128, 128, 8, 2),
)


@dataclasses.dataclass(frozen=True)
class Heads:
    hq: int
    hk: int
    d: int
    block_size: int
    dtype: torch.dtype


@dataclasses.dataclass
class Step:
    """One step's attention inputs, K/V of the step already in the cache."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    flops: float  # 4 * D * Hq per (query, key) pair the causal mask allows


def make_step(heads: Heads, requests: list[tuple[int, int]], device: str) -> Step:
    """(cached, new) tokens per request; blocks scattered over the cache as a served pool's."""
    gen = torch.Generator().manual_seed(0)
    bs = heads.block_size
    per_req = [-(-(c + n) // bs) for c, n in requests]
    free = torch.randperm(sum(per_req) + 1, generator=gen).tolist()
    tables = [[free.pop() for _ in range(b)] for b in per_req]
    shape = (sum(per_req) + 1, bs, heads.hk, heads.d)
    dev = torch.device(device)
    k_cache = torch.randn(shape, device=dev, dtype=heads.dtype)
    v_cache = torch.randn_like(k_cache)
    tokens = sum(n for _, n in requests)
    q = torch.randn(tokens, heads.hq, heads.d, device=dev, dtype=heads.dtype)
    k = torch.randn(tokens, heads.hk, heads.d, device=dev, dtype=heads.dtype)
    v = torch.randn_like(k)
    meta, _ = AttentionMetadata.build(
        [c for c, _ in requests], [n for _, n in requests], tables, bs, dev
    )
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    pairs = sum(n * c + n * (n + 1) // 2 for c, n in requests)
    return Step(q, k, v, k_cache, v_cache, meta, 4.0 * heads.d * heads.hq * pairs)


def timer(device: str) -> Callable[[Callable[[], object], int], float]:
    """Milliseconds per call: CUDA events on a GPU (after a warm-up call), wall time on CPU."""

    def cuda_ms(fn: Callable[[], object], reps: int) -> float:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps

    def cpu_ms(fn: Callable[[], object], reps: int) -> float:
        fn()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) / reps * 1e3

    return cuda_ms if device == "cuda" else cpu_ms


def run_backend(backend: TritonBackend, step: Step) -> Callable[[], torch.Tensor]:
    """One layer's attention forward of the step (prepare, once per step, done here)."""
    meta = dataclasses.replace(step.meta, backend_state=None)
    backend.prepare(meta)
    kv = LayerKV(step.k_cache, step.v_cache, AttentionParams(step.q.shape[-1] ** -0.5))
    return lambda: backend.forward(step.q, step.k, step.v, meta, kv)


def bench_attention(heads: Heads, workloads: dict, device: str, reps: int, sweep) -> list[dict]:
    ms = timer(device)
    rows = []
    for name, requests in workloads.items():
        step = make_step(heads, requests, device)
        tokens = step.q.shape[0]
        kernel = TritonBackend()
        sdpa = TritonBackend(varlen_prefill=False)
        new_fn, old_fn = run_backend(kernel, step), run_backend(sdpa, step)
        diff = (new_fn().float() - old_fn().float()).abs().max().item()
        t_old = ms(old_fn, reps)
        row = dict(workload=name, tokens=tokens, max_abs_diff=diff, sdpa_ms=t_old, tiles={})
        for tiles in (None, *sweep):
            kernel.tiles = tiles
            label = str(
                dataclasses.astuple(tiles or default_tiles(heads.d, heads.dtype, step.q.device))
            )
            try:
                row["tiles"][label] = ms(run_backend(kernel, step), reps)
            except Exception as e:  # a swept shape may not fit (shared memory): say so, go on
                if tiles is None:
                    raise
                row["tiles"][label] = f"failed: {type(e).__name__}: {str(e)[:120]}"
        row["kernel_ms"] = next(iter(row["tiles"].values()))  # the default tiles
        timed = {k: v for k, v in row["tiles"].items() if isinstance(v, float)}
        row["best_tiles"] = min(timed, key=timed.__getitem__)
        row["tflops"] = step.flops / (row["kernel_ms"] / 1e3) / 1e12
        row["sdpa_tflops"] = step.flops / (t_old / 1e3) / 1e12
        rows.append(row)
        del step
    return rows


def print_attention(rows: list[dict], heads: Heads) -> None:
    tol = PARITY_TOL[heads.dtype]
    print(
        f"\nAttention of one layer, one step: Hq {heads.hq}, Hk {heads.hk}, D {heads.d}, "
        f"block {heads.block_size}, {str(heads.dtype).removeprefix('torch.')}"
    )
    print(
        "| workload | tokens | varlen kernel (ms) | tok/s | TFLOP/s | per-request SDPA (ms) | "
        "tok/s | TFLOP/s | speed-up | max abs diff |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['workload']} | {r['tokens']} | {r['kernel_ms']:.3f} | "
            f"{r['tokens'] / r['kernel_ms'] * 1e3:,.0f} | {r['tflops']:.1f} | "
            f"{r['sdpa_ms']:.3f} | {r['tokens'] / r['sdpa_ms'] * 1e3:,.0f} | "
            f"{r['sdpa_tflops']:.1f} | {r['sdpa_ms'] / r['kernel_ms']:.2f}x | "
            f"{r['max_abs_diff']:.2e} |"
        )
    for r in rows:
        sweep = ", ".join(
            f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}" for k, v in r["tiles"].items()
        )
        print(f"tiles (block_m, tile_n, warps, stages) -> ms, {r['workload']}: {sweep}")
    worst = max(r["max_abs_diff"] for r in rows)
    verdict = "OK" if worst <= tol else "FAILED"
    print(f"parity: max |varlen kernel - SDPA| = {worst:.2e} (tolerance {tol:g}): {verdict}")


def bench_engine(path: str, vocab: int, budgets: tuple[int, ...], reps: int) -> list[dict]:
    """Wall time of prefilling 8 x 2,048-token prompts (max_tokens=1), both prefill paths on one
    engine per token budget, alternating; fresh prompts every time (prefix caching off)."""
    rows = []
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    seed = 100
    for budget in budgets:
        llm = make_llm(
            path,
            enforce_eager=True,  # prefill steps are never graphed; skip capturing decode
            enable_prefix_caching=False,
            max_num_seqs=8,
            max_num_batched_tokens=budget,
            max_model_len=4096,
            num_gpu_blocks=8 * 2048 // 16 + 64,
        )
        backend = llm.engine.executor.runner.backend
        times: dict[bool, list[float]] = {True: [], False: []}
        for rep in range(reps + 1):  # the first round warms up (Triton compiles)
            for varlen in (True, False):
                backend.varlen_prefill = varlen
                seed += 1
                prompts = random_prompts(8, vocab, 2048, 2048, seed=seed)
                torch.cuda.synchronize()
                t = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                torch.cuda.synchronize()
                if rep:
                    times[varlen].append(time.perf_counter() - t)
        release(llm)
        new, old = statistics.median(times[True]), statistics.median(times[False])
        rows.append(dict(budget=budget, tokens=8 * 2048, varlen_s=new, sdpa_s=old))
    return rows


def print_engine(rows: list[dict]) -> None:
    print("\nEngine prefill, Llama-3.2-1B shape (random weights), bf16, 8 x 2,048-token prompts")
    print("| token budget | varlen kernel (s) | tok/s | per-request SDPA (s) | tok/s | speed-up |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['budget']} | {r['varlen_s']:.3f} | {r['tokens'] / r['varlen_s']:,.0f} | "
            f"{r['sdpa_s']:.3f} | {r['tokens'] / r['sdpa_s']:,.0f} | "
            f"{r['sdpa_s'] / r['varlen_s']:.2f}x |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny shapes")
    parser.add_argument("--no-engine", action="store_true", help="attention only")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result: dict = {"torch": torch.__version__}
    started = time.perf_counter()
    if args.smoke:
        device, reps, sweep = "cpu", 1, (PrefillTiles(16, 16, 1, 1),)
        heads = Heads(4, 2, 16, 16, torch.float16)
        workloads = {"fresh 2 x 40": [(0, 40)] * 2, "2 x 16 after 32 cached": [(32, 16)] * 2}
    else:
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU (or --smoke)")
        props = torch.cuda.get_device_properties(0)
        result["gpu"] = props.name
        print(f"GPU: {props.name}, {props.total_memory / GiB:.0f} GiB, torch {torch.__version__}")
        device, reps, sweep = "cuda", args.reps, TILE_SWEEP
        heads = Heads(32, 8, 64, 16, torch.bfloat16)
        workloads = {
            "fresh 8 x 2048": [(0, 2048)] * 8,
            "8 x 512 after 1536 cached": [(1536, 512)] * 8,
        }
    result["attention"] = bench_attention(heads, workloads, device, reps, sweep)
    print_attention(result["attention"], heads)
    if args.smoke or args.no_engine:
        print("\nengine: skipped" + (" (needs CUDA)" if args.smoke else ""))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            spec = SHAPES["llama3-1b"]
            path = write_random_checkpoint(spec, os.path.join(tmp, "llama3-1b"), device="cuda")
            result["engine"] = bench_engine(path.path, path.vocab_size, (16384, 1536), reps=2)
        print_engine(result["engine"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(f"\nprefill_gpu: done in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
