"""Waiting-queue policies: FCFS, priority, per-tenant fairness by virtual token counters, and
shortest predicted remaining first (SRPT) with aging.

Each queue holds WAITING, PREEMPTED and SWAPPED requests. A preempted request goes back with
`prepend`, ahead of newer arrivals. `charge` feeds the fair policy's counters; the others ignore it.
`learn` feeds the SRPT policy's length predictor with each finished request, and
`predicted_remaining` asks it (for the `most_remaining` victim rule); the others ignore or answer
None.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from scheduler.length_prediction import (
    LengthPredictor,
    RemainingLength,
    safe_observe,
    safe_predict,
)
from scheduler.request import Request


class _Unlearned:
    """A queue whose order needs neither token charges nor a length predictor."""

    charges_tokens = False

    def charge(self, tenant: str, tokens: float) -> None:
        pass

    def learn(self, request: Request) -> None:
        pass

    def predicted_remaining(self, request: Request) -> float | None:
        return None


class _Wrapped:
    """A queue kept in `_q`: its length, its order and a removal are `_q`'s."""

    _q: deque[Request] | SRPTQueue

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class FCFSQueue(_Wrapped, _Unlearned):
    """First come, first served; preempted requests return to the front."""

    _q: deque[Request]

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def prepend(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()


class PriorityQueue(_Unlearned):
    """Lowest priority number first, then earliest arrival (a preempted request keeps its place)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(
            self._heap, (request.priority, request.arrival_time, next(self._seq), request)
        )

    prepend = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [e for e in self._heap if e[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in self._heap)


class FairQueue:
    """Virtual token counters (VTC, OSDI'24): serve the backlogged tenant that has received least.

    A tenant that becomes backlogged has its counter lifted to the smallest counter among the
    backlogged tenants (or, with none backlogged, to the counter of the tenant that left the
    backlog last), so idling earns no credit to flood the others with later. The next tenant comes
    from a heap (O(log T)); a tenant with no queued work whose counter the lift would raise anyway
    is forgotten, so thousands of one-off tenants cost nothing.
    """

    charges_tokens = True

    def __init__(self, srpt: SRPTQueue | None = None) -> None:
        # srpt: a template whose predictor and aging factor order each tenant's own line (policy
        # fair_srpt); None: each tenant's requests in arrival order.
        self._srpt = srpt
        self._queues: dict[str, _Line] = {}  # backlogged tenants only
        self.counters: dict[str, float] = {}
        # (counter, tiebreak, tenant); entries go stale when a counter moves and are skipped lazily.
        self._heap: list[tuple[float, int, str]] = []
        self._tiebreak = itertools.count()
        self._last_left: str | None = None  # the tenant that last left the backlog
        self._len = 0
        self._compact_at = 64  # doubles with what survives a compaction: amortised O(1) per call

    def _push(self, tenant: str) -> None:
        heapq.heappush(self._heap, (self.counters[tenant], next(self._tiebreak), tenant))
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        if len(self._heap) + len(self.counters) > self._compact_at:
            self._compact()
            self._compact_at = max(64, 2 * (len(self._heap) + len(self.counters)))

    def _compact(self) -> None:
        """Rebuild the heap from the backlogged tenants and forget idle tenants below the floor."""
        self._heap = [(self.counters[t], next(self._tiebreak), t) for t in self._queues]
        heapq.heapify(self._heap)
        floor = self._floor()
        keep = self._queues.keys() | {self._last_left}
        self.counters = {t: c for t, c in self.counters.items() if t in keep or c > floor}

    def _next_tenant(self) -> str | None:
        heap, queues, counters = self._heap, self._queues, self.counters
        while heap:
            counter, _, tenant = heap[0]
            if tenant in queues and counters[tenant] == counter:
                return tenant
            heapq.heappop(heap)
        return None

    def _floor(self) -> float:
        tenant = self._next_tenant()
        if tenant is not None:
            return self.counters[tenant]
        return self.counters.get(self._last_left, 0.0) if self._last_left is not None else 0.0

    def _new_line(self) -> _Line:
        if self._srpt is None:
            return deque()
        return _SRPTLine(SRPTQueue(self._srpt.predictor, self._srpt.aging_factor))

    def _enter(self, tenant: str, lift: bool) -> _Line:
        q = self._queues.get(tenant)
        if q is None:
            own = self.counters.get(tenant, 0.0)
            self.counters[tenant] = max(own, self._floor()) if lift else own
            q = self._queues[tenant] = self._new_line()
            self._push(tenant)
        return q

    def _leave_if_empty(self, tenant: str) -> None:
        if not self._queues[tenant]:
            del self._queues[tenant]
            self._last_left = tenant

    def add(self, request: Request) -> None:
        self._enter(request.tenant, lift=True).append(request)
        self._len += 1

    def prepend(self, request: Request) -> None:
        self._enter(request.tenant, lift=False).appendleft(request)
        self._len += 1

    def peek(self) -> Request:
        tenant = self._next_tenant()
        if tenant is None:
            raise IndexError("peek from an empty queue")
        return self._queues[tenant][0]

    def pop(self) -> Request:
        tenant = self._next_tenant()
        if tenant is None:
            raise IndexError("pop from an empty queue")
        request = self._queues[tenant].popleft()
        self._leave_if_empty(tenant)
        self._len -= 1
        return request

    def remove(self, request: Request) -> None:
        self._queues[request.tenant].remove(request)
        self._leave_if_empty(request.tenant)
        self._len -= 1

    def learn(self, request: Request) -> None:
        if self._srpt is not None:
            self._srpt.learn(request)

    @property
    def predictor(self) -> RemainingLength | None:
        """The length predictor that orders each tenant's line (fair_srpt), None under fair."""
        return self._srpt.predictor if self._srpt is not None else None

    def predicted_remaining(self, request: Request) -> float | None:
        return self._srpt.predicted_remaining(request) if self._srpt is not None else None

    def backlogged(self) -> list[str]:
        """Tenants with queued requests (VTC's backlogged clients)."""
        return list(self._queues)

    def charge(self, tenant: str, tokens: float) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + tokens
        if tenant in self._queues:
            self._push(tenant)
        else:
            self._maybe_compact()

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        return itertools.chain.from_iterable(self._queues.values())


@dataclass(slots=True, eq=False)
class _Waiting:
    """A request in the SRPT queue, with what its order and its aging need."""

    request: Request
    seq: int  # arrival order
    remaining: float  # predicted remaining output tokens (inf: no prediction)
    limit: int  # later arrivals of its priority that may be admitted before it
    skips: int = 0  # later arrivals of its priority admitted before it so far


class SRPTQueue:
    """Shortest predicted remaining output first, within the most urgent priority present, aged.

    The aging bound: counted in admissions, no request waits more than aging_factor times its FCFS
    wait. A request that finds `ahead` requests waiting would, under FCFS, be admitted with the
    (ahead + 1)-th admission from its arrival; here it lets at most floor((f - 1) * (ahead + 1))
    later arrivals of its priority go first, and once it has it is due: a due request goes before
    every later arrival, the earliest due first. So it is admitted within f * (ahead + 1)
    admissions. The bound holds among requests of one priority (more urgent ones go first, as under
    `priority`) and for requests never preempted (a preempted request returns to the front, as
    under FCFS). A request with no prediction (cold or broken predictor) sorts last, so with no
    predictions at all the order is FCFS. Choosing costs O(waiting) per admission.
    """

    charges_tokens = False

    def __init__(self, predictor: RemainingLength | None = None, aging_factor: float = 2.0):
        if not (math.isfinite(aging_factor) and aging_factor >= 1):
            raise ValueError(f"srpt_aging_factor: must be a finite number >= 1, got {aging_factor}")
        self.predictor = predictor
        self.aging_factor = aging_factor
        self._front: deque[Request] = deque()  # preempted requests, next in FCFS order
        self._entries: list[_Waiting] = []  # in arrival order
        self._seq = itertools.count()
        self._chosen: int | None = None  # index of the next entry, until the queue changes

    def add(self, request: Request) -> None:
        estimate = safe_predict(self.predictor, request)
        remaining = estimate.median if estimate is not None else math.inf
        ahead = len(self)
        limit = math.floor((self.aging_factor - 1) * (ahead + 1))
        self._entries.append(_Waiting(request, next(self._seq), remaining, limit))
        self._chosen = None

    def prepend(self, request: Request) -> None:
        self._front.appendleft(request)

    def _choose(self) -> int:
        if self._chosen is None:
            entries = self._entries
            urgent = min(e.request.priority for e in entries)
            mine = [(i, e) for i, e in enumerate(entries) if e.request.priority == urgent]
            due = next((i for i, e in mine if e.skips >= e.limit), None)
            if due is None:
                due = min(mine, key=lambda ie: (ie[1].remaining, ie[1].seq))[0]
            self._chosen = due
        return self._chosen

    def peek(self) -> Request:
        if self._front:
            return self._front[0]
        if not self._entries:
            raise IndexError("peek from an empty queue")
        return self._entries[self._choose()].request

    def pop(self) -> Request:
        if self._front:
            return self._front.popleft()
        if not self._entries:
            raise IndexError("pop from an empty queue")
        chosen = self._entries.pop(self._choose())
        self._chosen = None
        for e in self._entries:
            if e.seq > chosen.seq:
                break  # entries are in arrival order: the rest arrived later
            if e.request.priority == chosen.request.priority:
                e.skips += 1
        return chosen.request

    def remove(self, request: Request) -> None:
        if request in self._front:
            self._front.remove(request)
            return
        self._entries = [e for e in self._entries if e.request is not request]
        self._chosen = None

    def charge(self, tenant: str, tokens: float) -> None:
        pass

    def learn(self, request: Request) -> None:
        safe_observe(self.predictor, request)

    def predicted_remaining(self, request: Request) -> float | None:
        """The predictor's median remaining output of request (None: no estimate)."""
        estimate = safe_predict(self.predictor, request)
        return estimate.median if estimate is not None else None

    def __len__(self) -> int:
        return len(self._front) + len(self._entries)

    def __iter__(self) -> Iterator[Request]:
        return itertools.chain(self._front, (e.request for e in self._entries))


class _SRPTLine(_Wrapped):
    """One tenant's line under fair_srpt: an SRPTQueue behind the deque methods FairQueue uses."""

    _q: SRPTQueue

    def __init__(self, queue: SRPTQueue) -> None:
        self._q = queue

    def append(self, request: Request) -> None:
        self._q.add(request)

    def appendleft(self, request: Request) -> None:
        self._q.prepend(request)

    def popleft(self) -> Request:
        return self._q.pop()

    def __getitem__(self, i: int) -> Request:
        if i != 0:
            raise IndexError("a tenant's SRPT line shows only its next request")
        return self._q.peek()


_Line = deque[Request] | _SRPTLine

WaitingQueue = FCFSQueue | PriorityQueue | FairQueue | SRPTQueue


def make_waiting_queue(
    policy: str, srpt_aging_factor: float = 2.0, predictor: RemainingLength | None = None
) -> WaitingQueue:
    """The waiting queue for a SchedulerConfig.policy value; srpt and fair_srpt order by
    `predictor` (a new LengthPredictor when None)."""
    if policy in ("srpt", "fair_srpt"):
        model = predictor if predictor is not None else LengthPredictor()
        srpt = SRPTQueue(model, srpt_aging_factor)
        return srpt if policy == "srpt" else FairQueue(srpt)
    queues: dict[str, type[FCFSQueue | PriorityQueue | FairQueue]] = {
        "fcfs": FCFSQueue,
        "priority": PriorityQueue,
        "fair": FairQueue,
    }
    return queues[policy]()
