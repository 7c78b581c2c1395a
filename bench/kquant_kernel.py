"""The GGUF kernels per type and row count: the K-quants (Q4_K, Q5_K, Q6_K) against the
legacy types (Q4_1, Q8_0) on the same shapes, in the same run.

Random blocks (tests/random_kquant.py, tests/workers/test_quantized.py); each cell is the fastest
of `--reps` calls, in microseconds, and the bytes the weight holds over that time. The fastest
call, not the median: on a shared machine the median measures the other processes. No pass/fail:
figures only. `--paths` picks what is timed (one table each):
  - matmul: `GGUFWeight.matmul`, what the model runs (the int8 kernel in VNNI builds; elsewhere
    the float kernel up to 48 rows, de-quantise + GEMM above);
  - float: the float block kernel (`linear`), at every row count asked;
  - dequant: de-quantise the whole weight, then one torch.mm.

    python bench/kquant_kernel.py [--threads 2] [--rows 1,8,32,48,64,128,512]
        [--paths matmul,float,dequant] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from tests.random_kquant import random_k_blocks
from tests.workers.test_quantized import raw_blocks
from workers.gguf import blocks_to_weight
from workers.layers.backends import gguf_cpu

# (label, rows of W, inputs): SmolLM2-135M's gate_up and down with inputs rounded up to whole
# super-blocks, and Llama 3.2 1B's gate_up.
SHAPES = [
    ("gate_up 3072x768", 3072, 768),
    ("down 768x1536", 768, 1536),
    ("1B gate_up 16384x2048", 16384, 2048),
]
TYPES = ("Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def _weight(qtype: str, n: int, k: int):
    raw = random_k_blocks(qtype, n, k) if qtype.endswith("_K") else raw_blocks(qtype, n, k)
    return blocks_to_weight(qtype, raw, qtype)


def _best_us(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e6


def _path(name: str, w):
    """The product x @ W^T by path `name` (see the module docstring)."""
    ops = gguf_cpu.load()
    if name == "float":
        return lambda x: ops.linear(x, *w._kernel_args())
    if name == "dequant":
        return lambda x: torch.mm(x, w.dequantize().t())
    return w.matmul


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,8,32,48,64,128,512")
    p.add_argument("--paths", default="matmul")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="one small shape, two row counts")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if gguf_cpu.load() is None:
        sys.exit("the GGUF kernel could not be built here")
    shapes, rows = SHAPES, [int(r) for r in args.rows.split(",")]
    if args.smoke:
        shapes, rows, args.reps = [("smoke 256x512", 256, 512)], [1, 8], 3
    build = gguf_cpu.load().isa()
    print(f"threads {args.threads}, {build} build, fastest of {args.reps}")
    for path in args.paths.split(","):
        print(f"\n{path}: load average {os.getloadavg()[0]:.1f}")
        header = " | ".join(f"{r} rows" for r in rows)
        print(f"| weight | type | bits/weight | {header} |")
        print("| --- | --- | ---: |" + " ---: |" * len(rows))
        for label, n, k in shapes:
            for qtype in TYPES:
                w = _weight(qtype, n, k)
                bits = 8 * w.nbytes() / (n * k)
                cells = []
                for r in rows:
                    x, fn = torch.randn(r, k), _path(path, w)
                    us = _best_us(lambda x=x, fn=fn: fn(x), args.reps)
                    cells.append(f"{us:,.0f} us ({w.nbytes() / us / 1e3:.1f} GB/s)")
                print(f"| {label} | {qtype} | {bits:.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
