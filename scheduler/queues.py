"""Waiting-queue policies: FCFS, priority, and per-tenant fairness by virtual token counters.

Each queue holds WAITING, PREEMPTED and SWAPPED requests. A preempted request goes back with
`prepend`, ahead of newer arrivals. `charge` feeds the fair policy's counters; the others ignore it.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from scheduler.request import Request


class FCFSQueue:
    """First come, first served; preempted requests return to the front."""

    charges_tokens = False

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

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def charge(self, tenant: str, tokens: float) -> None:
        pass

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    """Lowest priority number first, then earliest arrival (a preempted request keeps its place)."""

    charges_tokens = False

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

    def charge(self, tenant: str, tokens: float) -> None:
        pass

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

    def __init__(self) -> None:
        self._queues: dict[str, deque[Request]] = {}  # backlogged tenants only
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

    def _enter(self, tenant: str, lift: bool) -> deque[Request]:
        q = self._queues.get(tenant)
        if q is None:
            own = self.counters.get(tenant, 0.0)
            self.counters[tenant] = max(own, self._floor()) if lift else own
            q = self._queues[tenant] = deque()
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


WaitingQueue = FCFSQueue | PriorityQueue | FairQueue


def make_waiting_queue(policy: str) -> WaitingQueue:
    """The waiting queue for a SchedulerConfig.policy value."""
    queues: dict[str, type[WaitingQueue]] = {
        "fcfs": FCFSQueue,
        "priority": PriorityQueue,
        "fair": FairQueue,
    }
    return queues[policy]()
