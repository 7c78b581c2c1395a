"""CUDA without flash-attn: a Triton kernel for decode tokens, torch SDPA for prefill chunks.

The kernel reads K/V straight from the paged cache through the block table (no gather copy):
one program per (request, KV head) walks the context block by block with an online softmax,
serving all query heads of the GQA group at once. An FP8 cache (uint8 E4M3 codes,
workers/kv_fp8.py) is converted to q's dtype as it is loaded; K's scale multiplies the scores and
V's the output, so each costs one multiply per tile instead of one per element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from workers.layers.attention import AttentionMetadata, LayerKV
from workers.layers.backends.torch_ref import TorchBackend
from workers.layers.backends.triton_paged import (
    PagedInputs,
    launch_args,
    load_kv_tile,
    softmax_fold,
)


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, m_ptr, l_ptr, block_tables_ptr, seq_lens_ptr,
    sinks_ptr, kv_scale_ptr, scale, window, softcap,  # from here on: triton_paged.common_args
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
    stride_ot, stride_oh, stride_os,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PRECISION: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, FP8_KV: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, TILE: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, TILE)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    # The GQA group's query heads are the rows of one matrix product per tile (padded to 16 rows).
    q = tl.load(
        q_ptr + req * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    )
    seq_len = tl.load(seq_lens_ptr + req)
    if FP8_KV:  # the layer's scales: K's folds into the score scale, V's into the output
        scale = scale * tl.load(kv_scale_ptr)
        v_scale = tl.load(kv_scale_ptr + 1)
    # A sliding window (window > 0) starts the context at lo: tiles wholly before it are skipped,
    # positions before it in the first tile are masked. Split 0 always holds position lo.
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    first_tile = lo // TILE
    num_tiles = tl.cdiv(seq_len, TILE) - first_tile
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    first = first_tile + split * per_split
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    if HAS_SINKS:
        # A sink is one more score whose value vector is zero: split 0 starts its running max at
        # the sink logit with exp(sink - max) = 1 already in the denominator. Combining splits
        # then counts it once.
        sink = tl.load(sinks_ptr + heads, mask=mask_g, other=float("-inf")).to(tl.float32)
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where((split == 0) & mask_g, 1.0, l_i)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    # Every split walks per_split tiles of several cache blocks; those past the context are fully
    # masked (no memory read).
    for i in range(0, per_split):
        pos = (first + i) * TILE + offs_n
        valid = (pos < seq_len) & (pos >= lo)
        blocks = tl.load(
            block_tables_ptr + req * stride_bt + pos // BLOCK_SIZE, mask=valid, other=0
        ).to(tl.int64)
        kv_mask = valid[:, None] & mask_d[None, :]
        k, v = load_kv_tile(
            k_ptr, v_ptr, blocks, pos, kv_mask, kv_head, stride_kb, stride_ks, stride_kh, offs_d,
            q, BLOCK_SIZE, FP8_KV,
        )  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if SOFTCAP:  # softcap * tanh(s / softcap), tanh(x) = 2 sigmoid(2x) - 1
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_i, l_i, acc = softmax_fold(s, v, m_i, l_i, acc, PRECISION, False)
    if FP8_KV:  # partial sums merge linearly, so the splits' parts may carry it too
        acc = acc * v_scale
    out_mask = mask_g[:, None] & mask_d[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + req * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:  # unnormalised partials; _combine_splits_kernel merges them (an empty split has l = 0)
        tl.store(
            out_ptr
            + req * stride_ot
            + heads[:, None] * stride_oh
            + split * stride_os
            + offs_d[None, :],
            acc,
            mask=out_mask,
        )
        stats = (
            req * GROUP * tl.num_programs(1) + heads
        ) * NUM_SPLITS + split  # m, l: [N, Hq, splits]
        tl.store(m_ptr + stats, m_i, mask=mask_g)
        tl.store(l_ptr + stats, l_i, mask=mask_g)


@triton.jit
def _combine_splits_kernel(
    part_ptr,
    m_ptr,
    l_ptr,
    out_ptr,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    stats = (req * tl.num_programs(1) + head) * NUM_SPLITS + offs_s
    m = tl.load(m_ptr + stats)
    l_split = tl.load(l_ptr + stats)
    weight = tl.exp(m - tl.max(m, axis=0))  # split 0 always holds a block, so the max is finite
    part = tl.load(
        part_ptr
        + req * stride_pt
        + head * stride_ph
        + offs_s[:, None] * stride_ps
        + offs_d[None, :],
        mask=offs_d[None, :] < HEAD_DIM,
        other=0.0,
    )
    out = tl.sum(weight[:, None] * part, axis=0) / tl.sum(weight * l_split, axis=0)
    tl.store(
        out_ptr + req * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def num_splits(num_reqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Context splits per (request, KV head): enough programs to fill the GPU twice over, at most
    16.

    A function of the batch shape only, so a captured graph keeps its split count at every length.
    """
    # Off CUDA (Triton's interpreter in the CPU tests) a small machine is assumed.
    sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 4
    )
    programs = 2 * sms
    return min(16, triton.next_power_of_2(max(1, -(-programs // (num_reqs * num_kv_heads)))))


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    splits: int | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [N, Hq, D], one token per request; caches [blocks, block_size, Hk, D] -> [N, Hq, D].
    kv_scale: float32 [2] (K's, V's scale): the caches hold FP8 E4M3 codes as uint8.
    window > 0: each request attends to its last `window` tokens only. softcap > 0: scores become
    softcap * tanh(score / softcap). sinks: float32 [Hq] logits added to each head's softmax
    denominator (attention sinks).

    Short batches split each context across programs (flash-decoding) and merge the partial
    softmaxes.
    """
    n, hq, d = q.shape
    hk = k_cache.shape[2]
    paged = PagedInputs(
        q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap, sinks, kv_scale
    )
    args, meta = launch_args(paged, "decode")
    if seq_lens.stride(0) != 1 or block_tables.stride(1) != 1 or q.stride(2) != 1:
        raise ValueError("seq_lens, block_tables and q: need unit stride in their last dimension")
    group = hq // hk
    splits = splits or num_splits(n, hk, q.device)
    out = torch.empty_like(q)
    # With one split the kernel writes the output itself; with more, unnormalised partials and
    # their softmax statistics that _combine_splits_kernel merges.
    if splits == 1:
        part, m, l_split = out, out, out
    else:
        part = torch.empty((n, hq, splits, d), dtype=torch.float32, device=q.device)
        m = torch.empty((n, hq, splits), dtype=torch.float32, device=q.device)
        l_split = torch.empty_like(m)
    _paged_decode_kernel[(n, hk, splits)](
        q, k_cache, v_cache, part, m, l_split, block_tables, seq_lens,
        *args, part.stride(0), part.stride(1), part.stride(2) if splits > 1 else 0,
        **meta,
        GROUP=group,
        BLOCK_G=max(triton.next_power_of_2(group), 16),  # tl.dot needs 16 rows
        TILE=max(64, k_cache.shape[1]),  # 64+ tokens a tile keep enough bytes in flight
        NUM_SPLITS=splits,
    )  # fmt: skip
    if splits > 1:
        _combine_splits_kernel[(n, hq)](
            part, m, l_split, out,
            part.stride(0), part.stride(1), part.stride(2), out.stride(0), out.stride(1),
            HEAD_DIM=d,
            BLOCK_D=triton.next_power_of_2(d),
            NUM_SPLITS=splits,
        )  # fmt: skip
    return out


class TritonDecodeBackend(TorchBackend):
    """Decodes through the paged Triton kernel; prefill chunks as in the torch backend."""

    name = "triton"
    supports_cuda_graphs = True  # decode reads only fixed-shape tensors; lengths are data

    def decode(self, q: Tensor, meta: AttentionMetadata, kv: LayerKV) -> Tensor:
        nd, p = q.shape[0], kv.p
        return paged_decode(
            q.contiguous(),
            kv.k_cache,
            kv.v_cache,
            meta.block_tables[:nd],
            meta.seq_lens[:nd],
            p.scale,
            window=p.window or 0,
            softcap=p.softcap or 0.0,
            sinks=p.sinks,
            kv_scale=p.kv_scale,
        )
