"""Tile loads and the K loop that the Triton LoRA and MoE kernels share (`@triton.jit` helpers,
inlined into each kernel that calls them)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_tile(ptr, rows, stride, kk, valid, mask_k):
    """Columns kk of the given rows of a row-major matrix (padding rows and columns past the
    end read as 0)."""
    return tl.load(
        ptr + rows[:, None] * stride + kk[None, :],
        mask=valid[:, None] & mask_k[None, :],
        other=0.0,
    )


@triton.jit
def rows_times_weight(
    x_ptr,
    rows,
    stride_x,
    valid,
    w,
    offs_n,
    stride_wn,
    mask_n,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """x[rows, :K] @ w[offs_n, :K]^T, accumulated in float32 one K tile at a time: the given rows
    of a row-major x (padding rows read as 0) times rows offs_n of a row-major weight whose first
    element is at w (a [N, K] linear weight, read transposed)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < K
        a = row_tile(x_ptr, rows, stride_x, kk, valid, mask_k)
        b = tl.load(
            w + offs_n[None, :] * stride_wn + kk[:, None],
            mask=mask_k[:, None] & mask_n[None, :],
            other=0.0,
        )
        acc += tl.dot(a, b, input_precision=PRECISION)
    return acc
