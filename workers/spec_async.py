"""Speculation under async scheduling, the runner's half (scheduler/features_spec.py has the
scheduler's).

With async overlap the scheduler builds step N+1 before step N's proposals exist and before it
knows how many of N's drafts were accepted. It reserves draft slots optimistically: its
`num_computed_tokens` assumes every draft in flight is kept, and step N+1's draft slots arrive as
placeholders. Steps run here in order, so when N+1 runs this runner knows what N did. It then
- starts each request's row where the request really is (its own count of computed tokens, kept
  from the step before; the scheduler's is exact again after a preemption or a resend), and
- fills the row's draft slots with the proposals it made after step N's sampling (up to the
  slots reserved; a shorter proposal leaves slots unused, as a rejected draft leaves them).
The scheduler settles afterwards: its count goes back by whatever was rejected or unused, so it
agrees with this one once no step is in flight. A proposal never travels to the scheduler and back
before it runs, as in vLLM's async scheduling with speculative decoding.
"""

from __future__ import annotations

from dataclasses import replace

from scheduler.outputs import ModelRunnerOutput, NewRequestData, SchedulerOutput
from workers.features.base import RunnerContext, RunnerFeature
from workers.step_state import Batch, RequestState


class AsyncDraftsFeature(RunnerFeature):
    """Rows start where the previous step ended; draft slots carry this runner's own proposals."""

    def __init__(self, ctx: RunnerContext) -> None:
        self.ctx = ctx
        self._computed: dict[str, int] = {}  # request id -> KV positions written by its last step
        self._proposals: dict[str, list[int]] = {}  # request id -> what follows its last sample

    def start(self, new: NewRequestData, state: RequestState) -> None:
        self._forget(new.req_id)

    def finish(self, req_id: str) -> None:
        self._forget(req_id)

    def update(self, out: SchedulerOutput) -> None:
        for rid in out.preempted_req_ids:
            self._forget(rid)
        cached, requests = out.scheduled_cached_reqs, self.ctx.requests
        for rid, resumed in zip(cached.req_ids, cached.resumed):
            own = self._computed.pop(rid, None)
            if own is not None and not resumed:  # resumed: the scheduler's count is exact
                requests[rid].num_computed_tokens = own

    def schedule(self, out: SchedulerOutput) -> SchedulerOutput:
        """The step as it runs here: each verify row's slots filled with this runner's proposal,
        its token count cut to the drafts it carries."""
        if not out.scheduled_spec_tokens:
            return out
        scheduled = dict(out.num_scheduled_tokens)
        spec: dict[str, list[int]] = {}
        for rid, slots in out.scheduled_spec_tokens.items():
            drafts = self._proposals.get(rid, [])[: len(slots)]
            scheduled[rid] -= len(slots) - len(drafts)
            if drafts:
                spec[rid] = drafts
        total = sum(scheduled.values())
        return replace(
            out,
            num_scheduled_tokens=scheduled,
            scheduled_spec_tokens=spec,
            total_num_scheduled_tokens=total,
        )

    def proposed(self, batch: Batch, output: ModelRunnerOutput) -> None:
        """Where each row ended (its accepted drafts included), and the proposals the next step's
        slots will carry."""
        proposals = output.spec_token_ids
        for i, rid in enumerate(batch.req_ids):
            drafts, sampled = batch.drafts.get(rid, ()), output.sampled_token_ids[i]
            accepted = len(sampled) - 1 if drafts and sampled else 0
            self._computed[rid] = batch.starts[i] + batch.query_lens[i] - len(drafts) + accepted
            if proposals is not None and proposals[i]:
                self._proposals[rid] = proposals[i]
            else:
                self._proposals.pop(rid, None)

    def _forget(self, rid: str) -> None:
        self._computed.pop(rid, None)
        self._proposals.pop(rid, None)
