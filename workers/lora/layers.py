"""LoRA applied to a tensor-parallel linear for a whole batch at once.

Each adapted linear holds every slot's weights stacked: A as [slots, segments * rank, in] and, per
output segment (q, k, v of a fused qkv; gate, up; or the one output), B^T as [slots, rank, out].
A step sets one `LoraBatch` for the model: the adapter rows grouped by slot, each group padded to
the largest (`index`: [slots, group] token rows, `valid`: 0 on the padding). The update is then a
segment-grouped matmul, a few batched operations whatever the mix of adapters:

    xp = x[index]                  [slots, group, in]
    xa = bmm(xp, A^T) * valid      [slots, group, segments * rank]
    y[index] += cat(bmm(xa_seg, B_seg^T) per segment)   (index_add_; the padding adds zeros)

so each row is multiplied by its own adapter only (no work for the other slots' columns). Ranks
below the slot's are zero-padded (zeros add nothing), and the scaling is folded into B. Rows of
the base model are in no group, and a batch with no adapter row skips the whole path.

Tensor parallelism: a column-parallel linear keeps A whole and the rank's rows of B (the same
rows as its weight); a row-parallel one keeps the rank's columns of A, B whole, and adds its
partial update before the all-reduce, which sums them.

On CUDA with Triton the same update runs as shrink and expand kernels over the same groups
(workers/layers/backends/triton_lora.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.layers import fused


@dataclass(slots=True)
class LoraBatch:
    """The step's adapter rows grouped by slot, shared by every LoRA layer of a model (set before
    each forward)."""

    active: bool = False
    num_slots: int = 0  # slots 0 .. num_slots - 1 are grouped (a group may be all padding)
    group: int = 0  # rows per group: the most any slot has this step
    index: torch.Tensor | None = None  # [num_slots * group] token rows (padding: row 0)
    # [num_slots, group, 1]: 1 for a row, 0 for padding; None when no group is padded
    valid: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class Segment:
    """One target's part of a linear's output on this rank, and how its B rows are sliced."""

    target: str  # e.g. "q_proj"
    offset: int  # in this rank's output
    size: int
    source_offset: int  # where this rank's rows start in the target's full B


class LoraLayer:
    """The stacked slot weights of one linear and their batched application."""

    def __init__(
        self,
        batch: LoraBatch,
        segments: list[Segment],
        in_features: int,
        in_offset: int | None,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.batch = batch
        self.segments = segments
        # The segments tile the output in order: their updates are concatenated, not placed.
        assert [s.offset for s in segments] == [
            sum(s.size for s in segments[:k]) for k in range(len(segments))
        ]
        # Row-parallel: this rank's columns of A start here (None: A is replicated).
        self.in_features, self.in_offset = in_features, in_offset
        self.rank = max_rank
        self.a = torch.zeros(
            max_loras, len(segments) * max_rank, in_features, dtype=dtype, device=device
        )
        self.b = [
            torch.zeros(max_loras, max_rank, s.size, dtype=dtype, device=device) for s in segments
        ]

    def load(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Fill a slot from one layer's (A, scaled B) per target; absent targets stay zero."""
        self.a[slot].zero_()
        for k, seg in enumerate(self.segments):
            self.b[k][slot].zero_()
            pair = weights.get(seg.target)
            if pair is None:
                continue
            a, b = pair
            r = a.shape[0]
            if self.in_offset is not None:
                a = a.narrow(1, self.in_offset, self.in_features)
            self.a[slot, k * self.rank : k * self.rank + r].copy_(a)
            self.b[k][slot, :r].copy_(b.narrow(0, seg.source_offset, seg.size).t())

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base linear's output for x) plus each row's adapter update, in place."""
        batch = self.batch
        if not batch.active:
            return y
        m, g, index, valid = batch.num_slots, batch.group, batch.index, batch.valid
        assert index is not None
        kernel = fused.triton_lora(x)
        if kernel is not None:
            return kernel.lora_update(x, y, self.a, self.b, index, batch.valid, m, g)
        r = self.rank
        xp = x.index_select(0, index).view(m, g, self.in_features)
        xa = torch.bmm(xp, self.a[:m].transpose(1, 2))  # [m, g, segments * rank]
        if valid is not None:  # zero the padding rows' updates
            xa.mul_(valid)
        if len(self.segments) == 1:
            delta = torch.bmm(xa, self.b[0][:m])
        else:  # each segment's own B, then one contiguous update of the fused output
            delta = torch.cat(
                [torch.bmm(xa[:, :, k * r : (k + 1) * r], b[:m]) for k, b in enumerate(self.b)],
                dim=-1,
            )
        return y.index_add_(0, index, delta.view(m * g, y.shape[-1]))
