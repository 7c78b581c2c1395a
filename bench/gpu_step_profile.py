"""Where a GPU decode step's time goes: kernels per step, their device time, and the host's share.

The H200 run of 2026-11-26 put the bf16 Llama-3.2-1B decode step at batch 1 at 25% of its
bandwidth floor, and the 1B step (16 layers) above an 8B shape cut to 8 layers: a fixed cost per
layer, not bytes, sets the step. This script says which one: per format and batch it serves
`batch` requests of --context-token prompts on a random checkpoint written here, then
- times the engine step (wall), the graph-replayed forward alone and the host work around it;
- profiles a few steps with and without CUDA graphs (torch.profiler, CUDA activity) and prints the
  kernels per step grouped by name, with their device time per step.

Needs torch and transformers only (no Ray, flash-attn, gguf or FastAPI).

    python bench/gpu_step_profile.py                   # CUDA, about a minute
    python bench/gpu_step_profile.py --formats bf16 fp8 --batches 1 64
    python bench/gpu_step_profile.py --smoke           # CPU, a tiny shape, end to end
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.quant_gpu import SMOKE, _sync, decode_ms, make_llm, write_models
from tests.random_checkpoint import SHAPES


def _is_counted(event, device: str) -> bool:
    """CUDA: every kernel. CPU: every aten op not called from inside another aten op (the ops the
    model dispatches, each paying dispatch once)."""
    if device == "cuda":
        return event.device_type == torch.autograd.DeviceType.CUDA
    if not event.name.startswith("aten::"):
        return False
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return False
        parent = parent.cpu_parent
    return True


def kernel_table(
    prof, steps: int, top: int, device: str
) -> tuple[int, float, list[tuple[str, float, float]]]:
    """(kernels or ops per step, their ms per step, [(name, count per step, ms per step)])."""
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if not _is_counted(event, device):
            continue
        entry = by_name[event.name[:70]]
        entry[0] += 1
        us = event.device_time_total if device == "cuda" else event.cpu_time_total
        entry[1] += us / 1e3
    rows = sorted(
        ((n, c / steps, ms / steps) for n, (c, ms) in by_name.items()), key=lambda r: -r[2]
    )
    return round(sum(r[1] for r in rows)), sum(r[2] for r in rows), rows[:top]


def profile_steps(llm, vocab: int, batch: int, context: int, steps: int, device: str):
    """Profile `steps` pure decode steps after the warm-up decode_ms runs; returns the profiler."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    holder = {}

    def timed_steps(engine, n):
        with profile(activities=activities) as prof:
            for _ in range(n):
                engine.step()
            _sync(device)
        holder["prof"] = prof

    decode_ms(llm, vocab, batch, context, 2, device, after_warm=lambda e: timed_steps(e, steps))
    return holder["prof"]


def forward_ms(llm, batch: int, device: str) -> float | None:
    """Device time of one graph replay at `batch` rows (None without graphs)."""
    runner = llm.engine.executor.runner
    graphs = getattr(runner, "graphs", None)
    if graphs is None or device != "cuda":
        return None
    size = next(s for s in graphs.sizes if s >= batch)
    graph = graphs.graphs[size]
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 50


def report(name, fmt, eager, llm, config, args, batch) -> None:
    step = decode_ms(llm, config.vocab_size, batch, args.context, args.steps, args.device)
    fwd = None if eager else forward_ms(llm, batch, args.device)
    prof = profile_steps(llm, config.vocab_size, batch, args.context, 5, args.device)
    count, device_ms, rows = kernel_table(prof, 5, args.top, args.device)
    mode = "eager" if eager else "graphs"
    unit = "kernels" if args.device == "cuda" else "top-level aten ops"
    fwd_text = f", graph replay {fwd:.3f} ms" if fwd is not None else ""
    print(
        f"\n{name} {fmt} {mode} batch {batch}: engine step {step:.3f} ms{fwd_text}; "
        f"profiled: {count} {unit} per step, {device_ms:.3f} ms in them per step"
    )
    for kernel, per_step, ms in rows:
        print(f"    {per_step:6.1f} x  {ms:7.3f} ms  {kernel}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--formats", nargs="+", default=["bf16"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--modes", nargs="+", default=["graphs", "eager"], choices=["graphs", "eager"]
    )
    parser.add_argument("--tmp", default=None)
    args = parser.parse_args()
    if args.smoke:
        args.device, spec, args.context, args.steps, args.batches = "cpu", SMOKE, 32, 3, [1, 4]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --smoke on CPU")
        args.device, spec = "cuda", SHAPES["llama3-1b"]
    import tempfile

    with tempfile.TemporaryDirectory(dir=args.tmp) as root:
        paths = write_models(spec, root, args.device)
        for fmt in args.formats:
            config = AutoConfig.from_pretrained(paths[fmt])
            for eager in (mode == "eager" for mode in args.modes):
                llm = make_llm(
                    paths[fmt],
                    fmt,
                    args.device,
                    max(args.batches),
                    args.context,
                    args.steps + 8,
                    enforce_eager=eager,
                )
                t = time.perf_counter()
                for batch in args.batches:
                    report("llama3-1b", fmt, eager, llm, config, args, batch)
                print(f"  ({time.perf_counter() - t:.0f} s)", flush=True)
                llm.shutdown()
                del llm
                gc.collect()
                if args.device == "cuda":
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
