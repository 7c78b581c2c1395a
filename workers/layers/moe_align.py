"""(token, slot) pairs sorted by expert into fixed-size blocks: the layout the Triton fused-MoE
kernel walks (workers/layers/backends/triton_moe.py), one expert per block.

Each local expert's pairs are padded to a whole number of blocks, so a block never mixes experts
and a program loads one expert's weights. Pure torch and no host sync: every size is a bound known
from the shapes (how many blocks hold rows is data), so the step could be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ExpertBlocks:
    """rows: [num_blocks * block_m] int32, the pair index t * top_k + j of each row, or num_pairs
    for padding; block_expert: [num_blocks] int32, the local expert of each block, -1 for the
    blocks past the last expert's (the bound leaves some unused)."""

    rows: torch.Tensor
    block_expert: torch.Tensor
    block_m: int
    num_pairs: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.numel()


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks enough for any routing: the pairs' own blocks, plus at most one part-filled block per
    expert that has pairs."""
    return -(-num_pairs // block_m) + min(num_experts, num_pairs)


def align_by_expert(ids: torch.Tensor, first: int, num_local: int, block_m: int) -> ExpertBlocks:
    """Blocks of block_m rows for the pairs of ids [T, k] (global expert ids) routed to experts
    first .. first + num_local - 1; pairs of other experts (other ranks') are left out.

    Within an expert, pairs keep their order in ids (a stable sort), as the torch path keeps it."""
    if block_m < 1:
        raise ValueError(f"block_m: must be at least 1, got {block_m}")
    dev = ids.device
    p = ids.numel()
    local = ids.reshape(-1).long() - first
    key = torch.where((local >= 0) & (local < num_local), local, num_local)  # others sort last
    # scatter_add, not bincount: bincount reads its input's maximum back to the host.
    counts = torch.zeros(num_local + 1, dtype=torch.long, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_local]
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    expert = sorted_key.clamp(max=max(num_local - 1, 0))
    nb = max_blocks(p, num_local, block_m)
    dump = nb * block_m  # one slot past the blocks takes the other ranks' pairs, then is cut off
    dest = pad_start[expert] + torch.arange(p, device=dev) - count_start[expert]
    dest = torch.where(sorted_key < num_local, dest, dump)
    rows = torch.full((dump + 1,), p, dtype=torch.int32, device=dev)
    rows.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(nb, device=dev) * block_m
    owner = torch.searchsorted(pad_end, starts, right=True)  # empty experts own no block
    block_expert = torch.where(owner < num_local, owner, -1).to(torch.int32)
    return ExpertBlocks(rows[:dump], block_expert, block_m, p)
