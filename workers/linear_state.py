"""Per-request recurrent state of hybrid models on a worker: each linear-attention layer's conv
state [slots, C, K - 1] and delta-rule state [slots, H, Dk, Dv], one slot per running request.

The scheduler counts the slots (scheduler/state_slots.py): it admits a request only with a free
slot and frees it at finish and preemption, and both sides size the pool from `max_num_seqs`, so a
step never holds more requests than slots. The slot numbers themselves stay here, by request id:
a request takes one in the first step it runs and gives it back when it finishes or is preempted
(both travel in the SchedulerOutput). A slot is zeroed when its request's step starts at position
0, so a recomputed request starts from the state a fresh one has.

Prefix caching keeps `num_state_checkpoints` more slots after the running ones: copies of a state
at a block boundary, numbered by the scheduler (scheduler/state_checkpoints.py), which says in each
step's `state_copies` which request starts from which checkpoint (its prefix hit ends there) and
which row's state is copied to which checkpoint after how many of its tokens.

What is refused with such a model, and why (`check_hybrid_engine`): the KV tiers (a block brought
back from a tier has no state checkpoint with it), swap preemption (the state is not swapped with
the blocks: a victim recomputes, from a checkpoint when its prefix is still cached), speculative
decoding (a rejected proposal's update cannot be taken back from a recurrent state) and pipeline
stages (not built for these layers).
"""

from __future__ import annotations

import logging
from collections.abc import Container

import torch
from torch import nn
from transformers import PretrainedConfig

from scheduler.outputs import SchedulerOutput
from scheduler.state_slots import StateCopies
from workers.features.base import RunnerContext, RunnerFeature
from workers.kv_cache import GiB, KVCacheSpec
from workers.layers.gated_delta import DeltaStateView, GatedDeltaNet
from workers.layers.mamba2 import Mamba2Mixer
from workers.step_state import Batch

logger = logging.getLogger(__name__)

LINEAR_LAYER_TYPES = ("linear_attention",)
# The layers that keep a per-request state (each has `state` and `state_shapes()`).
STATEFUL = (GatedDeltaNet, Mamba2Mixer)
StatefulMixer = GatedDeltaNet | Mamba2Mixer


def is_hybrid_config(config: PretrainedConfig) -> bool:
    """Whether a model config has layers that keep a recurrent state instead of KV."""
    types = getattr(config, "layer_types", None) or ()
    return any(t in LINEAR_LAYER_TYPES for t in types)


def check_hybrid_engine(
    *, preemption_mode: str, speculative: bool, kv_tiers: bool, pipeline_parallel_size: int
) -> None:
    """Refuse, by setting, what a hybrid model cannot run with (the module docstring says why)."""
    if preemption_mode != "recompute":
        raise ValueError(
            f"preemption_mode: {preemption_mode!r} swaps KV blocks, but a hybrid model's "
            "recurrent state is not swapped with them; use 'recompute'"
        )
    if speculative:
        raise ValueError(
            "speculative: a hybrid model's recurrent state cannot take back rejected proposals"
        )
    if kv_tiers:
        raise ValueError(
            "kv_cpu_tier_gb: a block brought back from a KV tier has no recurrent-state "
            "checkpoint with it, and a hybrid model's prefix hit needs one"
        )
    if pipeline_parallel_size != 1:
        raise ValueError("pipeline_parallel_size: hybrid models run on one stage")


