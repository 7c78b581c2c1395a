"""Small-row float32 linears on CPU: x [M, K] @ weight [N, K]^T (+ bias) for a few rows.

At decode each routed expert sees a handful of rows (DeepSeek's bench shape: 32 tokens x top-4 of
16 experts, ~8 rows an expert). oneDNN's packed GEMM read an expert's weights at ~11 GB/s there,
where one thread streams ~24 GB/s; small_gemm.cpp (built into the fused ops' library by
cpu_fused.load) reads each weight row once for all the rows, from the weight as stored, so it
needs no packed copy. The caller picks it by row count (workers/layers/moe.py: oneDNN keeps the
larger groups) and keeps its torch path where the library is missing.

Numerics: float32 products summed with fused multiply-adds in 16 (AVX-512) or 8 (AVX2) lanes,
then a fixed tree: within float32 rounding of torch's matmul, and a row's output depends only on
that row, K and N (tests/workers/test_small_gemm.py).
"""

from __future__ import annotations

import torch

from workers.layers.backends import cpu_fused

MAX_ROWS = 64  # small_gemm.cpp's kMaxRows


def available() -> bool:
    """Whether the kernel is built and loaded on this machine."""
    return cpu_fused.load() is not None


def small_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight^T + bias as a new contiguous [M, N] float32 tensor: x [M <= MAX_ROWS, K] and
    weight [N, K] float32 on CPU with unit column stride (rows may be strided), bias [N]
    contiguous. Refuses anything else with ValueError naming the argument."""
    ops = cpu_fused.load()
    if ops is None:
        raise RuntimeError("CPU small linear: the C++ library could not be built (see the warning)")
    return ops.small_linear(x, weight, bias)
