"""Prefill over the paged KV cache in one Triton launch: the varlen path of the Triton backend.

The queries of every prefill chunk in the step are packed one after another (`query_start_loc`,
cu_seqlens style). Each chunk's tokens are the tail of its request's context: the query at
context position p attends causally to positions up to p, wherever they came from (a prefix-cache
hit, an earlier chunk of a chunked prefill, or this chunk, whose K/V the layer has already
written to the cache). The kernel reads all of them through the block table, so no context is
gathered and no mask is built on the host.

One program owns a tile of one chunk's query tokens for one KV head. Its rows are
(token, query head) pairs of that head's GQA group, so every K/V tile it loads serves the whole
group. Key tiles wholly before the tile's first query need no causal mask and run first; the
diagonal tiles (and every tile under a sliding window) are masked per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from workers.layers.attention import AttentionMetadata, LayerKV
from workers.layers.backends.torch_ref import _prepare_prefills, _TorchState
from workers.layers.backends.triton_decode import TritonDecodeBackend
from workers.layers.backends.triton_paged import (
    PagedInputs,
    launch_args,
    load_kv_tile,
    softmax_fold,
)

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(
    q,
    k_ptr,
    v_ptr,
    table_ptr,
    start,
    kv_head,
    q_pos,
    q_lo,
    hi,
    m_i,
    l_i,
    acc,
    qk_scale,
    softcap,
    stride_kb,
    stride_ks,
    stride_kh,
    offs_n,
    offs_d,
    mask_d,
    BLOCK_SIZE: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    MASKED: tl.constexpr,
    FP8_KV: tl.constexpr,
):
    """One key tile [start, start + TILE_N) into the running softmax of every row (log2 units)."""
    pos = start + offs_n
    if MASKED:
        valid = pos < hi
        blocks = tl.load(table_ptr + pos // BLOCK_SIZE, mask=valid, other=0)
        kv_mask = valid[:, None] & mask_d[None, :]
    else:  # every position of the tile is before the tile's first query (so in the context)
        blocks = tl.load(table_ptr + pos // BLOCK_SIZE)
        kv_mask = mask_d[None, :]
    # K's scale is folded into qk_scale, V's multiplies the output once, at the end.
    k, v = load_kv_tile(
        k_ptr, v_ptr, blocks.to(tl.int64), pos, kv_mask, kv_head, stride_kb, stride_ks, stride_kh,
        offs_d, q, BLOCK_SIZE, FP8_KV,
    )  # fmt: skip
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if SOFTCAP:  # softcap * tanh(s / softcap) on the scaled score, tanh(x) = 2 sigmoid(2x) - 1
        s = s * (qk_scale / 1.4426950408889634)
        s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0) * 1.4426950408889634
    else:
        s = s * qk_scale
    if MASKED:
        allowed = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] >= q_lo[:, None])
        allowed = allowed & valid[None, :]
        s = tl.where(allowed, s, float("-inf"))
    return softmax_fold(s, v, m_i, l_i, acc, PRECISION, True)


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, query_start_ptr, seq_lens_ptr,
    sinks_ptr, kv_scale_ptr, qk_scale, window, softcap,  # from here on: triton_paged.common_args
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PRECISION: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, FP8_KV: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, TOKENS: tl.constexpr,
    TILE_N: tl.constexpr,
):  # fmt: skip
    kv_head = tl.program_id(0)
    req = tl.program_id(1)
    # The last query tiles of a chunk see the most keys: launched first, they do not finish last.
    tile = tl.num_programs(2) - 1 - tl.program_id(2)
    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start
    if tile * TOKENS >= q_len:  # the grid is sized for the longest chunk of the step
        return
    seq_len = tl.load(seq_lens_ptr + req)
    v_scale = 1.0
    if FP8_KV:
        qk_scale = qk_scale * tl.load(kv_scale_ptr)
        v_scale = tl.load(kv_scale_ptr + 1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    tok = tile * TOKENS + offs_m // GROUP_PAD  # token of each row within the chunk
    g = offs_m % GROUP_PAD
    heads = kv_head * GROUP + g
    rows = (tok < q_len) & (g < GROUP)
    q = tl.load(
        q_ptr
        + (q_start + tok)[:, None].to(tl.int64) * stride_qt
        + heads[:, None] * stride_qh
        + offs_d[None, :],
        mask=rows[:, None] & mask_d[None, :],
        other=0.0,
    )
    first_pos = seq_len - q_len + tile * TOKENS  # context position of the tile's first token
    q_pos = first_pos + offs_m // GROUP_PAD
    hi = tl.minimum(first_pos + TOKENS, seq_len)  # keys past the tile's last query are masked
    q_lo = tl.where(window > 0, q_pos - window + 1, 0)  # each row's first position in its window
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:
        # A sink is one more logit whose value vector is zero: the running max starts there with
        # exp(sink - max) = 1 already in the denominator.
        sink = tl.load(sinks_ptr + heads, mask=g < GROUP, other=float("-inf")).to(tl.float32)
        m_i = sink * 1.4426950408889634
        l_i = tl.where(g < GROUP, 1.0, 0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_ptr = block_tables_ptr + req.to(tl.int64) * stride_bt  # this request's block table
    # Under a sliding window every tile is masked from the first one the window reaches;
    # otherwise tiles that end before the first query position need no mask.
    lo = tl.where(window > 0, tl.maximum(first_pos - window + 1, 0), 0)
    lo = (lo // TILE_N) * TILE_N
    full_end = tl.where(window > 0, lo, (first_pos // TILE_N) * TILE_N)
    for start in range(lo, full_end, TILE_N):
        m_i, l_i, acc = _attend_tile(
            q, k_ptr, v_ptr, table_ptr, start, kv_head, q_pos, q_lo, hi, m_i, l_i, acc,
            qk_scale, softcap, stride_kb, stride_ks, stride_kh, offs_n, offs_d, mask_d,
            BLOCK_SIZE, PRECISION, SOFTCAP, False, FP8_KV,
        )  # fmt: skip
    for start in range(full_end, hi, TILE_N):
        m_i, l_i, acc = _attend_tile(
            q, k_ptr, v_ptr, table_ptr, start, kv_head, q_pos, q_lo, hi, m_i, l_i, acc,
            qk_scale, softcap, stride_kb, stride_ks, stride_kh, offs_n, offs_d, mask_d,
            BLOCK_SIZE, PRECISION, SOFTCAP, True, FP8_KV,
        )  # fmt: skip
    tl.store(
        out_ptr
        + (q_start + tok)[:, None].to(tl.int64) * stride_ot
        + heads[:, None] * stride_oh
        + offs_d[None, :],
        # Padded rows (l = 0) are not stored; dividing by 1 there keeps NaN out of them.
        (acc * (v_scale / tl.where(l_i == 0.0, 1.0, l_i))[:, None]).to(out_ptr.dtype.element_ty),
        mask=rows[:, None] & mask_d[None, :],
    )


@dataclass(frozen=True, slots=True)
class PrefillTiles:
    """Launch shape: block_m rows ((token, query head) pairs) per program, tile_n keys per step."""

    block_m: int
    tile_n: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "tile_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}: must be a power of two of at least 16, got {value}")


def default_tiles(head_dim: int, dtype: torch.dtype, device: torch.device) -> PrefillTiles:
    """Launch shapes that compile without register spills for sm_90 (checked with ptxas).

    16-bit: 128 rows by 64 keys (64 by 32 past head size 128, to stay within shared memory).
    float32 runs exact IEEE products on CUDA cores, whose operands take registers in proportion
    to the tile and the head size: 32 by 32, 16 rows past head size 128 (128 rows spill several
    KB per thread and take minutes to compile). Under Triton's CPU interpreter, small tiles: its
    cost is per program and per tile.
    """
    if device.type != "cuda":
        return PrefillTiles(32, 16, 1, 1)
    if dtype == torch.float32:
        return PrefillTiles(32 if head_dim <= 128 else 16, 32, 8 if head_dim > 32 else 4, 1)
    if head_dim <= 64:
        return PrefillTiles(128, 64, 4, 3)
    if head_dim <= 128:
        return PrefillTiles(128, 64, 8, 2)
    return PrefillTiles(64, 32, 8, 2)


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    tiles: PrefillTiles | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed prefill chunks over their whole paged contexts.

    q: [T, Hq, D]; chunk i is q[query_start_loc[i] : query_start_loc[i + 1]], the last tokens of
    a context of seq_lens[i] positions whose blocks are block_tables[i] (caches [blocks,
    block_size, Hk, D], this step's K/V already written). max_query_len: the longest chunk (it
    sizes the grid). window > 0: each query attends to its last `window` positions only.
    softcap > 0: scores become softcap * tanh(score / softcap). sinks: [Hq] logits added to each
    head's softmax denominator. kv_scale: float32 [2] (K's, V's scale) when the caches hold FP8
    E4M3 codes as uint8 (workers/kv_fp8.py). Writes the chunks' rows of `out` (a new tensor
    shaped like q when None) and returns it; rows outside every chunk are left as they were.
    """
    hq, hk = q.shape[1], k_cache.shape[2]
    paged = PagedInputs(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        scale * _LOG2E,
        window,
        softcap,
        sinks,
        kv_scale,
    )
    args, meta = launch_args(paged, "prefill")
    if hq % hk:
        raise ValueError(f"q: {hq} query heads do not split into {hk} KV heads")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or block_tables.stride(1) != 1:
        raise ValueError("q, k_cache and block_tables: need unit stride in their last dimension")
    if query_start_loc.stride(0) != 1 or seq_lens.stride(0) != 1:
        raise ValueError("query_start_loc and seq_lens: need unit stride")
    out = torch.empty_like(q) if out is None else out
    if out.shape != q.shape or out.stride(2) != 1:
        raise ValueError(f"out: expected shape {tuple(q.shape)} with unit stride in the last dim")
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0 or max_query_len == 0:
        return out
    group = hq // hk
    group_pad = triton.next_power_of_2(group)
    tiles = tiles or default_tiles(q.shape[2], q.dtype, q.device)
    block_m = max(tiles.block_m, group_pad)  # at least one token per program
    tokens = block_m // group_pad
    grid = (hk, num_reqs, triton.cdiv(max_query_len, tokens))
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens,
        *args, out.stride(0), out.stride(1),
        **meta,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_M=block_m,
        TOKENS=tokens,  # BLOCK_M // GROUP_PAD query tokens per program
        TILE_N=tiles.tile_n,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )  # fmt: skip
    return out


