"""Vocabulary-parallel token embedding and LM head (logits gathered to rank 0)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.layers.linear import CpuPackedWeight, linear
from workers.parallel import all_reduce, divide, gather, get_tp_rank, get_tp_world_size


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the (padded) vocabulary; lookups are summed over
    ranks."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_world_size()
        self.vocab_size = vocab_size
        padded = -(-vocab_size // self.tp_size) * self.tp_size
        self.vocab_per_rank = divide(padded, self.tp_size, "vocab_size")
        self.vocab_start = self.tp_rank * self.vocab_per_rank
        self.weight = nn.Parameter(
            torch.empty(self.vocab_per_rank, hidden_size), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(
                f"vocab_size: checkpoint has {loaded.shape[0]} rows, config says {self.vocab_size}"
            )
        num_rows = max(0, min(self.vocab_per_rank, self.vocab_size - self.vocab_start))
        rows = loaded.narrow(0, self.vocab_start, num_rows)
        param.data.zero_()  # the padding rows of the last rank stay zero
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding, CpuPackedWeight):
    """Projects hidden states to vocabulary logits; rank 0 receives the full row, others None."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead computes logits via compute_logits(), not forward()")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if self.packed is not None:  # CPU: the packed copy of the (possibly tied) weight
            logits = gather(linear(hidden, self.weight, packed=self.packed), dim=-1)
        else:  # W @ h^T rather than h @ W^T: with a wide vocabulary this streams the weight faster
            logits = gather((self.weight @ hidden.t()).t(), dim=-1)
        return logits[..., : self.vocab_size] if logits is not None else None
