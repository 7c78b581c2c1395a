"""One choice of a completion: replica stream -> token deltas -> text deltas, cut at stop
strings."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.context import _set_request_context

from cluster.errors import EngineFailedError, ReplicaDrainingError
from cluster.kv_event_pub import deliver_kv_tail
from cluster.metrics import RequestMetrics
from cluster.outcomes import report_outcome
from deploy.disagg_route import DisaggResponse
from deploy.errors import (
    RepeatedReplicaFailureError,
    ReplicaUnavailableError,
    RequestFailedError,
    RequestTimeoutError,
)
from frontend.detokenizer import TextStream
from frontend.frontend import Frontend
from scheduler.outputs import TokenLogprobs
from scheduler.request import EngineRequest

if TYPE_CHECKING:
    from cluster.tracing import TraceContext
    from deploy.tracing import RequestSpan

logger = logging.getLogger(__name__)


def _route_as_own_request() -> str:
    """Give the next replica call an internal request id of its own, and return it.

    Ray Serve 2.60 copies the id from the HTTP request's context, so the n choices of one request
    would share it; its router indexes pending requests by that id (all but one would never be
    routed) and reports completions by it. Called inside each choice's own task context.
    """
    internal_request_id = uuid.uuid4().hex
    _set_request_context(_internal_request_id=internal_request_id)
    return internal_request_id


@dataclass(slots=True)
class ChoiceDelta:
    """What one choice produced since its last delta; finish_reason is set on its last one."""

    index: int
    prompt_index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs] | None = None  # once, with the choice's first tokens


@dataclass(slots=True)
class UsageTally:
    """Token counts of a response so far: each prompt counted once, however many choices it has,
    and each choice's tokens as its latest delta counts them (deltas carry running totals, so a
    tally mid-stream is the usage up to that delta and the finished tally the response's)."""

    prompt: dict[int, int] = field(default_factory=dict)
    cached: dict[int, int] = field(default_factory=dict)
    outputs: dict[int, int] = field(default_factory=dict)  # choice index -> tokens generated

    def add(self, delta: ChoiceDelta) -> None:
        self.prompt[delta.prompt_index] = delta.num_prompt_tokens
        self.cached[delta.prompt_index] = max(
            self.cached.get(delta.prompt_index, 0), delta.num_cached_tokens
        )
        self.outputs[delta.index] = delta.num_output_tokens

    def as_dict(self) -> dict:
        prompt = sum(self.prompt.values())
        completion = sum(self.outputs.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())},
        }


class ReplicaAbortedError(RuntimeError):
    """The replica handed back a request it had accepted (it is shutting down): resume it
    elsewhere."""


def is_replica_failure(exc: BaseException) -> bool:
    """A failure of the replica, not of the request: the choice can resume on another replica.

    Classified by type: a dead or unreachable actor, a failed engine, a replica that gave up the
    request. A RayTaskError is an instance of its cause's class too, so isinstance sees through it.
    """
    return isinstance(
        exc,
        (
            RayActorError,
            ActorUnavailableError,
            EngineFailedError,
            ReplicaAbortedError,
            ReplicaDrainingError,
        ),
    )


def is_replica_fault(exc: BaseException) -> bool:
    """A replica failure that counts against the replica's circuit: not an orderly hand-back on
    shutdown."""
    return is_replica_failure(exc) and not isinstance(
        exc, (ReplicaAbortedError, ReplicaDrainingError)
    )


# A request present in this many engine failures is not resumed again: one that fails its engine
# would otherwise fail every engine it is carried to, max_migrations times over. Only an engine
# that reported its failure counts: a replica process that vanished (RayActorError) may have been
# stopped by Serve on a scale-down, which must not cost a request anything.
MAX_REPLICA_FAULTS = 2


@dataclass(slots=True)
class MigrationBudget:
    """How often one choice may still move to another replica."""

    request_id: str
    max_migrations: int
    migrations: int = 0
    faults: int = 0

    def spend(self, failure: BaseException) -> None:
        """Count a replica failure; raises when the choice must not move again."""
        self.migrations += 1
        self.faults += isinstance(failure, EngineFailedError)
        if self.faults >= MAX_REPLICA_FAULTS:
            raise RepeatedReplicaFailureError(self.request_id, self.faults) from None
        if self.migrations > self.max_migrations:
            raise ReplicaUnavailableError(self.request_id, self.max_migrations) from None


