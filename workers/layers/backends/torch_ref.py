"""Attention in torch (CPU and CUDA): decodes batched (a paged C++ kernel on CPU), prefill chunks
per request."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.layers.attention import AttentionMetadata
from workers.layers.backends import cpu_paged


@dataclass(slots=True)
class _Prefill:
    start: int  # first query token in the flattened batch
    end: int
    block_ids: torch.Tensor | None  # context blocks to gather; None: the chunk is the whole context
    seq_len: int
    mask: torch.Tensor | None  # [q, seq_len] bool, True where the query may attend


@dataclass(slots=True)
class _TorchState:
    prefills: list[_Prefill]
    # Gather path only, derived at the first layer that takes it (the CPU kernel needs none of it):
    decode_block_ids: torch.Tensor | None = None  # [num_decodes * blocks] flattened
    decode_mask: torch.Tensor | None = (
        None  # [num_decodes, 1, 1, blocks * block_size] additive (0 / -inf)
    )
    # Gather buffers reused by every layer of the step (fresh large allocations page-fault on CPU).
    k_buf: torch.Tensor | None = None
    v_buf: torch.Tensor | None = None


class TorchBackend:
    """Decodes: on CPU a C++ kernel that reads K/V through the block table (workers/layers/backends/
    cpu_paged.py), else gather each context's blocks and run masked SDPA. Prefills: SDPA per
    request."""

    name = "torch"
    # Decode gathers as many blocks as the longest context of the step: a shape graphs cannot fix.
    supports_cuda_graphs = False

    def __init__(self, paged_kernel: bool = False) -> None:
        """paged_kernel: decode CPU tensors with the compiled kernel when it builds here."""
        self.kernel = cpu_paged.load() if paged_kernel else None

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.backend_state = _TorchState(_prepare_prefills(meta))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        state: _TorchState = meta.backend_state
        out = q.new_empty(
            q.shape
        )  # contiguous, whatever q's strides (it may view a fused QKV output)
        nd = meta.num_decodes
        if nd and self._kernel_takes(q, k_cache):
            self.kernel(
                out[:nd],
                q[:nd],
                k_cache,
                v_cache,
                meta.block_tables[:nd],
                meta.seq_lens[:nd],
                scale,
            )
        elif nd:
            out[:nd] = self.decode(q[:nd], k_cache, v_cache, meta, scale)
        _prefill(out, q, k, v, k_cache, v_cache, state.prefills, scale)
        return out

    def _kernel_takes(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        return (
            self.kernel is not None
            and q.device.type == "cpu"
            and k_cache.is_contiguous()
            and cpu_paged.supports(q.dtype, q.shape[-1])
        )

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """One query token per request: gather each context through the block table, masked SDPA.

        The query heads of a GQA group act as that KV head's query rows, so K/V are never repeated.
        """
        state: _TorchState = meta.backend_state
        if state.decode_block_ids is None:
            state.decode_block_ids, state.decode_mask = _prepare_gather(meta)
        nd, hq, d = q.shape
        hk = k_cache.shape[2]
        if state.k_buf is None:
            shape = (state.decode_block_ids.numel(), *k_cache.shape[1:])
            state.k_buf = torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device)
            state.v_buf = torch.empty_like(state.k_buf)
        k = torch.index_select(k_cache, 0, state.decode_block_ids, out=state.k_buf)
        v = torch.index_select(v_cache, 0, state.decode_block_ids, out=state.v_buf)
        k = k.view(nd, -1, hk, d).transpose(1, 2)
        v = v.view(nd, -1, hk, d).transpose(1, 2)
        if state.decode_mask.dtype != q.dtype:  # once per step, not once per layer
            state.decode_mask = state.decode_mask.to(q.dtype)
        o = F.scaled_dot_product_attention(
            q.view(nd, hk, hq // hk, d), k, v, attn_mask=state.decode_mask, scale=scale
        )
        return o.reshape(nd, hq, d)


def _prepare_gather(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Flattened block ids of the decodes' contexts (as many blocks as the longest) and the mask
    that hides each row's positions past its own length."""
    nd, bs = meta.num_decodes, meta.block_size
    nblocks = -(-max(meta.seq_lens_cpu[:nd]) // bs)
    ids = meta.block_tables[:nd, :nblocks].reshape(-1).long()
    pos = torch.arange(nblocks * bs, device=meta.seq_lens.device)
    outside = (pos[None, :] >= meta.seq_lens[:nd, None]).view(nd, 1, 1, -1)
    mask = torch.zeros(outside.shape, device=outside.device).masked_fill_(outside, float("-inf"))
    return ids, mask


def _prepare_prefills(meta: AttentionMetadata) -> list[_Prefill]:
    prefills = []
    qsl, bs, dev = meta.query_start_loc_cpu, meta.block_size, meta.block_tables.device
    for i in range(meta.num_decodes, meta.num_reqs):
        start, end, seq_len = qsl[i], qsl[i + 1], meta.seq_lens_cpu[i]
        q_len = end - start
        if q_len == seq_len:
            prefills.append(_Prefill(start, end, None, seq_len, None))
            continue
        causal = torch.arange(seq_len, device=dev)[None, :] <= torch.arange(q_len, device=dev)[
            :, None
        ] + (seq_len - q_len)
        blocks = meta.block_tables[i, : -(-seq_len // bs)].long()
        prefills.append(_Prefill(start, end, blocks, seq_len, causal))
    return prefills


def _prefill(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefills: list[_Prefill],
    scale: float,
) -> None:
    """Prefill chunks one request at a time (few per step, each a large matmul).

    SDPA gets 4-D [1, H, L, D] views: on CPU, 3-D inputs fall off the fused flash kernel onto the
    math path (a score matrix per head and many more passes over memory).
    """
    for p in prefills:
        qi = q[p.start : p.end].transpose(0, 1).unsqueeze(0)
        if p.block_ids is None:  # no cached context: the chunk's own K/V are the whole context
            ki = k[p.start : p.end].transpose(0, 1).unsqueeze(0)
            vi = v[p.start : p.end].transpose(0, 1).unsqueeze(0)
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            ki = _gather(k_cache, p.block_ids)[: p.seq_len].transpose(0, 1).unsqueeze(0)
            vi = _gather(v_cache, p.block_ids)[: p.seq_len].transpose(0, 1).unsqueeze(0)
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=p.mask, scale=scale, enable_gqa=True
            )
        out[p.start : p.end] = oi[0].transpose(0, 1)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Blocks of the cache, concatenated: [len(block_ids) * block_size, Hk, D]."""
    _, _, hk, d = cache.shape
    return cache.index_select(0, block_ids).view(-1, hk, d)
