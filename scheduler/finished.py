"""Finished requests as the Scheduler keeps them: the ids the next step tells the runner to free,
and the most recent finishes, which stay readable in `Scheduler.requests` for a while."""

from __future__ import annotations

from collections import OrderedDict

from scheduler.request import Request


class FinishedLog:
    """`retention` finished requests stay in `requests` (the scheduler's dict); older ones are
    dropped from it as new ones finish."""

    def __init__(self, requests: dict[str, Request], retention: int) -> None:
        self.requests = requests
        self.retention = retention
        self.ids: set[str] = set()  # finished since the last step was emitted
        self._order: OrderedDict[str, None] = OrderedDict()

    def add(self, rid: str) -> None:
        self.ids.add(rid)
        self._order[rid] = None
        if len(self._order) > self.retention:
            old, _ = self._order.popitem(last=False)
            req = self.requests.get(old)
            if req is not None and req.is_finished:
                del self.requests[old]

    def forget(self, rid: str) -> None:
        """rid is taken by a new request: its old finish no longer holds a place."""
        self._order.pop(rid, None)

    def take_ids(self) -> set[str]:
        """The requests finished since the last call (the next step tells the runner)."""
        ids, self.ids = self.ids, set()
        return ids
