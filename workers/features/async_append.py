"""Async scheduling as a runner feature: the next step, already scheduled, decodes from the tokens
this step sampled (the scheduler's placeholders), so the runner appends them itself; penalties,
seeds and grammar masks read them."""

from __future__ import annotations

from scheduler.outputs import ModelRunnerOutput
from workers.features.base import RunnerContext, RunnerFeature
from workers.step_state import Batch


class AsyncAppendFeature(RunnerFeature):
    def __init__(self, ctx: RunnerContext) -> None:
        self.ctx = ctx

    def proposed(self, batch: Batch, output: ModelRunnerOutput) -> None:
        # Last of the step: proposers, the draft and grammar cuts read the tokens before these.
        for rid, tokens in zip(batch.req_ids, output.sampled_token_ids):
            if tokens:
                state = self.ctx.requests[rid]
                state.token_ids.extend(tokens)
                state.sampling.output_token_ids.extend(tokens)
