"""What the engine measures of a traced request: its queue wait, each prefill chunk, its decode and
its KV loads, as wall-clock nanoseconds (spans are built from them later, off the engine thread:
cluster/tracing.py).

Stdlib only, no OpenTelemetry: the engine never builds a span. A request is traced only when its
replica asks (`StepTracer.watch`, for a request that carries a sampled trace context); while no
request is traced, the engine's step pays one truth test of two empty containers and allocates
nothing (engine/core.py, bench/tracing_overhead.py).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from scheduler.outputs import RequestOutput, SchedulerOutput
from scheduler.request import Request, RequestStatus


@dataclass(slots=True)
class Chunk:
    """Steps of a request: [start_ns, end_ns), `tokens` computed from `first` in `steps` steps.
    A prefill chunk is one step; the decode is one Chunk that grows by a step each step (a long
    generation keeps one object, not one per token)."""

    start_ns: int
    tokens: int
    first: int
    end_ns: int = 0
    steps: int = 1


@dataclass(slots=True)
class RequestTrace:
    """One traced request on this engine, from its arrival at the replica to its finish."""

    arrival_ns: int
    scheduled_ns: int | None = None  # its first step: the end of its queue wait
    # The prompt's chunks (and those recomputing it after a preemption), then the decode steps.
    prefill: list[Chunk] = field(default_factory=list)
    decode: Chunk | None = None
    kv_loads: list[tuple[int, int]] = field(default_factory=list)  # LOADING_KV intervals
    loading_since: int | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    finish_ns: int | None = None
    finish_reason: str | None = None
    # True until the chunk that reaches the end of what must be computed before sampling (the
    # prompt, or everything again after a preemption) has been scheduled.
    prefilling: bool = True

    def observe(self, req: Request, now: int) -> None:
        """The request's state at a step: a KV load starting or landing, a preemption."""
        loading = req.status is RequestStatus.LOADING_KV
        if loading and self.loading_since is None:
            self.loading_since = now
        elif not loading and self.loading_since is not None:
            self.kv_loads.append((self.loading_since, now))
            self.loading_since = None
        if req.num_preemptions != self.num_preemptions:
            self.num_preemptions = req.num_preemptions
            self.prefilling = True  # recomputed from the start
        self.num_cached_tokens = req.num_cached_tokens or 0

    def take(self, req: Request, n: int, now: int) -> Chunk:
        """A step scheduled n tokens of req (already counted as computed by the scheduler)."""
        if self.scheduled_ns is None:
            self.scheduled_ns = now
        if self.prefilling:
            chunk = Chunk(now, n, req.num_computed_tokens - n)
            self.prefill.append(chunk)
            # The last chunk reaches every token the runner must hold before it samples.
            self.prefilling = req.num_computed_tokens < req.num_tokens + req.num_output_placeholders
            return chunk
        if self.decode is None:
            self.decode = Chunk(now, n, req.num_computed_tokens - n)
        else:
            self.decode.tokens += n
            self.decode.steps += 1
        return self.decode

    def finish(self, output: RequestOutput, now: int) -> None:
        self.finish_ns = now
        self.finish_reason = output.finish_reason
        if self.loading_since is not None:
            self.kv_loads.append((self.loading_since, now))
            self.loading_since = None


class StepTracer:
    """The engine's traced requests; EngineCore calls `scheduled` and `updated` around each step
    only while `requests` or `pending` is non-empty.

    `watch` and `pop` are called from the replica's event loop, the rest from the engine thread:
    each touches the dicts with one operation (atomic under the GIL) and never iterates them.
    """

    def __init__(self) -> None:
        self.requests: dict[str, RequestTrace] = {}  # watched, not finished
        self.done: dict[str, RequestTrace] = {}  # finished, waiting for the replica to pop them
        # Steps scheduled with traced requests and not yet updated from (two under async
        # scheduling): the step and its chunks.
        self.pending: deque[tuple[SchedulerOutput, list[Chunk]]] = deque()

    def watch(self, request_id: str, arrival_ns: int) -> None:
        """Trace this request (before the engine is handed it)."""
        self.requests[request_id] = RequestTrace(arrival_ns)

    def pop(self, request_id: str) -> RequestTrace | None:
        """The request's trace, finished or not (a cancelled request's ends where it stopped);
        the tracer forgets it."""
        trace = self.done.pop(request_id, None)
        return trace if trace is not None else self.requests.pop(request_id, None)

    def scheduled(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        now = time.time_ns()
        chunks = []
        for rid, trace in list(self.requests.items()):
            req = requests.get(rid)
            if req is None:
                continue
            trace.observe(req, now)
            n = out.num_scheduled_tokens.get(rid)
            if n:
                chunks.append(trace.take(req, n, now))
        if chunks:
            self.pending.append((out, chunks))

    def updated(self, out: SchedulerOutput, outputs: list[RequestOutput]) -> None:
        now = time.time_ns()
        if self.pending and self.pending[0][0] is out:
            for chunk in self.pending.popleft()[1]:
                chunk.end_ns = now
        for output in outputs:
            if output.finished:
                trace = self.requests.pop(output.request_id, None)
                if trace is not None:
                    trace.finish(output, now)
                    self.done[output.request_id] = trace
