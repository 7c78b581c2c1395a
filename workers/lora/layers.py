"""LoRA applied to a tensor-parallel linear for a whole batch at once.

Each adapted linear holds every slot's weights stacked: A as [slots, segments, rank, in] and, per
output segment (q, k, v of a fused qkv; gate, up; or the one output), B^T as [slots, rank, out].
A step sets one `LoraBatch` for the model: each token's slot as a one-hot mask over the slots the
batch uses. The update is then two matmuls per segment, whatever the mix of adapters:

    xa = x @ A[:m]^T          every used slot's rank columns at once  [n, m * segments * rank]
    xa *= mask                each row keeps its own slot's columns
    y[:, seg] += xa @ B^T[:m] the zeroed columns add nothing          [n, out]

Ranks below the slot's are zero-padded (zeros add nothing), and the scaling is folded into B.
Rows of the base model are left out (index_select / index_add_), and a batch with no adapter row
skips the whole path.

Tensor parallelism: a column-parallel linear keeps A whole and the rank's rows of B (the same
rows as its weight); a row-parallel one keeps the rank's columns of A, B whole, and adds its
partial update before the all-reduce, which sums them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class LoraBatch:
    """The step's adapter rows, shared by every LoRA layer of a model (set before each
    forward)."""

    active: bool = False
    num_slots: int = 0  # slots the batch uses: 0 .. num_slots - 1
    rows: torch.Tensor | None = None  # token rows under an adapter; None: every row
    mask: torch.Tensor | None = None  # [len(rows), num_slots], one-hot in the model's dtype


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
        # Row-parallel: this rank's columns of A start here (None: A is replicated).
        self.in_features, self.in_offset = in_features, in_offset
        self.rank = max_rank
        self.a = torch.zeros(
            max_loras, len(segments), max_rank, in_features, dtype=dtype, device=device
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
            self.a[slot, k, :r].copy_(a)
            self.b[k][slot, :r].copy_(b.narrow(0, seg.source_offset, seg.size).t())

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base linear's output for x) plus each row's adapter update, in place."""
        batch = self.batch
        if not batch.active:
            return y
        m, rows, mask = batch.num_slots, batch.rows, batch.mask
        assert mask is not None
        xr = x if rows is None else x.index_select(0, rows)
        n, num_segments, r = xr.shape[0], len(self.segments), self.rank
        a = self.a[:m].view(m * num_segments * r, self.in_features)
        xa = torch.mm(xr, a.t()).view(n, m, num_segments, r)
        xa.mul_(mask.view(n, m, 1, 1))
        for k, seg in enumerate(self.segments):
            delta = torch.mm(xa[:, :, k].reshape(n, m * r), self.b[k][:m].view(m * r, seg.size))
            out = y if num_segments == 1 else y.narrow(-1, seg.offset, seg.size)
            if rows is None:
                out.add_(delta)
            else:
                out.index_add_(0, rows, delta)
        return y
