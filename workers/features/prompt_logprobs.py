"""prompt_logprobs as a runner feature: each step's prompt positions are scored from its hidden
states (workers/prompt_logprobs.py, every rank alike), and the entries go out with the request's
first sampled token."""

from __future__ import annotations

import torch

from scheduler.outputs import ModelRunnerOutput, NewRequestData
from workers.features.base import RunnerContext, RunnerFeature
from workers.prompt_logprobs import prompt_logprobs
from workers.step_state import Batch, RequestState


class PromptLogprobsFeature(RunnerFeature):
    def __init__(self, ctx: RunnerContext) -> None:
        self.ctx = ctx

    def start(self, new: NewRequestData, state: RequestState) -> None:
        # A resumed request sent its prompt's entries before.
        if new.sampling_params.prompt_logprobs is not None and not new.output_token_ids:
            state.prompt_logprobs = []

    def after_forward(self, batch: Batch, hidden: torch.Tensor, offsets: list[int]) -> None:
        """Entries for the prompt positions this step computed, of the requests that asked."""
        for i, rid in enumerate(batch.req_ids):
            state = self.ctx.requests[rid]
            if state.prompt_logprobs is None:
                continue
            first = max(batch.starts[i], state.num_prompt_logprobs)  # recomputed ones once
            end = min(
                batch.starts[i] + batch.query_lens[i], len(state.sampling.prompt_token_ids) - 1
            )
            if end <= first:
                continue
            row = offsets[i] + first - batch.starts[i]
            entries = prompt_logprobs(
                self.ctx.model.compute_logits,
                hidden[row : row + end - first],
                state.token_ids[first + 1 : end + 1],
                state.sampling.params.prompt_logprobs or 0,
            )
            state.num_prompt_logprobs = end
            if entries is not None:
                state.prompt_logprobs.extend(entries)

    def after_sample(self, batch: Batch, output: ModelRunnerOutput) -> None:
        """Each request's entries, with its first token (rank 0)."""
        for row in batch.sample_rows:
            rid = batch.req_ids[row]
            state = self.ctx.requests[rid]
            if state.prompt_logprobs is None or not output.sampled_token_ids[row]:
                continue
            if len(state.prompt_logprobs) == len(state.sampling.prompt_token_ids) - 1:
                output.prompt_logprobs[rid] = state.prompt_logprobs
            else:  # a position skipped (never expected): fail it rather than answer short
                output.failed[rid] = "prompt_logprobs: incomplete"
            state.prompt_logprobs = None
