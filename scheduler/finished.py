"""How requests finish: sampled tokens appended under the stop rules (`append_tokens`), and the
finished requests as the Scheduler keeps them: the ids the next step tells the runner to free,
and the most recent finishes, which stay readable in `Scheduler.requests` for a while."""

from __future__ import annotations

from collections import OrderedDict

from scheduler.request import Request, RequestStatus
from scheduler.stop import check_stop


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


def append_tokens(
    req: Request, sampled: list[int], max_model_len: int
) -> tuple[list[int], RequestStatus | None]:
    """Append sampled tokens up to the first that stops the request (check_stop).

    Returns the tokens kept and the request's final status, None while it goes on; the caller
    finishes it. The kept tokens are `sampled` itself when all are kept (the common case: no
    copy per request per step), so the caller hands them on and never changes them.
    """
    out, all_ids = req.output_token_ids, req.all_token_ids
    if len(sampled) == 1:  # a plain decode's token: the common case, without the loop
        out.append(sampled[0])
        all_ids.append(sampled[0])
        return sampled, check_stop(req, max_model_len)
    for i, token in enumerate(sampled, 1):
        out.append(token)
        all_ids.append(token)
        status = check_stop(req, max_model_len)
        if status is not None:
            return sampled[:i], status
    return sampled, None
