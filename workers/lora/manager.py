"""The worker side of LoRA: slot tensors attached to a model's linears, the checked adapters the
engine handed every rank at load, and the per-step batch of adapter rows.

The engine reads and checks an adapter once, off its thread, and hands its tensors to every rank
(`keep`): a worker never reads an adapter's files, so they may vanish. The scheduler decides which
adapter holds which slot (scheduler/lora_slots.py) and sends the loads with the step; every
tensor-parallel rank loads them before the step's forward, slicing each adapter for its own shard.
An adapter that cannot be placed fails the requests that name it, never the step.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from transformers import PretrainedConfig

from workers.layers.linear import (
    ColumnParallelLinear,
    CpuPackedWeight,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from workers.lora.adapter import LoraAdapter, ModelShapes
from workers.lora.layers import LoraBatch, LoraLayer, Segment
from workers.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


class LoraManager:
    """Adapters of one rank's model: `max_loras` device slots over at most `max_cpu_loras` kept
    adapters."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        hf_config: PretrainedConfig,
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
        for attn, layer in zip(model.attention_blocks(), model.model.layers, strict=True):
            found = []
            linears: list[tuple[CpuPackedWeight | None, str]] = [
                (attn.qkv_proj, ""),
                (attn.o_proj, "o_proj"),
                (getattr(layer.mlp, "gate_up_proj", None), ""),
                (getattr(layer.mlp, "down_proj", None), "down_proj"),
            ]
            for linear, target in linears:
                if linear is None:  # a mixture-of-experts layer has no dense MLP
                    continue
                lora = self._make_layer(linear, target, max_loras, max_rank)
                linear.lora = lora
                found.append(lora)
            self.layers.append(found)
        self.slot_of: dict[str, int] = {}
        # identity (name@digest) -> the checked adapter the engine handed over at load
        self.kept: dict[str, LoraAdapter] = {}
        # This step's requests whose adapter holds no slot: request id -> why (batch_slots)
        self.unplaced: dict[str, str] = {}

    def _make_layer(
        self, linear: CpuPackedWeight, target: str, max_loras: int, max_rank: int
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

    # ---- adapters --------------------------------------------------------------------------
    def keep(self, adapter: LoraAdapter) -> None:
        """Hold a checked adapter until `drop`: what slots are filled from."""
        if adapter.identity not in self.kept and len(self.kept) >= self.max_cpu_loras:
            raise ValueError(f"max_cpu_loras: a rank keeps at most {self.max_cpu_loras} adapters")
        self.kept[adapter.identity] = adapter

    def drop(self, identity: str) -> None:
        """Forget an unloaded adapter (its slot, if it has one, is refilled before any use)."""
        self.kept.pop(identity, None)

    # ---- slots ---------------------------------------------------------------------------------
    def load(self, loads: dict[int, tuple[str, str]]) -> None:
        """Fill slots as the scheduler assigned them (slot -> (name, identity)). An adapter that
        cannot be placed leaves its slot empty: its requests fail (unplaced), the step goes on."""
        for slot, (name, identity) in loads.items():
            for stale in [n for n, s in self.slot_of.items() if s == slot]:
                del self.slot_of[stale]
            self.slot_of.pop(name, None)  # other weights under this name held another slot
            try:
                self._fill(slot, self.kept[identity])
            except Exception as exc:  # KeyError: never handed over; or the copy to the device
                logger.error("LoRA %s could not be placed in slot %d: %r", name, slot, exc)
                continue
            self.slot_of[name] = slot

    def _fill(self, slot: int, adapter: LoraAdapter) -> None:
        by_layer: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, target), pair in adapter.weights.items():
            by_layer.setdefault(layer, {})[target] = pair
        for index, loras in enumerate(self.layers):
            weights = by_layer.get(index, {})
            for lora in loras:
                lora.load(slot, weights)

    def batch_slots(self, req_ids: list[str], names: list[str | None]) -> list[int]:
        """Each batch row's device slot (-1: the base model). A row whose adapter holds no slot
        (it could not be placed) adds nothing to the base model's output and is listed in
        `unplaced`, which the runner reports as failed: its request fails, the step goes on."""
        self.unplaced = {}
        slots = []
        for rid, name in zip(req_ids, names):
            slot = -1 if name is None else self.slot_of.get(name, -1)
            if name is not None and slot < 0:
                self.unplaced[rid] = (
                    f"lora adapter {name!r} could not be placed on the device; unload and reload it"
                )
            slots.append(slot)
        return slots

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


def _weight_shape(linear: CpuPackedWeight) -> tuple[int, int]:
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
