"""One step's draw: the sampler over the logits rows the features before sampling prepared, one
request's fault failing that request alone."""

from __future__ import annotations

import logging

from scheduler.outputs import ModelRunnerOutput, TokenLogprobs
from workers.features.base import SampleStep
from workers.sampler import Sampler, SamplerOutput
from workers.step_state import Batch

logger = logging.getLogger(__name__)

Results = list[tuple[list[int], SamplerOutput]]


def sample_step(sampler: Sampler, batch: Batch, step: SampleStep) -> ModelRunnerOutput:
    """Draw every logits row; per batch row, its tokens (and logprobs) in logits-row order."""
    try:
        results = [(step.rows, sampler.sample(step.logits.float(), step.states, step.unmasked))]
    except Exception:
        results = _rows_alone(sampler, batch, step)
    sampled: list[list[int]] = [[] for _ in batch.req_ids]
    logprobs: list[list[TokenLogprobs] | None] | None = None
    for rows_of, result in results:
        for row, token in zip(rows_of, result.token_ids):
            sampled[row].append(token)
        if result.logprobs is not None:
            logprobs = logprobs or [None] * len(batch.req_ids)
            for row, lp in zip(rows_of, result.logprobs):
                if lp is not None:
                    logprobs[row] = (logprobs[row] or []) + [lp]
    return ModelRunnerOutput(batch.req_ids, sampled, logprobs, step.failed)


def _rows_alone(sampler: Sampler, batch: Batch, step: SampleStep) -> Results:
    """After a failed batched draw: each row on its own, so one request's fault fails it alone."""
    results: Results = []
    for i, (row, state) in enumerate(zip(step.rows, step.states)):
        alone = None if step.unmasked is None else step.unmasked[i : i + 1]
        try:
            results.append(([row], sampler.sample(step.logits[i : i + 1].float(), [state], alone)))
        except Exception as exc:
            rid = batch.req_ids[row]
            logger.warning("request %s failed in the sampler: %r", rid, exc)
            step.failed[rid] = f"sampler: {exc!r}"
    return results