@dataclass(slots=True)
class _PrefillState(_TorchState):
    """The torch backend's state (its per-request prefill list empty on the varlen path) and the
    longest prefill chunk of the step, which sizes the kernel's grid."""

    max_prefill_len: int = 0


class TritonBackend(TritonDecodeBackend):
    """The Triton backend: decodes through the paged decode kernel, every prefill chunk of the
    step through one varlen paged-prefill launch.

    varlen_prefill=False keeps the previous path, one SDPA call per prefill chunk (the context
    gathered and masked on the host when part of it was cached); the prefill benchmark flips it
    on a live engine to time both.
    """

    def __init__(self, varlen_prefill: bool = True, tiles: PrefillTiles | None = None) -> None:
        super().__init__()
        self.varlen_prefill = varlen_prefill
        self.tiles = tiles

    def prepare(self, meta: AttentionMetadata) -> None:
        if not self.varlen_prefill:
            super().prepare(meta)
            return
        qsl, nd = meta.query_start_loc_cpu, meta.num_decodes
        longest = max((qsl[i + 1] - qsl[i] for i in range(nd, meta.num_reqs)), default=0)
        meta.backend_state = _PrefillState([], max_prefill_len=longest)

    def _prefills(
        self, out: Tensor, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata, kv: LayerKV
    ) -> None:
        """Every prefill chunk of the step in one varlen launch."""
        state = meta.backend_state
        if isinstance(state, _PrefillState) and meta.bidirectional and not state.prefills:
            # The varlen kernel masks causally only: a step whose prefills hold image ranges
            # (Gemma 3) runs them per chunk with their masks, as varlen_prefill=False does.
            state.prefills = _prepare_prefills(meta)
        if not isinstance(state, _PrefillState) or state.prefills:
            super()._prefills(out, q, k, v, meta, kv)
        elif state.max_prefill_len:
            nd, p = meta.num_decodes, kv.p
            paged_prefill(
                q,
                kv.k_cache,
                kv.v_cache,
                meta.block_tables[nd:],
                meta.query_start_loc[nd:],
                meta.seq_lens[nd:],
                state.max_prefill_len,
                p.scale,
                window=p.window or 0,
                softcap=p.softcap or 0.0,
                sinks=p.sinks,
                out=out,
                tiles=self.tiles,
                kv_scale=p.kv_scale,
            )