class LinearStateStore:
    """The state tensors of every linear layer, the slots' owners, and each layer's step view."""

    def __init__(
        self,
        layers: list[StatefulMixer],
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
        num_checkpoints: int = 0,
    ) -> None:
        self.views: list[DeltaStateView] = []
        total = num_slots + num_checkpoints  # checkpoint c is slot num_slots + c
        self.saves: dict[int, tuple[int, int]] = {}  # shared by every view: set each step
        for layer in layers:
            conv_shape, recurrent_shape = layer.state_shapes()
            conv = torch.zeros((total, *conv_shape), dtype=dtype, device=device)
            # float32 whatever the model's dtype, as transformers keeps it: a bf16 state would
            # round away each token's small update.
            shape = (total, *recurrent_shape)
            recurrent = torch.zeros(shape, dtype=torch.float32, device=device)
            layer.state = view = DeltaStateView(conv, recurrent, [], self.saves)
            self.views.append(view)
        self.num_slots = num_slots
        self.num_checkpoints = num_checkpoints
        self.slot_of: dict[str, int] = {}
        self.free = list(range(num_slots - 1, -1, -1))

    @property
    def nbytes(self) -> int:
        return sum(v.conv.nbytes + v.recurrent.nbytes for v in self.views)

    def assign(self, req_id: str, live: Container[str]) -> int:
        """req_id's slot, taking a free one on its first step; slots of requests no longer in
        `live` (a profiling run's) are reclaimed when none is free."""
        slot = self.slot_of.get(req_id)
        if slot is not None:
            return slot
        if not self.free:
            for rid in [r for r in self.slot_of if r not in live]:
                self.release(rid)
        if not self.free:  # the scheduler admits no more requests than slots: a bug if reached
            raise RuntimeError(f"linear state: no free slot of {self.num_slots} for {req_id!r}")
        slot = self.slot_of[req_id] = self.free.pop()
        return slot

    def release(self, req_id: str) -> None:
        slot = self.slot_of.pop(req_id, None)
        if slot is not None:
            self.free.append(slot)

    def begin_step(
        self,
        req_ids: list[str],
        starts: list[int],
        live: Container[str],
        copies: StateCopies | None = None,
    ) -> None:
        """Point every layer at the step's slots (batch order); a row starting at position 0 (a
        new or recomputed request) starts from a zeroed state, a prefix hit from a copy of its
        checkpoint. `copies`: the step's checkpoint copies (scheduler/state_checkpoints.py)."""
        restore = copies.restore if copies is not None else {}
        for rid, start in zip(req_ids, starts):
            if start and rid not in self.slot_of and rid not in restore:
                raise RuntimeError(  # its state before `start` exists nowhere
                    f"linear state: {rid!r} starts at position {start} without a state or a "
                    "checkpoint to restore (loaded KV is off for hybrid models)"
                )
        slots = [self.assign(rid, live) for rid in req_ids]
        fresh = [s for s, start in zip(slots, starts) if start == 0]
        if fresh:
            idx = torch.tensor(fresh, dtype=torch.long, device=self.views[0].conv.device)
            for view in self.views:
                view.conv[idx] = 0
                view.recurrent[idx] = 0
        self._bind_copies(req_ids, copies)
        for view in self.views:
            view.slots = slots

    def _bind_copies(self, req_ids: list[str], copies: StateCopies | None) -> None:
        """Restores now (before any save of this step can overwrite their checkpoint); saves
        bound by batch row for the layers to make inside the forward."""
        self.saves.clear()
        if copies is None:
            return
        for rid, checkpoint in copies.restore.items():
            for view in self.views:
                view.copy(self.checkpoint_slot(checkpoint), self.slot_of[rid])
        row_of = {rid: row for row, rid in enumerate(req_ids)}
        for rid, (offset, checkpoint) in copies.save.items():
            self.saves[row_of[rid]] = (offset, self.checkpoint_slot(checkpoint))

    def checkpoint_slot(self, checkpoint: int) -> int:
        if not 0 <= checkpoint < self.num_checkpoints:  # the scheduler numbers them: a bug
            raise RuntimeError(
                f"linear state: no checkpoint {checkpoint} of {self.num_checkpoints}"
            )
        return self.num_slots + checkpoint


class LinearStateFeature(RunnerFeature):
    """The runner's side of the state slots: allocates the store, counts it in the memory budget,
    keeps the slots in step with the requests, and binds each step's slots before the forward."""

    def __init__(self, ctx: RunnerContext, layers: list[StatefulMixer]) -> None:
        cfg = ctx.config
        if cfg.speculative is not None:
            raise ValueError(
                "speculative: a hybrid model's recurrent state cannot take back rejected proposals"
            )
        self.requests = ctx.requests
        self.device = ctx.device
        self.store = LinearStateStore(
            layers, cfg.max_num_seqs, ctx.dtype, ctx.device, cfg.num_state_checkpoints
        )
        self.copies: StateCopies | None = None  # the step's, from its SchedulerOutput
        logger.info(
            "linear state: %d slots and %d prefix checkpoints of %d layers, %.3f GiB",
            cfg.max_num_seqs,
            cfg.num_state_checkpoints,
            len(layers),
            self.store.nbytes / GiB,
        )

    def share_blocks(self, blocks: int, target: KVCacheSpec) -> int:
        """On CPU the state comes out of kv_cache_memory_gb; on CUDA it is already allocated when
        the profiling run measures what the cache may take."""
        if self.device.type == "cuda":
            return blocks
        left = blocks - -(-self.store.nbytes // target.block_bytes)
        if left < 1:
            raise ValueError(
                f"kv_cache_memory_gb: the recurrent state of {self.store.num_slots} slots takes "
                f"{self.store.nbytes / GiB:.3f} GiB, leaving no KV block; raise it or lower "
                "max_num_seqs"
            )
        return left

    def finish(self, req_id: str) -> None:
        self.store.release(req_id)

    def update(self, out: SchedulerOutput) -> None:
        for rid in out.preempted_req_ids:  # back from position 0 or from a checkpoint
            self.store.release(rid)
        self.copies = out.state_copies

    def prepare(self, batch: Batch) -> bool:
        self.store.begin_step(batch.req_ids, batch.starts, self.requests, self.copies)
        return True  # the decode graphs do not carry the state slots


def state_features(ctx: RunnerContext) -> list[RunnerFeature]:
    """The state feature when the model has linear-attention layers, else nothing."""
    model = ctx.model
    if not isinstance(model, nn.Module):
        return []
    layers = [m for m in model.modules() if isinstance(m, STATEFUL)]
    return [LinearStateFeature(ctx, layers)] if layers else []
