"""Embedding requests as a runner feature: their rows run eagerly, and their hidden states are
pooled into one vector when the prompt ends (workers/pooling.py)."""

from __future__ import annotations

import torch

from workers.features.base import RunnerContext, RunnerFeature
from workers.pooling import Pooler
from workers.step_state import Batch


class PoolingFeature(RunnerFeature):
    def __init__(self, ctx: RunnerContext) -> None:
        self.ctx = ctx
        self.pooler = Pooler()

    def finish(self, req_id: str) -> None:
        self.pooler.drop(req_id)

    def prepare(self, batch: Batch) -> bool:
        """The batch's embedding rows (every rank alike: the choice of graphs must agree)."""
        requests = self.ctx.requests
        batch.pooling_rows = [
            i
            for i, rid in enumerate(batch.req_ids)
            if (sampling := requests[rid].sampling) is not None
            and sampling.params.pooling is not None
        ]
        return bool(batch.pooling_rows)  # the decode graphs return no hidden states

    def after_forward(self, batch: Batch, hidden: torch.Tensor, offsets: list[int]) -> None:
        if not self.ctx.is_driver:
            return
        for row in batch.pooling_rows:
            rid = batch.req_ids[row]
            state = self.ctx.requests[rid]
            how = state.sampling.params.pooling
            assert how is not None  # a pooling row's
            vector = self.pooler.pool(
                rid,
                how,
                hidden[offsets[row] : offsets[row + 1]],
                batch.starts[row],
                len(state.sampling.prompt_token_ids),
            )
            if vector is not None:
                batch.pooled[rid] = vector
