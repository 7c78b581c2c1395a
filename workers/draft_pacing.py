"""Which requests the draft model works for in a step, so that a request that does not speculate
costs the draft little.

The scheduler's SpecPolicy decides, a step later, whether a proposal runs; a request it has
stopped (recent acceptance below `min_acceptance_rate`, or a batch over `max_batch_size`) only
has its proposal checked as a *shadow* against the tokens it then decodes, so that it speculates
again once its output turns predictable. A draft model's proposal costs k forwards, so proposing
for such a request every step spent the draft's whole cost for nothing but that estimate (a
sampled chat ran at 0.25x). Here the runner learns the policy's decision from the schedule: a
request whose last proposal was not scheduled (it decoded one token instead) is *paused*, and
gets a proposal only every `every`-th step: the shadow still moves the policy's estimate, at a
fraction of the cost, and the first probe the policy schedules again un-pauses it.

A request that does not propose in a step also defers the draft's catch-up over its new tokens
until a KV block fills (workers/features/draft.py): every full block, the only kind the
prefix cache registers, still holds the draft's KV, and a proposing request catches up whole
first, so proposals are computed from exactly the context they were before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.outputs import SchedulerOutput

# A paused request proposes once in this many steps.
SHADOW_EVERY = 8


@dataclass(slots=True)
class _Pace:
    paused: bool = False
    pending: bool = False  # proposed, and not yet seen scheduled
    waited: int = 0  # steps since a paused request last proposed


class DraftPacing:
    """Per request: whether the scheduler ran its last proposal, and when a paused one proposes
    next."""

    def __init__(self, every: int = SHADOW_EVERY) -> None:
        if every < 1:
            raise ValueError(f"every: must be >= 1, got {every}")
        self.every = every
        self._by_req: dict[str, _Pace] = {}

    def schedule(self, out: SchedulerOutput) -> None:
        """Learn from a step's schedule which pending proposals ran."""
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self._by_req.pop(rid, None)
        spec, scheduled = out.scheduled_spec_tokens, out.num_scheduled_tokens
        for rid, pace in self._by_req.items():
            if not pace.pending or rid not in scheduled:  # not run this step: still pending
                continue
            pace.pending = False
            pace.paused = rid not in spec
            pace.waited = 0

    def asks(self, rid: str) -> bool:
        """Whether rid proposes this step (call once per step for each request that sampled)."""
        pace = self._by_req.get(rid)
        if pace is None or not pace.paused:
            return True
        pace.waited += 1
        return pace.waited >= self.every

    def proposed(self, req_ids: Sequence[str], proposals: Sequence[Sequence[int]]) -> None:
        """The step's proposals as the scheduler gets them."""
        for rid, proposal in zip(req_ids, proposals):
            if proposal:
                pace = self._by_req.setdefault(rid, _Pace())
                pace.pending, pace.waited = True, 0

    def paused(self, rid: str) -> bool:
        pace = self._by_req.get(rid)
        return pace is not None and pace.paused
