"""Pipeline micro-batches as a step feature (vLLM's virtual engines): with N pipeline stages the
engine keeps up to N steps in flight, so stage 0 runs step k+1 while stage 1 runs step k.

The bookkeeping of steps in flight is async overlap's (scheduler/features_async.py): the steps
scheduled and not yet updated from, the tokens whose KV is not yet written (prefix caching
registers a block once the step that writes it is back), a request preempted, aborted or finished
while its tokens are in flight. What differs:
- No request runs in two steps in flight: the next step holds out every request a step in flight
  runs (and a preempted one is not re-admitted until its step is back). Each stage runs the steps
  in order, so the KV a step reads was written by the steps before it on that stage.
- No placeholders: the last stage samples, stage 0 embeds, so a request's next decode waits for
  its token, and the next step sends it to every rank (as under tensor parallelism).
- A step runs at most ceil(live requests / depth) requests, so the running requests split into
  `depth` cohorts that take turns instead of one batch that leaves the other stages idle.
"""

from __future__ import annotations

from scheduler.features import StepLimits
from scheduler.features_async import AsyncOverlap

# The most steps in flight: one per pipeline stage (workers/pipeline_split.MAX_PIPELINE_STAGES).
MAX_DEPTH = 64


class MicroBatches(AsyncOverlap):
    """Up to `depth` steps in flight over disjoint requests (the engine keeps them in flight:
    engine/core.py)."""

    samples_ahead = False

    def __init__(self, depth: int) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or not 2 <= depth <= MAX_DEPTH:
            raise ValueError(
                f"depth: micro-batches in flight must be in [2, {MAX_DEPTH}], got {depth!r}"
            )
        super().__init__()
        self.depth = depth

    def step_limits(self) -> StepLimits:
        held = frozenset(rid for step in self._in_flight for rid in step.requests)
        sched = self.sched
        live = len(sched.running) + len(sched.waiting) + len(sched.loading)
        return StepLimits(held, max(1, -(-live // self.depth)))

    @property
    def steps_in_flight(self) -> int:
        """Steps scheduled and not yet updated from."""
        return len(self._in_flight)
