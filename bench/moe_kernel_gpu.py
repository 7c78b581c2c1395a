"""The Triton fused-MoE kernel against the grouped-GEMM torch path of the same layer (issue 54,
item 4): parity and time per call, by batch, at two published MoE shapes.

One FusedMoE layer per shape (random bf16 experts, router logits drawn per batch): the torch path
is FusedMoE.experts with the kernel turned off (pairs sorted by expert, one host sync for the
counts, a GEMM pair per expert that has rows), the kernel is workers/layers/backends/triton_moe.py
(two grouped launches, no sync). Each call is timed by the wall clock over --reps calls after a
warm-up, synchronised (eager, as a prefill or mixed step runs it; the torch path's host sync is
part of its cost). The floor is the weight bytes of the experts the batch touches at the device
copy bandwidth measured in the same run.

Needs torch and triton only (no Ray, flash-attn, gguf or FastAPI).

    python bench/moe_kernel_gpu.py [--batches 1 8 64 256] [--reps 20] [--json out.json]
    python bench/moe_kernel_gpu.py --smoke      # CPU, tiny shape, the kernel interpreted
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # Triton's interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.quant_gpu import GiB, copy_bandwidth
from workers.layers.backends.triton_moe import fused_experts
from workers.layers.moe import FusedMoE, MoEConfig, route

SHAPES = {  # experts, top-k, hidden, intermediate per expert
    "qwen3-30b-a3b": MoEConfig(128, 8, 2048, 768, renormalize=True),
    "mixtral-8x7b": MoEConfig(8, 2, 4096, 14336, renormalize=True),
}
SMOKE = {"tiny": MoEConfig(8, 2, 64, 32, renormalize=True)}


@dataclass(slots=True)
class Row:
    shape: str
    batch: int
    torch_ms: float
    triton_ms: float
    floor_ms: float
    max_rel_diff: float  # kernel against the torch path, over the output's largest magnitude

    @property
    def speedup(self) -> float:
        return self.torch_ms / self.triton_ms


def make_layer(cfg: MoEConfig, device: str, dtype: torch.dtype) -> FusedMoE:
    with torch.device(device):  # no host copy of the experts first
        layer = FusedMoE(cfg)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for w in (layer.w13, layer.w2):
            w.data = torch.randn(w.shape, generator=gen, device=device).mul_(0.02).to(dtype)
    layer.fits_triton = False  # FusedMoE.experts is the torch path; the kernel is called directly
    return layer


def timed_ms(fn, device: str, reps: int) -> float:
    for _ in range(3):
        fn()
    _sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return (time.perf_counter() - t) / reps * 1e3


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def measure(name: str, cfg: MoEConfig, batch: int, layer: FusedMoE, args, bandwidth) -> Row:
    gen = torch.Generator(device=args.device).manual_seed(batch)
    x = torch.randn(batch, cfg.hidden_size, generator=gen, device=args.device).to(args.dtype)
    logits = torch.randn(batch, cfg.num_experts, generator=gen, device=args.device)
    weights, ids = route(logits, cfg)
    ref = layer.experts(x, weights, ids)
    out = fused_experts(x, layer.w13, layer.w2, weights, ids)
    diff = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
    touched = int(ids.unique().numel())
    expert_bytes = 3 * cfg.hidden_size * cfg.intermediate_size * layer.w13.element_size()
    return Row(
        shape=name,
        batch=batch,
        torch_ms=timed_ms(lambda: layer.experts(x, weights, ids), args.device, args.reps),
        triton_ms=timed_ms(
            lambda: fused_experts(x, layer.w13, layer.w2, weights, ids), args.device, args.reps
        ),
        floor_ms=touched * expert_bytes / bandwidth * 1e3,
        max_rel_diff=diff,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shape, interpreted kernel")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64, 256])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    shapes = SHAPES
    if args.smoke:  # the interpreter holds bfloat16 as raw bits (tests/workers/triton_env.py)
        args.device, args.dtype, args.batches, args.reps, shapes = (
            "cpu",
            torch.float16,
            [1, 8],
            2,
            SMOKE,
        )
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke on CPU")
    else:
        args.device, args.dtype = "cuda", torch.bfloat16
    bandwidth = copy_bandwidth(args.device, 2 * GiB if args.device == "cuda" else 64 << 20)
    print(f"copy bandwidth: {bandwidth / 1e9:.0f} GB/s (read + written)")
    print(
        "| shape | batch | torch path ms | Triton ms | torch / Triton | floor ms | Triton share "
        "of floor | max rel diff |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    rows = []
    for name, cfg in shapes.items():
        layer = make_layer(cfg, args.device, args.dtype)
        for batch in args.batches:
            r = measure(name, cfg, batch, layer, args, bandwidth)
            rows.append(r)
            print(
                f"| {name} | {batch} | {r.torch_ms:.3f} | {r.triton_ms:.3f} | {r.speedup:.2f}x | "
                f"{r.floor_ms:.3f} | {r.floor_ms / r.triton_ms:.0%} | {r.max_rel_diff:.2e} |",
                flush=True,
            )
        del layer
    if args.json:
        out = [asdict(r) | {"speedup": r.speedup} for r in rows]
        Path(args.json).write_text(json.dumps({"bandwidth_gbs": bandwidth / 1e9, "rows": out}))


if __name__ == "__main__":
    main()
