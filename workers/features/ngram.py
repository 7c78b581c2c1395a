"""A proposer that needs no KV of its own (n-gram prompt lookup, workers/proposer.py) as a runner
feature: after sampling, proposals to follow each request's new tokens (rank 0)."""

from __future__ import annotations

from scheduler.outputs import ModelRunnerOutput
from workers.features.base import RunnerContext, RunnerFeature
from workers.proposer import Proposer
from workers.step_state import Batch


class ProposerFeature(RunnerFeature):
    def __init__(self, ctx: RunnerContext, proposer: Proposer) -> None:
        self.ctx = ctx
        self.proposer = proposer  # replaceable (tests and benchmarks put an oracle here)

    def after_sample(self, batch: Batch, output: ModelRunnerOutput) -> None:
        """None for a row that sampled nothing."""
        sampled, requests = output.sampled_token_ids, self.ctx.requests
        rows = [i for i, tokens in enumerate(sampled) if tokens]
        proposals: list[list[int]] = [[] for _ in sampled]
        if rows:
            contexts = [requests[batch.req_ids[i]].token_ids + sampled[i] for i in rows]
            for i, proposal in zip(rows, self.proposer.propose(contexts)):
                proposals[i] = proposal
        output.spec_token_ids = proposals
