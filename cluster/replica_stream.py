"""ReplicaStream: the event-loop side of one request on a replica.

The engine thread's deltas arrive in its queue; a consumer that fell behind reads them merged
into one. Past the first tokens, deltas are held until a chunk of `stream_interval` tokens is
ready (cluster/stream_chunks.py sizes it), and a hand-back at drain or failure carries every token
the stream still holds. It also keeps the request's latency record (cluster/replica_telemetry.py).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace

from scheduler.outputs import RequestOutput


def merge_outputs(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two deltas of one request as one (the consumer fell behind by a step)."""
    logprobs = None
    if first.new_logprobs is not None or later.new_logprobs is not None:
        logprobs = (first.new_logprobs or []) + (later.new_logprobs or [])
    return RequestOutput(
        request_id=later.request_id,
        new_token_ids=first.new_token_ids + later.new_token_ids,
        finished=later.finished,
        finish_reason=later.finish_reason,
        num_prompt_tokens=later.num_prompt_tokens or first.num_prompt_tokens,
        num_output_tokens=later.num_output_tokens,
        num_cached_tokens=later.num_cached_tokens,
        new_logprobs=logprobs,
        error=later.error,
        prompt_logprobs=first.prompt_logprobs or later.prompt_logprobs,
        kv_events=later.kv_events,
    )


@dataclass(slots=True)
class ReplicaStream:
    """Event-loop side of one in-flight request."""

    request_id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    caller: str | None = None  # the caller actor's name (its death aborts the request)
    arrival: float = field(default_factory=time.perf_counter)
    last_token: float | None = None
    ttft: float | None = None
    gaps: int = 0  # inter-token gaps so far, and those over the SLO's ITL
    slow_gaps: int = 0
    sent: bool = False  # a delta with tokens has gone out (the first tokens are never held back)
    held: RequestOutput | None = None  # tokens waiting for a full chunk (stream_interval)

    def chunk(self, output: RequestOutput, interval: int) -> RequestOutput | None:
        """The delta to send now, or None while it is held for a chunk of `interval` tokens; the
        first tokens, a finish and an error are never held."""
        if self.held is not None:
            output, self.held = merge_outputs(self.held, output), None
        if (
            self.sent
            and not output.finished
            and output.error is None
            and len(output.new_token_ids) < interval
        ):
            self.held = output
            return None
        self.sent = self.sent or bool(output.new_token_ids)
        return output

    def hand_back(self) -> None:
        """End the stream with an "abort" that carries every token it still holds (queued deltas
        merge into it in next()): the ingress sends their text, then resumes the request on
        another replica from there."""
        if self.held is None:
            last = RequestOutput(self.request_id, [], True, "abort")
        else:
            last, self.held = replace(self.held, finished=True, finish_reason="abort"), None
        self.queue.put_nowait(last)

    async def next(self) -> RequestOutput:
        item = await self.queue.get()
        while isinstance(item, RequestOutput) and not item.finished and not self.queue.empty():
            nxt = self.queue.get_nowait()
            if not isinstance(nxt, RequestOutput):
                item = nxt
                break
            item = merge_outputs(item, nxt)
        if isinstance(item, BaseException):
            raise item
        return item
