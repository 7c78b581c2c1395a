"""Structured output as a runner feature (rank 0): a constrained request's matcher is compiled when
it arrives, its masks are filled by native threads while the forward runs and applied before
sampling, and proposals for it are cut before the first token its grammar rejects
(workers/structured.py, workers/grammar_spec.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.outputs import ModelRunnerOutput, NewRequestData
from workers.features.base import RunnerContext, RunnerFeature, SampleStep
from workers.grammar_warm import WarmDecoding
from workers.model_files import load_tokenizer
from workers.step_state import Batch, RequestState

if TYPE_CHECKING:
    # Imported at the first constrained request: llguidance's torch module pulls in
    # torch._dynamo and inductor, seconds of every replica's cold start.
    from workers.structured import PendingMasks, StructuredDecoding


class StructuredFeature(RunnerFeature):
    def __init__(self, ctx: RunnerContext) -> None:
        self.ctx = ctx
        cfg = ctx.config
        vocab_size = int(ctx.hf_config.vocab_size)
        # Built and warmed off the engine thread from now on (workers/grammar_warm.py).
        self.warm = WarmDecoding(
            cfg.model_dir,
            lambda: load_tokenizer(cfg.model_dir),
            vocab_size,
            cfg.grammar_timeout_s,
            cfg.grammar_mask_deadline_s,
        )
        self.decoding: StructuredDecoding | None = None  # taken at the first constrained request
        self.masks: PendingMasks | None = None  # the step's, filling while the forward runs

    def start(self, new: NewRequestData, state: RequestState) -> None:
        """A new (or resumed) constrained request gets a fresh matcher."""
        constraint = new.sampling_params.structured
        if constraint is not None:
            self._decoding().add(new.req_id, constraint)

    def _decoding(self) -> StructuredDecoding:
        if self.decoding is None:
            self.decoding = self.warm.get()
        return self.decoding

    def finish(self, req_id: str) -> None:
        if self.decoding is not None:
            self.decoding.drop(req_id)

    def before_forward(self, batch: Batch) -> None:
        self.masks = None
        if self.decoding is None or not batch.sample_rows:
            return
        rids = [batch.req_ids[i] for i in batch.sample_rows]
        requests = self.ctx.requests
        self.masks = self.decoding.start_masks(
            rids,
            [requests[r].sampling.output_token_ids for r in rids],
            [batch.drafts.get(r, []) for r in rids],
        )

    def before_sample(self, batch: Batch, step: SampleStep) -> None:
        masks, self.masks = self.masks, None
        if masks is None:
            return
        from workers.structured import apply_masks

        step.unmasked = step.logits.float()
        step.logits = apply_masks(step.unmasked, masks)
        step.failed.update(masks.failed)

    def propose(self, batch: Batch, output: ModelRunnerOutput) -> None:
        """Constrained requests' proposals, cut before the first token their grammar rejects:
        such a token could never be accepted."""
        proposals, decoding = output.spec_token_ids, self.decoding
        if proposals is None or decoding is None:
            return
        for i, (rid, new) in enumerate(zip(batch.req_ids, output.sampled_token_ids)):
            if proposals[i] and rid in decoding:
                outputs = self.ctx.requests[rid].sampling.output_token_ids + new
                proposals[i] = decoding.allowed_proposal(rid, outputs, proposals[i])
