"""Attention in torch (CPU and CUDA): decodes batched (a paged C++ kernel on CPU), prefill chunks
per request."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from workers.kv_fp8 import dequantize
from workers.layers import invariant
from workers.layers.attention import AttentionMetadata, AttentionParams, LayerKV
from workers.layers.backends import cpu_paged


@dataclass(slots=True)
class _Prefill:
    start: int  # first query token in the flattened batch
    end: int
    block_ids: torch.Tensor | None  # context blocks to gather; None: the chunk is the whole context
    seq_len: int
    mask: torch.Tensor | None  # [q, seq_len] bool, True where the query may attend
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # sliding window -> mask
    # Context ranges [lo, hi) whose tokens also attend forward to each other (meta.bidirectional,
    # read at the first layer); None: not read yet.
    spans: list[tuple[int, int]] | None = None
    span_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def mask_for(self, window: int | None, dev: torch.device) -> torch.Tensor | None:
        """The causal mask, narrowed to the last `window` positions of each query when the
        context is longer than the window; None: plain causal over the chunk itself."""
        if self.spans:
            return self._span_mask(window, dev)
        if window is None or window >= self.seq_len:
            return self.mask
        if window not in self.windowed:
            q_len = self.end - self.start
            q_pos = torch.arange(q_len, device=dev)[:, None] + (self.seq_len - q_len)
            k_pos = torch.arange(self.seq_len, device=dev)[None, :]
            self.windowed[window] = (k_pos <= q_pos) & (k_pos > q_pos - window)
        return self.windowed[window]

    def _span_mask(self, window: int | None, dev: torch.device) -> torch.Tensor:
        """Causal or inside one span, then (sliding window) only keys after q - window: the
        window bounds a span's forward reach as transformers' Gemma 3 masks do."""
        if window not in self.span_masks:
            q_len = self.end - self.start
            q_pos = torch.arange(q_len, device=dev)[:, None] + (self.seq_len - q_len)
            k_pos = torch.arange(self.seq_len, device=dev)[None, :]
            mask = k_pos <= q_pos
            for lo, hi in self.spans or ():
                mask |= (q_pos >= lo) & (q_pos < hi) & (k_pos >= lo) & (k_pos < hi)
            if window is not None:
                mask &= k_pos > q_pos - window
            self.span_masks[window] = mask
        return self.span_masks[window]

    def read_spans(self, flat: list[tuple[int, int]]) -> None:
        """This chunk's ranges of the step's flat `meta.bidirectional`, as context positions."""
        shift = self.seq_len - (self.end - self.start) - self.start
        mine = [(lo, hi) for lo, hi in flat if self.start <= lo < self.end]
        if any(hi > self.end for _, hi in mine):
            raise ValueError(f"bidirectional: {mine} crosses the end of the chunk at {self.end}")
        self.spans = [(lo + shift, hi + shift) for lo, hi in mine]


@dataclass(slots=True)
class _TorchState:
    prefills: list[_Prefill]
    # Gather path only, derived at the first layer that takes it (the CPU kernel needs none of it):
    decode_block_ids: torch.Tensor | None = None  # [num_decodes * blocks] flattened
    # sliding window (None: full) -> [num_decodes, 1, 1, blocks * block_size] additive (0 / -inf)
    decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    # Gather buffers reused by every layer of the step (fresh large allocations page-fault on CPU).
    k_buf: torch.Tensor | None = None
    v_buf: torch.Tensor | None = None
    # Batch-invariant mode (workers/layers/invariant.py): one paged-kernel row per query token,
    # its request's block table and its own position + 1 as the context length.
    token_rows: tuple[torch.Tensor, torch.Tensor] | None = None


def attend_eager(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, p: AttentionParams
) -> torch.Tensor:
    """What SDPA cannot express: a tanh soft-cap on the scores and per-head sink logits. Scores,
    cap, mask, softmax (float32) with the sink as one more column that is then dropped, as
    transformers' eager attention does.

    q: [..., Hk, G, Lq, D]; k, v: [..., Hk, 1, Lk, D]; mask: bool (True: attend) or additive,
    broadcastable to the scores [..., Hk, G, Lq, Lk]; None: causal from the end."""
    s = torch.matmul(q, k.transpose(-1, -2)).float() * p.scale
    if p.softcap:
        s = torch.tanh(s / p.softcap) * p.softcap
    if mask is None:
        lq, lk = s.shape[-2], s.shape[-1]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=s.device).tril(lk - lq)
    s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    if p.sinks is None:
        return torch.matmul(s.softmax(-1).to(v.dtype), v)
    sink = p.sinks.float().view(*s.shape[-4:-2], 1, 1).expand(*s.shape[:-1], 1)
    probs = torch.cat([s, sink], dim=-1).softmax(-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def attend_prefill_eager(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, p: AttentionParams
) -> torch.Tensor:
    """SDPA's layout: q [1, Hq, Lq, D], k/v [1, Hk, Lk, D] -> [1, Hq, Lq, D]."""
    _, hq, lq, d = q.shape
    hk = k.shape[1]
    o = attend_eager(q.view(1, hk, hq // hk, lq, d), k.unsqueeze(2), v.unsqueeze(2), mask, p)
    return o.reshape(1, hq, lq, d)


# The C++ kernel's "no sinks" (it runs on CPU only): one empty float32 tensor, not one per call.
_NO_SINKS = torch.empty(0, dtype=torch.float32)


def _first(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:n] without a slice op where that is all of x (a pure-decode step)."""
    return x if x.shape[0] == n else x[:n]


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
        if self.kernel is not None and invariant.active():
            meta.backend_state.token_rows = _token_rows(meta)

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata, kv: LayerKV
    ) -> Tensor:
        """The one dispatch of the torch and Triton backends: decode rows first (`_decodes`), then
        the prefill chunks (`_prefills`); with batch-invariant rows every token is a decode."""
        state: _TorchState = meta.backend_state
        out = q.new_empty(q.shape)  # contiguous, whatever q's strides (it may view a fused QKV)
        if state.token_rows is not None:  # every token a decode row (invariant.py)
            self._token_rows(out, q, meta, kv)
            return out
        if meta.num_decodes:
            self._decodes(out, q, meta, kv)
        self._prefills(out, q, k, v, meta, kv)
        return out

    def _token_rows(self, out: Tensor, q: Tensor, meta: AttentionMetadata, kv: LayerKV) -> None:
        if meta.bidirectional:
            raise ValueError("batch_invariant: cannot attend an image's tokens both ways")
        if not self._kernel_takes(q, kv):
            raise ValueError(
                f"batch_invariant: needs the CPU paged kernel, which takes float caches of "
                f"head sizes {cpu_paged.HEAD_SIZES} ({q.dtype}, head size {q.shape[-1]})"
            )
        self._paged(out, q, kv, *meta.backend_state.token_rows)

    def _decodes(self, out: Tensor, q: Tensor, meta: AttentionMetadata, kv: LayerKV) -> None:
        """Rows [0, num_decodes): the paged C++ kernel where it takes them, else `decode`."""
        nd = meta.num_decodes
        if self._kernel_takes(q, kv):
            tables, seq_lens = _first(meta.block_tables, nd), _first(meta.seq_lens, nd)
            self._paged(_first(out, nd), _first(q, nd), kv, tables, seq_lens)
        else:
            out[:nd] = self.decode(q[:nd], meta, kv)

    def _prefills(
        self, out: Tensor, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata, kv: LayerKV
    ) -> None:
        """The prefill chunks, one SDPA call each (image ranges read at the first layer)."""
        state: _TorchState = meta.backend_state
        if meta.bidirectional:
            for c in state.prefills:
                if c.spans is None:
                    c.read_spans(meta.bidirectional)
        _prefill(out, q, k, v, kv, state.prefills)

    def _paged(self, out: Tensor, q: Tensor, kv: LayerKV, tables: Tensor, seq_lens: Tensor) -> None:
        """The paged C++ kernel: row i of q over the first seq_lens[i] positions of tables[i]."""
        assert self.kernel is not None
        p = kv.p
        sinks = _NO_SINKS if p.sinks is None else p.sinks.float().contiguous()
        v_cache = kv.v_cache[..., : kv.value_width] if kv.value_width else kv.v_cache
        self.kernel(
            out,
            q,
            kv.k_cache,
            v_cache,
            tables,
            seq_lens,
            p.scale,
            p.window or 0,
            p.softcap or 0.0,
            sinks,
        )

    def _kernel_takes(self, q: Tensor, kv: LayerKV) -> bool:
        """Whether the paged C++ kernel reads this layer's cache (float, contiguous, on CPU)."""
        return (
            self.kernel is not None
            and kv.p.kv_scale is None
            and q.device.type == "cpu"
            and kv.k_cache.is_contiguous()
            and cpu_paged.supports(q.dtype, q.shape[-1])
        )

    def decode(self, q: Tensor, meta: AttentionMetadata, kv: LayerKV) -> Tensor:
        """One query token per request: gather each context through the block table, masked SDPA
        (eager attention with a soft-cap or sinks, which SDPA has no place for). kv_scale: an
        FP8 cache's K and V scales (the gathered codes are de-quantized to q's dtype).

        The query heads of a GQA group act as that KV head's query rows, so K/V are never repeated.
        """
        state: _TorchState = meta.backend_state
        if state.decode_block_ids is None:
            state.decode_block_ids = _prepare_gather(meta)
        p, k_cache, v_cache = kv.p, kv.k_cache, kv.v_cache
        window, kv_scale = p.window, p.kv_scale
        if window not in state.decode_masks:  # once per step and window, not once per layer
            state.decode_masks[window] = _decode_mask(meta, window).to(q.dtype)
        mask = state.decode_masks[window]
        nd, hq, d = q.shape
        hk = k_cache.shape[2]
        if state.k_buf is None:
            shape = (state.decode_block_ids.numel(), *k_cache.shape[1:])
            state.k_buf = torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device)
            state.v_buf = torch.empty_like(state.k_buf)
        k = torch.index_select(k_cache, 0, state.decode_block_ids, out=state.k_buf)
        v = torch.index_select(v_cache, 0, state.decode_block_ids, out=state.v_buf)
        if kv_scale is not None:
            k, v = dequantize(k, kv_scale[0], q.dtype), dequantize(v, kv_scale[1], q.dtype)
        k = k.view(nd, -1, hk, d).transpose(1, 2)
        v = v.view(nd, -1, hk, d).transpose(1, 2)
        if p.eager:  # [nd, hk, G, 1, D] queries against [nd, hk, 1, L, D] keys
            qg = q.view(nd, hk, hq // hk, 1, d)
            o = attend_eager(qg, k.unsqueeze(2), v.unsqueeze(2), mask.unsqueeze(2), p)
        else:
            o = F.scaled_dot_product_attention(
                q.view(nd, hk, hq // hk, d), k, v, attn_mask=mask, scale=p.scale
            )
        return o.reshape(nd, hq, d)


def _prepare_gather(meta: AttentionMetadata) -> torch.Tensor:
    """Flattened block ids of the decodes' contexts (as many blocks as the longest)."""
    nd, bs = meta.num_decodes, meta.block_size
    nblocks = -(-max(meta.seq_lens_cpu[:nd]) // bs)
    return meta.block_tables[:nd, :nblocks].reshape(-1).long()


def _decode_mask(meta: AttentionMetadata, window: int | None) -> torch.Tensor:
    """The additive mask over the gathered contexts that hides each row's positions past its own
    length and, with a sliding window, those `window` or more tokens behind its query."""
    nd, bs = meta.num_decodes, meta.block_size
    nblocks = -(-max(meta.seq_lens_cpu[:nd]) // bs)
    pos = torch.arange(nblocks * bs, device=meta.seq_lens.device)[None, :]
    seq_lens = meta.seq_lens[:nd, None]
    outside = pos >= seq_lens
    if window is not None:
        outside |= pos < seq_lens - window
    outside = outside.view(nd, 1, 1, -1)
    return torch.zeros(outside.shape, device=outside.device).masked_fill_(outside, float("-inf"))


def _token_rows(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(block table, context length) of every query token: a prompt token at position t of its
    request attends over positions 0..t as a decode token there would."""
    qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    query_lens = [qsl[i + 1] - qsl[i] for i in range(meta.num_reqs)]
    ends = [
        length
        for i, n in enumerate(query_lens)
        for length in range(seq_lens[i] - n + 1, seq_lens[i] + 1)
    ]
    repeats = torch.tensor(query_lens, device=meta.block_tables.device)
    tables = meta.block_tables[: meta.num_reqs].repeat_interleave(repeats, dim=0)
    lens = torch.tensor(ends, dtype=meta.seq_lens.dtype, device=meta.seq_lens.device)
    return tables.contiguous(), lens


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
    kv: LayerKV,
    prefills: list[_Prefill],
) -> None:
    """Prefill chunks one request at a time (few per step, each a large matmul).

    A chunk with cached context reads the whole context from the cache (de-quantized with
    kv_scale when it holds FP8 codes); a chunk that is its whole context attends to its own fresh
    K/V, unrounded, as the cache's first writer.

    SDPA gets 4-D [1, H, L, D] views: on CPU, 3-D inputs fall off the fused flash kernel onto the
    math path (a score matrix per head and many more passes over memory).
    """
    p, kv_scale = kv.p, kv.p.kv_scale
    for c in prefills:
        qi = q[c.start : c.end].transpose(0, 1).unsqueeze(0)
        mask = c.mask_for(p.window, q.device)
        if c.block_ids is None:  # no cached context: the chunk's own K/V are the whole context
            ki = k[c.start : c.end].transpose(0, 1).unsqueeze(0)
            vi = v[c.start : c.end].transpose(0, 1).unsqueeze(0)
        else:
            kc = _gather(kv.k_cache, c.block_ids)[: c.seq_len]
            vc = _gather(kv.v_cache, c.block_ids)[: c.seq_len]
            if kv_scale is not None:
                kc, vc = dequantize(kc, kv_scale[0], q.dtype), dequantize(vc, kv_scale[1], q.dtype)
            ki = kc.transpose(0, 1).unsqueeze(0)
            vi = vc.transpose(0, 1).unsqueeze(0)
        if p.eager:
            oi = attend_prefill_eager(qi, ki, vi, mask, p)
        else:
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, is_causal=mask is None, scale=p.scale, enable_gqa=True
            )
        out[c.start : c.end] = oi[0].transpose(0, 1)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Blocks of the cache, concatenated: [len(block_ids) * block_size, Hk, D]."""
    _, _, hk, d = cache.shape
    return cache.index_select(0, block_ids).view(-1, hk, d)
