"""What the paged-attention Triton kernels (triton_decode.py, triton_prefill.py) share: reading a
K/V tile through the block table, folding a tile into the online softmax, and on the host the
checks and launch arguments of the inputs both kernels take.

Both kernels take these arguments in this order, after their own pointers:
`sinks_ptr, kv_scale_ptr, scale, window, softcap, stride_qt, stride_qh, stride_kb, stride_ks,
stride_kh, stride_bt`, and the constexprs HEAD_DIM, BLOCK_D, BLOCK_SIZE, PRECISION, SOFTCAP,
HAS_SINKS and FP8_KV (`launch_args`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def load_kv_tile(
    k_ptr, v_ptr, blocks, pos, mask, kv_head, stride_kb, stride_ks, stride_kh, offs_d, q,
    BLOCK_SIZE: tl.constexpr, FP8_KV: tl.constexpr,
):  # fmt: skip
    """The K and V rows of context positions `pos` from the paged caches [blocks, BLOCK_SIZE, Hk,
    D], in q's dtype: `blocks` (int64) is each position's cache block, read from the block table.
    An FP8 cache's E4M3 codes (uint8) are converted as they load; their scales are the caller's
    (one multiply per tile, not one per element)."""
    offsets = (
        blocks[:, None] * stride_kb
        + (pos % BLOCK_SIZE)[:, None] * stride_ks
        + kv_head * stride_kh
        + offs_d[None, :]
    )
    k = tl.load(k_ptr + offsets, mask=mask, other=0)
    v = tl.load(v_ptr + offsets, mask=mask, other=0)
    if FP8_KV:
        k = k.to(tl.float8e4nv, bitcast=True).to(q.dtype)
        v = v.to(tl.float8e4nv, bitcast=True).to(q.dtype)
    return k, v


@triton.jit
def softmax_fold(s, v, m_i, l_i, acc, PRECISION: tl.constexpr, LOG2: tl.constexpr):
    """One tile's scores s (-inf where masked) and values v folded into every row's running max
    m_i, denominator l_i and unnormalised output acc; LOG2: s is in log2 units (exp2)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row with nothing allowed yet (a padded row, an empty tile, a window starting later)
    # keeps m = -inf: exponents are taken against 0 there so that -inf - -inf never appears.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    if LOG2:
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
    else:
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return m_new, l_i, acc


@dataclass(frozen=True, slots=True)
class PagedInputs:
    """What both kernels take besides their own tensors: q [T, Hq, D], the caches [blocks,
    block_size, Hk, D] and their block tables, and the attention's options."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    scale: float
    window: int
    softcap: float
    sinks: torch.Tensor | None  # float32 [Hq] logits (attention sinks)
    kv_scale: torch.Tensor | None  # float32 [2] (K's, V's scale): the caches hold FP8 codes


def launch_args(x: PagedInputs, kernel: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The kernels' arguments from sinks_ptr to stride_bt (in their order) and their common
    constexprs, once x's inputs are checked; `kernel` names the kernel in the block-size error."""
    sinks = _checked_sinks(x, kernel)
    q, k_cache = x.q, x.k_cache
    args = (
        sinks if sinks is not None else x.seq_lens,  # never read without HAS_SINKS
        x.kv_scale if x.kv_scale is not None else x.seq_lens,  # never read without FP8_KV
        x.scale,
        x.window,
        float(x.softcap or 0.0),
        *q.stride()[:2],
        *k_cache.stride()[:3],
        x.block_tables.stride(0),
    )
    d = q.shape[2]
    meta = dict(
        HEAD_DIM=d,
        BLOCK_D=max(triton.next_power_of_2(d), 16),  # tl.dot needs a 16-wide inner dim
        BLOCK_SIZE=k_cache.shape[1],
        # float32 stays exact (no TF32) so that the fp32 path matches Hugging Face.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SOFTCAP=bool(x.softcap),
        HAS_SINKS=sinks is not None,
        FP8_KV=x.kv_scale is not None,
    )
    return args, meta


def _checked_sinks(x: PagedInputs, kernel: str) -> torch.Tensor | None:
    """The checks of the common inputs; sinks as the kernels read them (float32, contiguous)."""
    k_cache, v_cache, kv_scale = x.k_cache, x.v_cache, x.kv_scale
    hq, block_size = x.q.shape[1], k_cache.shape[1]
    if k_cache.stride() != v_cache.stride():
        raise ValueError("v_cache: must share k_cache's layout")
    if block_size & (block_size - 1):
        raise ValueError(
            f"block_size: the Triton {kernel} kernel needs a power of two, got {block_size}"
        )
    if kv_scale is not None:
        if k_cache.dtype != torch.uint8 or v_cache.dtype != torch.uint8:
            raise ValueError(f"kv_scale: an FP8 cache holds uint8 codes, got {k_cache.dtype}")
        if kv_scale.dtype != torch.float32 or kv_scale.numel() != 2 or kv_scale.stride(0) != 1:
            raise ValueError("kv_scale: needs a contiguous float32 tensor of 2 scales (K, V)")
    if x.sinks is None:
        return None
    sinks = x.sinks.float().contiguous()
    if sinks.shape != (hq,):
        raise ValueError(f"sinks: expected shape ({hq},), got {tuple(sinks.shape)}")
    return sinks
