"""Async overlap as a step feature: step N+1 is scheduled while step N runs, before N's sampled
tokens are known.

The engine (engine/core.py) keeps one step in flight: it schedules and launches step N+1, then
waits for step N and updates from it. A request whose step N samples holds placeholders for the
tokens it may add (`Request.num_output_placeholders`: one, or one plus its draft slots under
speculation), so step N+1 schedules its next decode; the runner feeds that decode its own last
sampled token (under async scheduling it appends what it samples), so no token travels back to the
runner and nothing waits between steps.

What stays exact, and how:
- Stops: a request stopped by step N's token (EOS, a stop id) was scheduled again in N+1. Its
  extra token is dropped (it is no longer running when that token arrives), its blocks were freed
  by N's update, and the runner drops its state when the next step lists it as finished. A request
  that N's tokens may take to max_tokens or max_model_len is not scheduled again until they are
  known.
- Preemption: a request preempted (recompute or swap) while its tokens are in flight keeps them
  when they arrive, as a synchronous step would have appended them before preempting; their KV
  was written before the preemption's copies or frees run (steps run in order). If a token stops
  the request, it leaves the waiting queue finished.
- Prefix caching: a block is registered once the step that writes its KV has finished.
- Aborts and per-request failures between steps finish the request at once; tokens still in
  flight for it are dropped.
- Tokens are matched to the Request object their step scheduled, not to the id: a new request
  that reuses a finished one's id never receives the old one's late tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

from scheduler.features import StepFeature
from scheduler.finished import append_tokens
from scheduler.outputs import (
    ModelRunnerOutput,
    RequestOutput,
    SchedulerOutput,
    TokenLogprobs,
    request_output,
)
from scheduler.request import Request, RequestStatus
from scheduler.step import Step

_PREEMPTED = (RequestStatus.PREEMPTED, RequestStatus.SWAPPED)


@dataclass(slots=True)
class _InFlight:
    """A step scheduled and not yet updated from."""

    requests: dict[str, Request]  # the requests it runs, by id
    num_scheduled_tokens: dict[str, int]
    placeholders: dict[str, int]  # tokens each sampling request may add


class AsyncOverlap(StepFeature):
    """Lets the Scheduler schedule a step before the previous one's tokens are appended.

    Calls alternate as schedule(N+1), update_from_output(N): at most one step is scheduled ahead of
    the one being updated. With no step ahead the Scheduler behaves as without this feature.
    """

    # The runner appends what it samples and decodes on from it, so a request's next decode is
    # scheduled on placeholders before its token is known. False (pipeline micro-batches,
    # scheduler/features_pipeline.py): the sampling rank is not the one that embeds, so a
    # request waits for its token, which the next step sends to every rank.
    samples_ahead = True

    def __init__(self) -> None:
        self._in_flight: deque[_InFlight] = deque()

    def after_schedule(self, step: Step, out: SchedulerOutput) -> None:
        requests = self.sched.requests
        scheduled = {rid: requests[rid] for rid in out.num_scheduled_tokens}
        added: dict[str, int] = {}
        for rid, req in scheduled.items():
            # The chunk reaches the request's last token: the step samples one more (and, when it
            # verifies drafts past that token, one for each draft it may keep).
            ahead = req.num_computed_tokens - req.num_tokens - req.num_output_placeholders
            if ahead >= 0 and self.samples_ahead:
                added[rid] = ahead + 1
                req.num_output_placeholders += ahead + 1
        self._in_flight.append(_InFlight(scheduled, out.num_scheduled_tokens, added))

    def before_update(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> tuple[ModelRunnerOutput, list[RequestOutput]]:
        step = self._in_flight.popleft()
        live = self.sched.requests
        late: list[RequestOutput] = []
        dropped: set[int] = set()
        stale: set[str] = set()
        for i, (rid, sampled) in enumerate(zip(runner_out.req_ids, runner_out.sampled_token_ids)):
            req = step.requests.get(rid)
            if req is None:
                continue
            if sampled and self.samples_ahead:
                req.num_output_placeholders -= step.placeholders.get(rid, 0)
                # The runner appended them itself: the next step need not send them.
                req.num_synced_tokens += len(sampled)
            if live.get(rid) is not req:  # finished, and its id taken by a new request since
                dropped.add(i)
                stale.add(rid)
            elif sampled and req.status in _PREEMPTED:
                dropped.add(i)
                out = self._append_late(req, sampled, runner_out.logprobs, i)
                out.prompt_logprobs = runner_out.prompt_logprobs.get(rid)
                late.append(out)
        for rid in runner_out.failed:
            req = step.requests.get(rid)
            if req is not None and live.get(rid) is not req:
                stale.add(rid)
        if dropped or stale:
            runner_out = _without(runner_out, dropped, stale)
        return runner_out, late

    def tokens_in_flight(self) -> dict[str, int]:
        if not self._in_flight:
            return {}
        if len(self._in_flight) == 1:
            return self._in_flight[0].num_scheduled_tokens
        ahead: dict[str, int] = {}
        for step in self._in_flight:
            for rid, n in step.num_scheduled_tokens.items():
                ahead[rid] = ahead.get(rid, 0) + n
        return ahead

    def _append_late(
        self,
        req: Request,
        sampled: list[int],
        logprobs: list[list[TokenLogprobs] | None] | None,
        row: int,
    ) -> RequestOutput:
        """The tokens of a request preempted while they were being sampled: kept, under the stop
        rules."""
        sched = self.sched
        kept, status = append_tokens(req, sampled, sched.max_model_len)
        if sched.waiting.charges_tokens:
            sched.waiting.charge(req.tenant, sched.config.fair_output_weight * len(kept))
        if status is not None:
            sched.finish_early(req, status)
        lp = logprobs[row] if logprobs is not None else None
        return request_output(req, kept, lp[: len(kept)] if lp is not None else None)


def _without(output: ModelRunnerOutput, rows: set[int], stale: set[str]) -> ModelRunnerOutput:
    """output less the given rows, and less the failures of request ids it no longer speaks for."""
    keep = [i for i in range(len(output.req_ids)) if i not in rows]
    logprobs, proposals = output.logprobs, output.spec_token_ids
    return replace(
        output,
        req_ids=[output.req_ids[i] for i in keep],
        sampled_token_ids=[output.sampled_token_ids[i] for i in keep],
        logprobs=None if logprobs is None else [logprobs[i] for i in keep],
        spec_token_ids=None if proposals is None else [proposals[i] for i in keep],
        failed={rid: why for rid, why in output.failed.items() if rid not in stale},
        # A stale id's feature is its old request's prompt, not the new one's.
        length_features={rid: f for rid, f in output.length_features.items() if rid not in stale},
    )
