"""Which running request gives its KV blocks up when the pool runs dry."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.request import Request


@dataclass(slots=True)
class VictimPolicy:
    """`lifo`: the most recently admitted (vLLM). `least_progress`: fewest computed tokens, the
    cheapest to recompute. With `by_priority`, the least urgent requests are taken first and the
    rule only breaks ties among them."""

    rule: str = "lifo"
    by_priority: bool = False

    def choose(self, running: list[Request]) -> Request:
        """Pick a victim from running (admission order, oldest first); running must be non-empty."""
        candidates = running
        if self.by_priority:
            worst = max(r.priority for r in running)
            candidates = [r for r in running if r.priority == worst]
        if self.rule == "lifo":
            return candidates[-1]
        # Scanning newest first makes ties go to the most recently admitted request.
        return min(reversed(candidates), key=lambda r: r.num_computed_tokens)
