"""CUDA without flash-attn: a Triton kernel for decode tokens, torch SDPA for prefill chunks.

The kernel reads K/V straight from the paged cache through the block table (no gather copy):
one program per (request, KV head) walks the context block by block with an online softmax,
serving all query heads of the GQA group at once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.layers.attention import AttentionMetadata
from workers.layers.backends.torch_ref import TorchBackend, _prepare_prefills, _TorchState


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, scale,
                         stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
                         stride_ot, stride_oh,
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_SIZE)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + req * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
    seq_len = tl.load(seq_lens_ptr + req)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for j in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + req * stride_bt + j).to(tl.int64)
        valid = j * BLOCK_SIZE + offs_n < seq_len
        offsets = block * stride_kb + offs_n[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :]
        kv_mask = valid[:, None] & mask_d[None, :]
        k = tl.load(k_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        v = tl.load(v_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + req * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [N, Hq, D], one token per request; caches [blocks, block_size, Hk, D] -> [N, Hq, D]."""
    n, hq, d = q.shape
    _, block_size, hk, _ = k_cache.shape
    if k_cache.stride() != v_cache.stride():
        raise ValueError("v_cache: must share k_cache's layout")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size: the Triton decode kernel needs a power of two, got {block_size}")
    group = hq // hk
    out = torch.empty_like(q)
    _paged_decode_kernel[(n, hk)](
        q, k_cache, v_cache, out, block_tables, seq_lens, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=d, BLOCK_G=max(triton.next_power_of_2(group), 2),
        BLOCK_D=triton.next_power_of_2(d), BLOCK_SIZE=block_size)
    return out


class TritonDecodeBackend(TorchBackend):
    """Decodes through the paged Triton kernel; prefill chunks as in the torch backend."""

    name = "triton"

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.backend_state = _TorchState(None, 0, None, _prepare_prefills(meta))

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        nd = q.shape[0]
        return paged_decode(q.contiguous(), k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale)
