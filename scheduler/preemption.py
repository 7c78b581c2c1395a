"""Which running request gives its KV blocks up when the pool runs dry."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from scheduler.request import Request


@dataclass(slots=True)
class VictimPolicy:
    """`lifo`: the most recently admitted (vLLM). `least_progress`: fewest computed tokens, the
    cheapest to recompute. `most_remaining`: the most predicted remaining output (the queue's length
    predictor, under srpt or fair_srpt), so the request that would hold its blocks longest gives
    them up; without predictions, lifo. With `by_priority`, the least urgent requests are taken
    first and the rule only breaks ties among them."""

    rule: str = "lifo"
    by_priority: bool = False
    # A request's predicted remaining output tokens, None when there is no estimate.
    remaining: Callable[[Request], float | None] | None = None

    def choose(self, running: list[Request]) -> Request:
        """Pick a victim from running (admission order, oldest first); running must be non-empty."""
        candidates = running
        if self.by_priority:
            worst = max(r.priority for r in running)
            candidates = [r for r in running if r.priority == worst]
        if self.rule == "most_remaining":
            return self._most_remaining(candidates)
        if self.rule == "lifo":
            return candidates[-1]
        # Scanning newest first makes ties go to the most recently admitted request.
        return min(reversed(candidates), key=lambda r: r.num_computed_tokens)

    def _most_remaining(self, candidates: list[Request]) -> Request:
        predict = self.remaining
        if predict is None:
            return candidates[-1]
        estimates = [(predict(r), r) for r in reversed(candidates)]  # ties: the newest
        known = [(e, r) for e, r in estimates if e is not None]
        if not known:
            return candidates[-1]
        return max(known, key=lambda er: er[0])[1]
