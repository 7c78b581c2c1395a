"""CUDA: x @ W^T for a few rows of activations against an FP8 (E4M3) weight, weight-only.

A decode step multiplies a handful of rows by every weight, so it is bound by reading the weight:
FP8 halves those bytes against bf16. `torch._scaled_mm` wants FP8 on both sides, so every linear
first quantizes its activations per token (an absolute value, a max reduction, a division, a cast:
five kernels), then runs a GEMM tiled for large M. On an H200 at batch 1 (Llama-3.2-1B shape,
bench/gpu_step_profile.py) that made the FP8 step 1.5x the bf16 one. This kernel reads the codes
once, converts them to the activations' dtype in registers (exact: every E4M3 value is a bf16 and
a float16 value) and accumulates in float32 on the tensor cores, one launch per linear; the row
scale is applied to the float32 sums. The activations are not quantized at all, so small batches
get the weight-only (W8A16) result, a little closer to the float product than W8A8.

One program per tile of BLOCK_N outputs walks all of K; the tile sizes are tuned per (N, K) on the
first call (before graph capture, which replays the chosen one).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Up to this many rows the weight-only kernel runs; more rows amortise the activation quantization
# and _scaled_mm's large tiles win.
MAX_ROWS = 16

# Rows of tiles (BLOCK_N) by depth (BLOCK_K): a decode linear has few outputs per program and must
# keep enough bytes in flight per SM, hence deep K tiles and 8 warps among the candidates.
_CONFIGS = [
    triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
    for n, k, w, s in (
        (16, 512, 4, 4),
        (32, 256, 4, 4),
        (16, 1024, 4, 3),
        (16, 1024, 8, 4),
        (16, 2048, 8, 2),
        (32, 512, 8, 4),
        (32, 1024, 8, 3),
        (64, 256, 8, 4),
    )
]
if os.environ.get("TRITON_INTERPRET") == "1":
    _CONFIGS = _CONFIGS[:1]  # the interpreter cannot time configs; correctness is the same


@triton.autotune(configs=_CONFIGS, key=["N", "K"])
@triton.jit
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m[:, None] < M
    col_ok = offs_n[:, None] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k[None, :] < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=row_ok & k_ok, other=0.0)
        w_tile = w_ptr + offs_n[:, None] * stride_wn + k[None, :]
        codes = tl.load(w_tile, mask=col_ok & k_ok, other=0)
        w = codes.to(tl.float8e4nv, bitcast=True).to(x.dtype)
        acc += tl.dot(x, tl.trans(w))
    scales = tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0)
    y = acc * scales[None, :]
    out = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=row_ok & (offs_n[None, :] < N))


def fp8_gemv(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] (bf16 or float16) @ (codes [N, K] E4M3 * scales [N, 1])^T -> [M, N]
    in x's dtype."""
    m, k = x.shape
    n = codes.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"fp8_gemv: at most {MAX_ROWS} rows, got {m}")
    x = x.contiguous()
    w = codes.view(torch.uint8)
    if w.stride(1) != 1:
        w = w.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)

    def grid(meta: dict) -> tuple[int]:
        return (triton.cdiv(n, meta["BLOCK_N"]),)

    _fp8_gemv_kernel[grid](
        x, w, scales, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), BLOCK_M=MAX_ROWS
    )
    return y
