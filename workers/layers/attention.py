"""Attention over the paged KV cache for a flattened batch of prefill chunks and decode tokens.

The runner orders a batch decodes first (requests with one query token), then prefill chunks,
and builds one AttentionMetadata per step; the chosen backend derives what it needs from it once
(`prepare`) and every layer reuses that.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from workers.kv_fp8 import write_kv_fp8
from workers.layers.backend_choice import KERNEL_LIBRARIES, BackendInputs, choose_backend
from workers.layers.fused import fused_ops

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class AttentionMetadata:
    """Where each token's K/V goes and which cached context each request attends to."""

    slot_mapping: torch.Tensor  # [T] int64: flat cache slot (block * block_size + offset) per token
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32: context length after this step (cached + new tokens)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    num_decodes: int  # requests [0, num_decodes) have exactly one query token
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    backend_state: Any = field(default=None)
    # Flat token ranges [lo, hi) of this step whose tokens also attend forward to each other (an
    # image's tokens in Gemma 3), each inside one prefill chunk. Set by the model before its
    # first layer (after `prepare`): backends read it when they build a prefill's mask.
    bidirectional: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.query_start_loc_cpu) != len(self.seq_lens_cpu) + 1:
            raise ValueError("query_start_loc_cpu: needs one more entry than seq_lens_cpu")

    @classmethod
    def build(
        cls,
        starts: list[int],
        query_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device,
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        """Metadata and token positions for requests that each compute query_lens[i] tokens from
        position starts[i]; requests with one query token must come first."""
        width = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
        return cls.from_tables(starts, query_lens, tables, block_size, device)

    @classmethod
    def from_tables(
        cls,
        starts: list[int],
        query_lens: list[int],
        tables: torch.Tensor,
        block_size: int,
        device: torch.device,
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        """As `build`, with the block tables already a host int32 tensor [B, width] (rows
        padded)."""
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        starts_t = torch.tensor(starts, dtype=torch.int32)
        if num_decodes == len(query_lens):  # pure decode: one token per request, at its start
            positions = starts_t.long()
            seq_lens = starts_t + 1
            cu = torch.arange(len(starts) + 1, dtype=torch.int32)
            block = tables.gather(1, (positions // block_size)[:, None]).squeeze(1)
        else:  # per-token request index and position; the slot follows from the block table
            q_lens = torch.tensor(query_lens, dtype=torch.int32)
            seq_lens = starts_t + q_lens
            row = torch.repeat_interleave(torch.arange(len(query_lens)), q_lens)
            cu = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
            torch.cumsum(q_lens, 0, out=cu[1:])
            positions = (
                starts_t[row] + torch.arange(len(row), dtype=torch.int32) - cu[:-1][row]
            ).long()
            block = tables[row, positions // block_size]
        slots = block.long() * block_size + positions % block_size
        meta = cls(
            slot_mapping=slots.to(device, non_blocking=True),
            query_start_loc=cu.to(device, non_blocking=True),
            seq_lens=seq_lens.to(device, non_blocking=True),
            block_tables=tables.to(device, non_blocking=True),
            num_decodes=num_decodes,
            query_start_loc_cpu=cu.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            block_size=block_size,
        )
        return meta, positions.to(device, non_blocking=True)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def max_query_len(self) -> int:
        q = self.query_start_loc_cpu
        return max((q[i + 1] - q[i] for i in range(len(q) - 1)), default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)


@dataclass(frozen=True, slots=True)
class AttentionParams:
    """What a layer's attention computes beyond q, k and v, passed whole to every backend.

    window: the query at position p attends to positions (p - window, p] only (a sliding
    window, as transformers defines it); None: to every position up to p.
    softcap: scores (after `scale`) become softcap * tanh(score / softcap) (Gemma 2).
    sinks: [Hq] float, one extra logit per head in the softmax's denominator that attends to
    nothing (gpt-oss's attention sinks).
    kv_scale: an FP8 cache (uint8 E4M3 codes, workers/kv_fp8.py): float32 [2], the scales
    of K and V; None: the cache holds floats of q's dtype.
    """

    scale: float
    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    kv_scale: torch.Tensor | None = None

    @property
    def eager(self) -> bool:
        """A soft-cap or sinks: what SDPA has no place for."""
        return bool(self.softcap) or self.sinks is not None


@dataclass(frozen=True, slots=True)
class LayerKV:
    """One layer's paged cache pair and its AttentionParams: what a backend attends over, and how.

    The layer builds it when its cache is bound (or its sinks change) and passes the same object
    every step, so the decode hot path makes no object per layer per step.
    """

    k_cache: torch.Tensor  # [num_blocks, block_size, Hk, D]; MLA: the same tensor as v_cache
    v_cache: torch.Tensor
    p: AttentionParams
    # Columns of each value row a decode kernel sums, 0 for all: MLA's values are the latent, the
    # first kv_lora_rank columns of its cached rows (the rotary key after them is a key only).
    value_width: int = 0


class AttentionBackend(Protocol):
    """Computes attention for a whole batch once K/V of the step are in the cache."""

    name: str
    supports_cuda_graphs: (
        bool  # a pure-decode forward may be captured (fixed shapes, no host syncs)
    )

    def prepare(self, meta: AttentionMetadata) -> None:
        """Derive per-step state (gather indices, masks) into meta.backend_state."""

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata, kv: LayerKV
    ) -> Tensor:
        """q: [T, Hq, D], k/v: [T, Hk, D] (already written to kv's caches) -> [T, Hq, D]."""


def select_backend(
    device: torch.device,
    name: str = "auto",
    dtype: torch.dtype = torch.float16,
    head_dim: int | None = None,
    block_size: int | None = None,
) -> AttentionBackend:
    """The backend for `attention_backend: name` (workers/layers/backend_choice.py decides:
    `auto` is the Triton decode kernel on CUDA, torch elsewhere; flash-attn only by name)."""
    inputs = BackendInputs(
        device_type=device.type,
        importable=frozenset(
            lib for lib in KERNEL_LIBRARIES if importlib.util.find_spec(lib) is not None
        ),
        dtype=str(dtype).removeprefix("torch."),
        head_dim=head_dim,
        block_size=block_size,
    )
    choice = choose_backend(name, inputs)
    if choice.name == "flash_attn":
        from workers.layers.backends.flash import FlashAttnBackend

        backend: AttentionBackend = FlashAttnBackend()
    elif choice.name == "triton":
        from workers.layers.backends.triton_prefill import TritonBackend

        backend = TritonBackend()
    else:
        from workers.layers.backends.torch_ref import TorchBackend

        backend = TorchBackend(paged_kernel=device.type == "cpu")
    logger.info("attention backend: %s (%s)", backend.name, choice.why)
    return backend


class Attention(nn.Module):
    """Writes the step's K/V into this layer's cache slots, then attends over the paged context."""

    kv_parts = 2  # cache tensors per layer (K and V); MLA's LatentAttention keeps 1

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window: must be at least 1, got {sliding_window}")
        if logit_softcap is not None and not (0 < logit_softcap < float("inf")):
            raise ValueError(
                f"attn_logit_softcapping: must be a positive number, got {logit_softcap}"
            )
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        self.backend: AttentionBackend | None = None
        self._kv: LayerKV | None = None  # the backend's view of the below, rebuilt when they change
        # [num_blocks, block_size, num_kv_heads, head_dim]; bound by workers.kv_cache.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # FP8 KV cache: float32 [2], this layer's K and V scales (bound with the cache); None:
        # the cache holds floats.
        self.kv_scale: torch.Tensor | None = None

    # Rebinding a cache tensor drops the LayerKV that holds the old one, so that unbinding (the
    # profile run's scratch pool, a weight update) frees its memory at once.
    @property
    def k_cache(self) -> Tensor:
        return self._k_cache

    @k_cache.setter
    def k_cache(self, cache: Tensor) -> None:
        self._k_cache, self._kv = cache, None

    @property
    def v_cache(self) -> Tensor:
        return self._v_cache

    @v_cache.setter
    def v_cache(self, cache: Tensor) -> None:
        self._v_cache, self._kv = cache, None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [T, Hq*D] or [T, Hq, D], k/v: [T, Hk*D] or [T, Hk, D] -> [T, Hq*D]; sinks: [Hq]
        per-head sink logits (this rank's heads) or None."""
        if self.backend is None or self.k_cache.numel() == 0:
            raise RuntimeError("Attention: KV cache and backend must be bound before the forward")
        t = q.shape[0]
        q = _heads(q, self.num_heads, self.head_dim)
        k = _heads(k, self.num_kv_heads, self.head_dim)
        v = _heads(v, self.num_kv_heads, self.head_dim)
        if self.kv_scale is None:
            write_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        else:
            write_kv_fp8(k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.kv_scale)
        return self.backend.forward(q, k, v, meta, self.layer_kv(sinks)).view(t, -1)

    def layer_kv(self, sinks: torch.Tensor | None = None) -> LayerKV:
        """The bound cache pair and this layer's parameters, as the backend takes them: built
        once, and again only when the cache is rebound or other sinks are passed."""
        kv = self._kv
        if kv is None or kv.p.sinks is not sinks or kv.p.kv_scale is not self.kv_scale:
            p = AttentionParams(
                self.scale, self.sliding_window, self.logit_softcap, sinks, self.kv_scale
            )
            kv = self._kv = LayerKV(self.k_cache, self.v_cache, p)
        return kv


def _heads(x: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """x as [T, heads, head_dim]; one given so already costs no view op (a decode step's few
    rows make every op's dispatch count)."""
    if x.dim() == 3 and x.shape[1] == heads and x.shape[2] == head_dim:
        return x
    return x.view(x.shape[0], heads, head_dim)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter the step's keys and values into their cache slots (one C++ call on CPU)."""
    ops = fused_ops(k, "write_kv")
    if ops is not None:
        ops.write_kv(k, v, k_cache, v_cache, slot_mapping)
        return
    hk, d = k.shape[1], k.shape[2]
    k_cache.view(-1, hk, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, hk, d).index_copy_(0, slot_mapping, v)
