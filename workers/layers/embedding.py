"""Vocabulary-parallel token embedding and LM head (logits gathered to rank 0)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.layers.linear import CpuPackedWeight, linear
from workers.layers.param_attrs import set_param_attr
from workers.layers.quantized import GGUFWeight, load_target
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
        set_param_attr(self.weight, "weight_loader", self.weight_loader)

    def weight_loader(
        self,
        param: nn.Parameter,
        loaded: torch.Tensor | GGUFWeight,
        shard_id: int | str | None = None,
    ) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(
                f"vocab_size: checkpoint has {loaded.shape[0]} rows, config says {self.vocab_size}"
            )
        num_rows = max(0, min(self.vocab_per_rank, self.vocab_size - self.vocab_start))
        rows = loaded.narrow(0, self.vocab_start, num_rows)
        target = load_target(param, loaded)
        if isinstance(target, GGUFWeight):  # allocated as zeros: padding rows stay zero
            assert isinstance(rows, GGUFWeight)  # load_target returns blocks only for blocks
            target.narrow(0, 0, num_rows).copy_(rows)
            return
        if not isinstance(target, torch.Tensor):
            raise ValueError(f"embedding: {type(target).__name__} weights are not supported")
        target.zero_()  # the padding rows of the last rank stay zero
        target[:num_rows].copy_(rows.dequantize() if isinstance(rows, GGUFWeight) else rows)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        gguf = getattr(self.weight, "gguf", None)
        if gguf is not None:  # only the looked-up rows are de-quantised
            return gguf.embedding(ids, self.weight.dtype)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_per_rank)
        out = self._lookup(local.masked_fill(outside, 0))
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
