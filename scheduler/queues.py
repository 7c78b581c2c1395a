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
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._seq), request))

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
    backlog last), so idling
    earns no credit to flood the others with later.
    """

    charges_tokens = True

    def __init__(self) -> None:
        self._queues: dict[str, deque[Request]] = {}
        self.counters: dict[str, float] = {}
        self._last_left: str | None = None
        self._len = 0

    def _backlogged(self) -> Iterator[str]:
        return (t for t, q in self._queues.items() if q)

    def _lift(self, tenant: str) -> None:
        last = self.counters.get(self._last_left, 0.0) if self._last_left is not None else 0.0
        floor = min((self.counters[t] for t in self._backlogged()), default=last)
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    def add(self, request: Request) -> None:
        q = self._queues.get(request.tenant)
        if not q:
            self._lift(request.tenant)
            q = self._queues.setdefault(request.tenant, deque())
        q.append(request)
        self._len += 1

    def prepend(self, request: Request) -> None:
        q = self._queues.setdefault(request.tenant, deque())
        self.counters.setdefault(request.tenant, 0.0)
        q.appendleft(request)
        self._len += 1

    def _next_tenant(self) -> str:
        return min(self._backlogged(), key=lambda t: self.counters[t])

    def peek(self) -> Request:
        return self._queues[self._next_tenant()][0]

    def pop(self) -> Request:
        tenant = self._next_tenant()
        q = self._queues[tenant]
        request = q.popleft()
        if not q:
            self._last_left = tenant
        self._len -= 1
        return request

    def remove(self, request: Request) -> None:
        self._queues[request.tenant].remove(request)
        self._len -= 1

    def charge(self, tenant: str, tokens: float) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + tokens

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        return itertools.chain.from_iterable(self._queues.values())


WaitingQueue = FCFSQueue | PriorityQueue | FairQueue


def make_waiting_queue(policy: str) -> WaitingQueue:
    """The waiting queue for a SchedulerConfig.policy value."""
    return {"fcfs": FCFSQueue, "priority": PriorityQueue, "fair": FairQueue}[policy]()
