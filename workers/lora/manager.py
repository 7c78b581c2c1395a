"""The worker side of LoRA: slot tensors attached to a model's linears, a CPU cache of adapters
read from disk, and the per-step batch of adapter rows.

The scheduler decides which adapter holds which slot (scheduler/lora_slots.py) and sends the loads
with the step; every tensor-parallel rank loads them before the step's forward, slicing each
adapter for its own shard.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import torch
from torch import nn

from workers.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from workers.lora.adapter import LoraAdapter, ModelShapes, read_adapter
from workers.lora.layers import LoraBatch, LoraLayer, Segment

logger = logging.getLogger(__name__)


class LoraManager:
    """Adapters of one rank's model: `max_loras` device slots over an LRU of `max_cpu_loras`."""

    def __init__(
        self,
        model: nn.Module,
        hf_config,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.shapes = ModelShapes.from_hf_config(hf_config)
        self.max_rank, self.max_cpu_loras = max_rank, max(max_cpu_loras, 1)
        self.dtype, self.device = dtype, device
        self.batch = LoraBatch()
        # layer index -> the LoRA layers of its linears
        self.layers: list[list[LoraLayer]] = []
        for layer in model.model.layers:
            found = []
            for linear, target in (
                (layer.self_attn.qkv_proj, ""),
                (layer.self_attn.o_proj, "o_proj"),
                (getattr(layer.mlp, "gate_up_proj", None), ""),
                (getattr(layer.mlp, "down_proj", None), "down_proj"),
            ):
                if linear is None:  # a mixture-of-experts layer has no dense MLP
                    continue
                lora = self._make_layer(linear, target, max_loras, max_rank)
                linear.lora = lora
                found.append(lora)
            self.layers.append(found)
        self.slot_of: dict[str, int] = {}
        self.cache: OrderedDict[tuple[str, str], LoraAdapter] = OrderedDict()
        self.num_disk_reads = 0

    def _make_layer(
        self, linear: nn.Module, target: str, max_loras: int, max_rank: int
    ) -> LoraLayer:
        segments, in_offset = _segments(linear, target)
        in_features = _weight_shape(linear)[1]
        return LoraLayer(
            self.batch,
            segments,
            in_features,
            in_offset,
            max_loras,
            max_rank,
            self.dtype,
            self.device,
        )

    # ---- slots ---------------------------------------------------------------------------------
    def load(self, loads: dict[int, tuple[str, str]]) -> None:
        """Fill slots as the scheduler assigned them (slot -> (name, path))."""
        for slot, (name, path) in loads.items():
            adapter = self._adapter(name, path)
            for stale in [n for n, s in self.slot_of.items() if s == slot]:
                del self.slot_of[stale]
            by_layer: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
            for (layer, target), pair in adapter.weights.items():
                by_layer.setdefault(layer, {})[target] = pair
            for index, loras in enumerate(self.layers):
                weights = by_layer.get(index, {})
                for lora in loras:
                    lora.load(slot, weights)
            self.slot_of[name] = slot

    def _adapter(self, name: str, path: str) -> LoraAdapter:
        key = (name, path)
        adapter = self.cache.get(key)
        if adapter is None:
            t0 = time.perf_counter()
            adapter = read_adapter(name, path, self.shapes, self.max_rank, self.dtype)
            self.num_disk_reads += 1
            logger.info("LoRA %s read from %s in %.3fs", name, path, time.perf_counter() - t0)
            self.cache[key] = adapter
            while len(self.cache) > self.max_cpu_loras:
                self.cache.popitem(last=False)
        self.cache.move_to_end(key)
        return adapter

    def slot(self, name: str | None) -> int:
        """The device slot of a running request's adapter; -1 for the base model."""
        if name is None:
            return -1
        slot = self.slot_of.get(name)
        if slot is None:  # the scheduler loads an adapter before any step that runs it
            raise RuntimeError(f"lora: adapter {name!r} has no slot")
        return slot

    # ---- one step ------------------------------------------------------------------------------
    def set_batch(self, slots: list[int], query_lens: list[int]) -> bool:
        """Group the step's adapter rows by slot from each request's slot and token count; False
        (and the LoRA path off) when no request has an adapter."""
        batch = self.batch
        top = max(slots, default=-1)
        if top < 0:
            batch.active, batch.index, batch.valid = False, None, None
            return False
        per_token = torch.repeat_interleave(
            torch.tensor(slots, dtype=torch.long), torch.tensor(query_lens, dtype=torch.long)
        )
        rows = (per_token >= 0).nonzero().squeeze(1)
        slot_of_row = per_token.index_select(0, rows)
        m = top + 1
        counts = torch.bincount(slot_of_row, minlength=m)
        group = int(counts.max())
        order = torch.argsort(slot_of_row, stable=True)
        starts = torch.cumsum(counts, 0) - counts  # each slot's first row in `order`
        sorted_slots = slot_of_row.index_select(0, order)
        position = torch.arange(len(order)) - starts.index_select(0, sorted_slots)
        flat = sorted_slots * group + position
        index = torch.zeros(m * group, dtype=torch.long)
        index[flat] = rows.index_select(0, order)
        batch.num_slots, batch.group = m, group
        batch.index = index.to(self.device, non_blocking=True)
        batch.valid = None
        if len(rows) < m * group:  # some groups are padded: their rows must add nothing
            valid = torch.zeros(m * group, dtype=self.dtype)
            valid[flat] = 1
            batch.valid = valid.view(m, group, 1).to(self.device)
        batch.active = True
        return True


def _weight_shape(linear: nn.Module) -> tuple[int, int]:
    """This rank's [out, in] of a linear's weight, also when it is kept as GGUF blocks, FP8 or
    INT4 (whose float storage was freed)."""
    kept = getattr(linear.weight, "gguf", None) or getattr(linear.weight, "quant", None)
    out_features, in_features = (kept if kept is not None else linear.weight).shape
    return int(out_features), int(in_features)


def _segments(linear: nn.Module, target: str) -> tuple[list[Segment], int | None]:
    """The output segments of a linear on this rank, and where its A columns start (row-parallel
    linears, whose one target is named) or None (A replicated)."""
    if isinstance(linear, RowParallelLinear):
        n = _weight_shape(linear)[0]
        return [Segment(target, 0, n, 0)], linear.tp_rank * linear.input_size_per_rank
    if isinstance(linear, QKVParallelLinear):
        q, kv, rank = linear.q_size, linear.kv_size, linear.tp_rank
        kv_index = rank // linear.kv_replicas
        return [
            Segment("q_proj", 0, q, rank * q),
            Segment("k_proj", q, kv, kv_index * kv),
            Segment("v_proj", q + kv, kv, kv_index * kv),
        ], None
    if isinstance(linear, MergedColumnParallelLinear):
        gate, up = linear.output_sizes
        rank = linear.tp_rank
        return [
            Segment("gate_proj", 0, gate, rank * gate),
            Segment("up_proj", gate, up, rank * up),
        ], None
    if isinstance(linear, ColumnParallelLinear):
        raise ValueError(f"lora: no LoRA target for {type(linear).__name__}")
    raise ValueError(f"lora: cannot adapt {type(linear).__name__}")
