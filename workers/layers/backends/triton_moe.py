"""CUDA: the SwiGLU experts of a MoE layer as two grouped GEMMs in Triton, over blocks of
(token, slot) pairs sorted by expert (workers/layers/moe_align.py).

Launch 1 (gate-up): one program per (block, tile of the intermediate dimension) gathers its rows'
tokens from x, multiplies them by its expert's gate and up rows and stores silu(gate) * up per
pair. Launch 2 (down): the same blocks times the expert's down matrix, scaled by each pair's
routing weight. Each token's k results are then summed in slot order, as the torch path sums them
(FusedMoE.experts), and every op rounds to the activation dtype where the torch path rounds.

Verified under Triton's CPU interpreter and compiled on an H200 in bfloat16
(tests/workers/test_triton_moe.py); not timed on a GPU; block sizes are first guesses, not tuned.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.layers.backends.triton_tiles import row_tile, rows_times_weight
from workers.layers.moe_align import ExpertBlocks, align_by_expert


@triton.jit
def _block_rows(rows_ptr, block, num_pairs, BLOCK_M: tl.constexpr):
    """The (token, expert) pair rows of this block, and which are real (not padding)."""
    rows = tl.load(rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return rows, rows < num_pairs


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    h_ptr,
    rows_ptr,
    block_expert_ptr,
    num_pairs,
    hidden,
    inter,
    stride_xt,
    stride_we,
    stride_wn,
    stride_ht,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:  # past the last expert's blocks: the bound's spare blocks
        return
    rows, valid = _block_rows(rows_ptr, block, num_pairs, BLOCK_M)
    tokens = rows // TOP_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    w = w_ptr + expert.to(tl.int64) * stride_we
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < hidden
        a = row_tile(x_ptr, tokens, stride_xt, kk, valid, mask_k)
        w_mask = mask_k[:, None] & mask_n[None, :]
        w_gate = tl.load(w + offs_n[None, :] * stride_wn + kk[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(
            w + (inter + offs_n[None, :]) * stride_wn + kk[:, None], mask=w_mask, other=0.0
        )
        gate += tl.dot(a, w_gate, input_precision=PRECISION)
        up += tl.dot(a, w_up, input_precision=PRECISION)
    dt = h_ptr.dtype.element_ty
    g = gate.to(dt).to(tl.float32)
    u = up.to(dt).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(
        h_ptr + rows[:, None] * stride_ht + offs_n[None, :],
        (act * u).to(dt),
        mask=valid[:, None] & mask_n[None, :],
    )


@triton.jit
def _down_kernel(
    h_ptr,
    w_ptr,
    out_ptr,
    rows_ptr,
    block_expert_ptr,
    weights_ptr,
    num_pairs,
    hidden,
    inter,
    stride_ht,
    stride_we,
    stride_wn,
    stride_ot,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    rows, valid = _block_rows(rows_ptr, block, num_pairs, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hidden
    w = w_ptr + expert.to(tl.int64) * stride_we
    acc = rows_times_weight(
        h_ptr, rows, stride_ht, valid, w, offs_n, stride_wn, mask_n, inter,
        BLOCK_M, BLOCK_N, BLOCK_K, PRECISION,
    )  # fmt: skip
    dt = out_ptr.dtype.element_ty
    scale = tl.load(weights_ptr + rows, mask=valid, other=0.0).to(dt).to(tl.float32)
    y = acc.to(dt).to(tl.float32) * scale[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + offs_n[None, :],
        y.to(dt),
        mask=valid[:, None] & mask_n[None, :],
    )


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Rows per block from the mean rows per expert: small blocks waste less padding at decode
    sizes, larger ones reuse each weight tile over more rows. tl.dot needs at least 16."""
    mean = num_pairs / max(num_experts, 1)
    return 16 if mean <= 16 else 32 if mean <= 64 else 64


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    first: int = 0,
) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) over the experts held here, [T, H].

    x [T, H]; w13 [E_local, 2I, H] (gate rows, then up rows) and w2 [E_local, H, I] hold global
    experts first .. first + E_local - 1; weights (float32) and ids [T, k]. Pairs routed to other
    experts contribute zero (expert parallelism: another rank computes them)."""
    t, k = ids.shape
    e_local, two_i, h = w13.shape
    inter = two_i // 2
    if w2.shape != (e_local, h, inter):
        raise ValueError(f"w2: expected shape {(e_local, h, inter)}, got {tuple(w2.shape)}")
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("w13, w2: need unit stride in their last dimension")
    if t == 0:
        return x.new_zeros(0, h)
    x = x.contiguous()
    blocks = align_by_expert(ids, first, e_local, block_m_for(t * k, e_local))
    cache = torch.empty((t * k, inter), dtype=x.dtype, device=x.device)
    out = x.new_zeros(t * k, h)
    _launch(x, w13, w2, weights.reshape(-1).float().contiguous(), blocks, cache, out, k)
    return out.view(t, k, h).sum(1)


def _launch(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    blocks: ExpertBlocks,
    cache: torch.Tensor,
    out: torch.Tensor,
    top_k: int,
) -> None:
    h, inter = x.shape[1], cache.shape[1]
    # float32 stays exact (no TF32), as the attention kernel does, so fp32 matches the torch path.
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    bn, bk = 64, 32
    _gate_up_kernel[(blocks.num_blocks, triton.cdiv(inter, bn))](
        x,
        w13,
        cache,
        blocks.rows,
        blocks.block_expert,
        blocks.num_pairs,
        h,
        inter,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        cache.stride(0),
        TOP_K=top_k,
        BLOCK_M=blocks.block_m,
        BLOCK_N=bn,
        BLOCK_K=bk,
        PRECISION=precision,
    )
    _down_kernel[(blocks.num_blocks, triton.cdiv(h, bn))](
        cache,
        w2,
        out,
        blocks.rows,
        blocks.block_expert,
        weights,
        blocks.num_pairs,
        h,
        inter,
        cache.stride(0),
        w2.stride(0),
        w2.stride(1),
        out.stride(0),
        BLOCK_M=blocks.block_m,
        BLOCK_N=bn,
        BLOCK_K=bk,
        PRECISION=precision,
    )
