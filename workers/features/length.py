"""The length probe's features as a runner feature (rank 0, when a length-aware setting is on):
each prompt's last hidden state, projected, in the step that ends the prompt
(workers/length_features.py)."""

from __future__ import annotations

import torch

from workers.features.base import RunnerContext, RunnerFeature
from workers.length_features import LengthFeatures, ends_prompt
from workers.step_state import Batch


class LengthFeature(RunnerFeature):
    def __init__(self, ctx: RunnerContext) -> None:
        self.ctx = ctx
        hidden_size = int(ctx.hf_config.hidden_size)
        self.extractor = LengthFeatures(hidden_size, ctx.config.length_feature_dim, ctx.device)

    def after_forward(self, batch: Batch, hidden: torch.Tensor, offsets: list[int]) -> None:
        ids, requests = batch.req_ids, self.ctx.requests
        ended = [
            i
            for i in batch.sample_rows
            if requests[ids[i]].sampling is not None  # the profile run's rows sample nothing
            and ends_prompt(
                batch.starts[i],
                len(requests[ids[i]].sampling.prompt_token_ids),
                len(requests[ids[i]].token_ids),
            )
        ]
        if ended:
            vectors = self.extractor.extract(hidden, [offsets[i + 1] - 1 for i in ended])
            batch.length_features = {ids[i]: v for i, v in zip(ended, vectors)}
