"""CUDA with flash-attn: one varlen call over the whole mixed batch.

flash-attn reads paged K/V itself only for pages of 256 tokens or more; with smaller blocks the
context is gathered into a packed [sum(seq_lens), Hk, D] tensor first (one index_select).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from flash_attn import flash_attn_varlen_func
from torch import Tensor

from workers.layers.attention import AttentionMetadata, LayerKV

_PAGED_MIN_BLOCK = 256


@dataclass(slots=True)
class _FlashState:
    # flash_attn_varlen_func's arguments that are the step's (the same for every layer):
    # cu_seqlens_q/k, max_seqlen_q/k and causal; built once in `prepare`.
    step_args: dict[str, object]
    context_slots: torch.Tensor | None  # [sum(seq_lens)] flat cache slots; None when paged


class FlashAttnBackend:
    """flash_attn_varlen_func with a bottom-right causal mask (queries are each context's tail)."""

    name = "flash_attn"
    supports_cuda_graphs = False  # not yet verified on a GPU with flash-attn installed

    def prepare(self, meta: AttentionMetadata) -> None:
        dev, bs = meta.seq_lens.device, meta.block_size
        cu_k = torch.zeros(meta.num_reqs + 1, dtype=torch.int32, device=dev)
        torch.cumsum(meta.seq_lens, 0, out=cu_k[1:])
        slots = None
        if bs < _PAGED_MIN_BLOCK:
            seq_lens = meta.seq_lens.long()
            row = torch.repeat_interleave(torch.arange(meta.num_reqs, device=dev), seq_lens)
            pos = torch.arange(row.numel(), device=dev) - (cu_k[:-1].long())[row]
            slots = meta.block_tables[row, pos // bs].long() * bs + pos % bs
        step_args: dict[str, object] = {
            "cu_seqlens_q": meta.query_start_loc,
            "cu_seqlens_k": cu_k,
            "max_seqlen_q": meta.max_query_len,
            "max_seqlen_k": meta.max_seq_len,
            "causal": True,
        }
        meta.backend_state = _FlashState(step_args, slots)

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata, kv: LayerKV
    ) -> Tensor:
        p, k_cache, v_cache = kv.p, kv.k_cache, kv.v_cache
        window = p.window
        if p.kv_scale is not None:  # refused at start (workers/kv_fp8.py check_device)
            raise ValueError("kv_cache_dtype: flash_attn cannot read an FP8 cache")
        if p.sinks is not None:
            raise ValueError(
                "attention_backend: flash_attn has no attention sinks (gpt-oss); "
                "use triton or torch"
            )
        if meta.bidirectional:
            raise ValueError(
                "attention_backend: flash_attn cannot attend an image's tokens both ways "
                "(Gemma 3); use triton or torch"
            )
        st: _FlashState = meta.backend_state
        # flash-attn's left window counts the keys before the query's own position; its tanh cap
        # is the same formula (0: none).
        layer_args = {
            "softmax_scale": p.scale,
            "window_size": (window - 1 if window else -1, 0 if window else -1),
            "softcap": p.softcap or 0.0,
        }
        if st.context_slots is None:
            return flash_attn_varlen_func(
                q, k_cache, v_cache, block_table=meta.block_tables, **st.step_args, **layer_args
            )
        hk, d = k_cache.shape[2], k_cache.shape[3]
        k_ctx = k_cache.view(-1, hk, d).index_select(0, st.context_slots)
        v_ctx = v_cache.view(-1, hk, d).index_select(0, st.context_slots)
        return flash_attn_varlen_func(q, k_ctx, v_ctx, **st.step_args, **layer_args)
