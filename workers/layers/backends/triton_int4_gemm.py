"""CUDA: x @ W^T against an INT4 weight (GPTQ/AWQ codes, a scale and a zero point per group of
inputs), de-quantizing each tile in registers.

torch's int4pack kernel (tinygemm) was the CUDA path: on an H200 its INT4 decode step was 0.87x of
bf16's at batch 1 (where 4-bit weights should read a quarter of the bytes) and 2.1x bf16's at
batch 64 (bench/results/2026-11-26-h200-gpu-benches.md). Here one program per (row tile, output
tile) walks K a few whole groups at a time: it loads the tile's packed codes (two per byte, the
even input in the low nibble, as workers/layers/int4.py keeps them, groups in order), each group's
scale and zero point per output, forms (code - zero) * scale in float32, rounds it to the
activations' dtype and multiplies on the tensor cores with float32 sums. Tile sizes are tuned per
(N, K, group size, row bucket) on the first call, before graph capture.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# BLOCK_K spans GROUPS_PER_TILE groups: one group of 128 inputs is 1 KiB of codes for 16 outputs,
# too little to keep a decode step's memory busy.
_CONFIGS = [
    triton.Config({"BLOCK_N": n, "GROUPS_PER_TILE": g}, num_warps=w, num_stages=s)
    for n, g, w, s in (
        (16, 4, 4, 4),
        (32, 2, 4, 4),
        (16, 8, 8, 3),
        (32, 4, 8, 3),
        (64, 2, 8, 3),
        (64, 1, 4, 3),
        (128, 1, 8, 3),
    )
]
if os.environ.get("TRITON_INTERPRET") == "1":
    _CONFIGS = _CONFIGS[:1]  # the interpreter cannot time configs; correctness is the same


@triton.autotune(configs=_CONFIGS, key=["N", "K", "BLOCK_M", "GROUP"])
@triton.jit
def _int4_gemm_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    zeros_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_cn,
    stride_sn,
    stride_ym,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUPS_PER_TILE: tl.constexpr,
):
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    BLOCK_K: tl.constexpr = GROUP * GROUPS_PER_TILE
    half = tl.arange(0, BLOCK_K // 2)
    tile_groups = tl.arange(0, GROUPS_PER_TILE)
    row_ok = offs_m[:, None] < M
    col_ok = offs_n < N
    groups = K // GROUP
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=row_ok & k_ok[None, :], other=0.0
        )
        packed = tl.load(
            codes_ptr + offs_n[:, None] * stride_cn + (k0 // 2 + half)[None, :],
            mask=col_ok[:, None] & ((k0 // 2 + half) < K // 2)[None, :],
            other=0,
        )
        # [BLOCK_N, BLOCK_K / 2] bytes -> [BLOCK_N, BLOCK_K] codes, low nibble (even input) first
        codes = tl.reshape(tl.join(packed & 15, packed >> 4), (BLOCK_N, BLOCK_K))
        g = k0 // GROUP + tile_groups
        g_ok = col_ok[:, None] & (g < groups)[None, :]
        sz = offs_n[:, None] * stride_sn + g[None, :]
        scale = tl.load(scales_ptr + sz, mask=g_ok, other=0.0)
        zero = tl.load(zeros_ptr + sz, mask=g_ok, other=0).to(tl.float32)
        q = tl.reshape(codes.to(tl.float32), (BLOCK_N, GROUPS_PER_TILE, GROUP))
        w = tl.reshape((q - zero[:, :, None]) * scale[:, :, None], (BLOCK_N, BLOCK_K))
        acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    out = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok & col_ok[None, :])


def int4_gemm(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """x [M, K] (bf16 or float16) @ W^T -> [M, N] in x's dtype, W[n, k] = (code - zero[n, g]) *
    scale[n, g], g = k // group_size; codes uint8 [N, K / 2], scales float32 and zeros uint8
    [N, K / group_size], all row-major."""
    m, k = x.shape
    n = codes.shape[0]
    if k % group_size or codes.shape[1] * 2 != k:
        raise ValueError(
            f"int4_gemm: {k} inputs must be whole groups of {group_size} and twice the codes' "
            f"{codes.shape[1]} bytes per row"
        )
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64

    def grid(meta: dict) -> tuple[int, int]:
        return (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, block_m))

    _int4_gemm_kernel[grid](
        x,
        codes,
        scales,
        zeros,
        y,
        m,
        n,
        k,
        x.stride(0),
        codes.stride(0),
        scales.stride(0),
        y.stride(0),
        GROUP=group_size,
        BLOCK_M=block_m,
    )
    return y