@dataclass(slots=True)
class Choice:
    """Streams one EngineRequest through replica handles, detokenizing on the way.

    The choice owns its emitted token ids and its text: when its replica fails or hands it back
    it resumes on another one (prompt + emitted tokens, the same parameters), at most
    max_migrations times, and the client sees one uninterrupted stream. Its finish is counted in
    `metrics` once, as the client saw it.
    """

    index: int
    prompt_index: int
    request: EngineRequest
    frontend: Frontend
    metrics: RequestMetrics
    max_migrations: int = 3
    emitted: list[int] = field(default_factory=list)
    # The prompt's log-probabilities came (a choice resumed elsewhere gets them once).
    has_prompt_logprobs: bool = False
    # A disaggregated model's prefill deployment (deploy/disagg_route.py): a choice with nothing
    # emitted yet starts there; None: the replica computes the whole request.
    prefill: Any = None
    # The request's span when it is traced (deploy/tracing.py): one span per attempt under it.
    trace: RequestSpan | None = None

    async def stream(self, replica: Any) -> AsyncIterator[ChoiceDelta]:
        """The choice's deltas, its finish reason on the last. One that raises counts as "error",
        one closed before its finish (a client gone, a deadline) as "abort"."""
        start = time.perf_counter()
        finish = "abort"
        try:
            async for delta in self._migrating(replica):
                finish = delta.finish_reason or finish
                yield delta
        except Exception:
            finish = "error"
            raise
        finally:
            self.metrics.record_finished(finish, time.perf_counter() - start)
            if self.trace is not None:
                num_prompt = len(self.request.prompt_token_ids)
                self.trace.choice_done(
                    self.index, self.prompt_index, num_prompt, len(self.emitted), finish
                )

    async def _migrating(self, replica: Any) -> AsyncIterator[ChoiceDelta]:
        text_stream = self.frontend.text_stream(
            self.request.prompt_token_ids, self.request.sampling_params
        )
        budget = MigrationBudget(self.request.request_id, self.max_migrations)
        while True:
            request = self._attempt(budget.migrations)
            attempt = context = None
            if self.trace is not None:
                attempt = self.trace.attempt(self.index, budget.migrations, request.request_id)
                context = attempt.context
            try:
                async for delta in self._stream_once(replica, request, text_stream, context):
                    yield delta
                return
            except Exception as exc:
                if attempt is not None:
                    attempt.fail(exc)
                if not is_replica_failure(exc):
                    raise
                budget.spend(exc)
                logger.warning(
                    "choice %s: its replica failed (%s); resuming after %d tokens elsewhere "
                    "(migration %d of at most %d)",
                    self.request.request_id,
                    type(exc).__name__,
                    len(self.emitted),
                    budget.migrations,
                    self.max_migrations,
                )
                # Give Serve a moment to take the dead replica out of the routing set.
                await asyncio.sleep(0.2 * budget.migrations)
            finally:
                if attempt is not None:
                    attempt.span.end()

    def _attempt(self, migrations: int) -> EngineRequest:
        if migrations == 0:
            return self.request
        return replace(
            self.request,
            request_id=f"{self.request.request_id}-m{migrations}",
            output_token_ids=list(self.emitted),
        )

    async def _stream_once(
        self,
        replica: Any,
        request: EngineRequest,
        text_stream: TextStream,
        trace: TraceContext | None = None,
    ) -> AsyncIterator[ChoiceDelta]:
        internal_request_id = _route_as_own_request()
        if self.prefill is not None and not request.output_token_ids:
            response: Any = DisaggResponse(self.prefill, replica, request, trace)
        elif trace is None:
            response = replica.options(stream=True).generate.remote(request)
        else:  # the router and the replica parent their spans under the attempt's
            response = replica.options(stream=True).generate.remote(request, trace=trace)
        done = False
        try:
            async for out in response:
                tokens = out.new_token_ids
                self.emitted.extend(tokens)
                # A hand-back ("abort") is not the end of the text: what the text stream holds
                # back (a partial character, a possible stop string) goes on on the next replica.
                handed_back = out.finished and out.finish_reason == "abort"
                finished = out.finished and not handed_back
                # Usage counts every token generated, including those past a stop string's cut.
                sent = text_stream.feed(tokens, finished, finished and out.finish_reason == "stop")
                finish = (
                    "stop" if text_stream.stopped else (out.finish_reason if finished else None)
                )
                if finish == "error":
                    raise RequestFailedError(request.request_id, out.error)
                done = finish is not None
                if done:
                    deliver_kv_tail(out)  # the router has them before the client's next request
                    report_outcome(internal_request_id, ok=True)
                prompt_logprobs = None
                if out.prompt_logprobs is not None and not self.has_prompt_logprobs:
                    prompt_logprobs, self.has_prompt_logprobs = out.prompt_logprobs, True
                # The text of handed-back tokens goes out before the request moves.
                yield ChoiceDelta(
                    self.index,
                    self.prompt_index,
                    sent,
                    tokens,
                    out.new_logprobs,
                    finish,
                    len(request.prompt_token_ids),
                    len(self.emitted),
                    out.num_cached_tokens,
                    prompt_logprobs,
                )
                if done:
                    return
                if handed_back:
                    raise ReplicaAbortedError(
                        f"request {request.request_id} was handed back by its replica"
                    )
        except Exception as exc:
            if is_replica_fault(exc):
                report_outcome(
                    internal_request_id, ok=False
                )  # the router's circuit breaker counts it
            raise
        finally:
            if not done:
                response.cancel()
            elif text_stream.stopped:
                response.cancel()  # the replica is told to stop: it aborts and frees the blocks


async def with_deadline(
    deltas: AsyncIterator[ChoiceDelta], deadline: float
) -> AsyncIterator[ChoiceDelta]:
    """The deltas until time.monotonic() reaches deadline; then the generation is cancelled (the
    replica aborts it and frees its blocks) and RequestTimeoutError is raised."""
    iterator = aiter(deltas)
    while True:
        try:
            delta = await asyncio.wait_for(
                anext(iterator), timeout=max(deadline - time.monotonic(), 0.0)
            )
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise RequestTimeoutError(
                "The request did not finish within its deadline (request_timeout_s).",
                code="request_timeout",
            ) from None
        yield delta


async def merge_streams(streams: list[AsyncIterator[ChoiceDelta]]) -> AsyncIterator[ChoiceDelta]:
    """Interleave the deltas of several choices as they arrive (n > 1, or several prompts)."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield delta
        return
    queue: asyncio.Queue = asyncio.Queue()
    sentinel = object()

    async def pump(stream: AsyncIterator[ChoiceDelta]) -> None:
        try:
            async for delta in stream:
                await queue.put(delta)
        except Exception as exc:
            await queue.put(exc)
        finally:
            await queue.put(sentinel)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is sentinel:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
