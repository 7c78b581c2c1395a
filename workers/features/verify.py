"""Verification of proposed tokens as a runner feature (workers/spec_verify.py): a verify row
samples every proposed position, each as a plain decode would sample it there, and keeps the
run up to the first sample that differs from its proposal."""

from __future__ import annotations

from scheduler.outputs import ModelRunnerOutput
from workers.features.base import RunnerContext, RunnerFeature, SampleStep
from workers.sampler import SamplingState
from workers.spec_verify import accepted_run, position_states
from workers.step_state import Batch


class VerifyFeature(RunnerFeature):
    def __init__(self, ctx: RunnerContext) -> None:
        self.ctx = ctx

    def before_sample(self, batch: Batch, step: SampleStep) -> None:
        """One logits row per position of a verify row (the forward's logits_positions)."""
        if not batch.drafts:
            return
        rows: list[int] = []
        states: list[SamplingState] = []
        for i in batch.sample_rows:
            rid = batch.req_ids[i]
            at = position_states(self.ctx.requests[rid].sampling, batch.drafts.get(rid, []))
            rows.extend([i] * len(at))
            states.extend(at)
        step.rows, step.states = rows, states

    def after_sample(self, batch: Batch, output: ModelRunnerOutput) -> None:
        """Cut each verify row to the run it keeps."""
        sampled, logprobs = output.sampled_token_ids, output.logprobs
        for row, rid in enumerate(batch.req_ids):
            drafts = batch.drafts.get(rid)
            if not drafts or rid in output.failed:
                continue
            kept = len(accepted_run(sampled[row], drafts))
            del sampled[row][kept:]
            row_logprobs = None if logprobs is None else logprobs[row]
            if row_logprobs is not None:
                del row_logprobs[kept:]
