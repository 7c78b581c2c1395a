"""KV heads between engines of different tensor-parallel sizes (prefill TP=2 -> decode TP=1, and
back): which of the sender's shards, and which heads of each, make one receiving rank's KV.

Rank r of a TP=t engine holds the KV heads QKVParallelLinear gives it (workers/layers/linear.py):
heads [r*H/t, (r+1)*H/t) when t <= H, else the one head r // (t/H) (replicated on t/H ranks). A
receiving rank takes, in head order, each of its heads from the first sending rank that holds it,
and joins them along the heads axis of every layer's K and V. The functions are pure (no torch
beyond `join`), so the plan is tested apart from any transfer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from workers.layers.mla import is_mla_config


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """Heads [start, stop) of the sending rank `src_rank`'s shard."""

    src_rank: int
    start: int
    stop: int


def total_kv_heads(config: PretrainedConfig) -> int:
    """The model's KV heads over all ranks (an MLA model's latent row: one, on every rank)."""
    if is_mla_config(config):
        return 1
    return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)


def rank_heads(num_kv_heads: int, tp: int, rank: int) -> range:
    """The global KV heads that rank `rank` of `tp` holds."""
    if num_kv_heads < 1 or tp < 1 or not 0 <= rank < tp:
        raise ValueError(f"rank_heads: heads {num_kv_heads}, tp {tp}, rank {rank} do not fit")
    if tp >= num_kv_heads:
        if tp % num_kv_heads:
            raise ValueError(f"tensor_parallel_size: {tp} is not a multiple of {num_kv_heads}")
        head = rank // (tp // num_kv_heads)
        return range(head, head + 1)
    if num_kv_heads % tp:
        raise ValueError(f"num_key_value_heads: {num_kv_heads} does not split over {tp} ranks")
    per = num_kv_heads // tp
    return range(rank * per, (rank + 1) * per)


def plan(num_kv_heads: int, src_tp: int, dst_tp: int, dst_rank: int) -> list[HeadSlice]:
    """The sender's head slices that, joined in order, are rank `dst_rank`'s KV heads."""
    slices: list[HeadSlice] = []
    for head in rank_heads(num_kv_heads, dst_tp, dst_rank):
        src = next(r for r in range(src_tp) if head in rank_heads(num_kv_heads, src_tp, r))
        local = head - rank_heads(num_kv_heads, src_tp, src).start
        last = slices[-1] if slices else None
        if last is not None and last.src_rank == src and last.stop == local:
            slices[-1] = HeadSlice(src, last.start, local + 1)
        else:
            slices.append(HeadSlice(src, local, local + 1))
    return slices


def readers(num_kv_heads: int, src_tp: int, dst_tp: int, src_rank: int) -> int:
    """How many receiving ranks read sending rank `src_rank`'s shard (a transport may free the
    shard once that many have fetched it)."""
    return sum(
        any(s.src_rank == src_rank for s in plan(num_kv_heads, src_tp, dst_tp, r))
        for r in range(dst_tp)
    )


def join(parts: list[torch.Tensor], slices: list[HeadSlice]) -> torch.Tensor:
    """One block's KV for the receiving rank: parts[i] is slice i's source block, shaped
    [layers, K/V, block_size, heads, head_dim]; every layer's heads are cut and joined."""
    if len(parts) == 1 and parts[0].shape[-2] == slices[0].stop - slices[0].start:
        return parts[0]
    return torch.cat([p[..., s.start : s.stop, :] for p, s in zip(parts, slices, strict=True)], -2)
