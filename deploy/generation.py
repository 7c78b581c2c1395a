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
from scheduler.outputs import RequestOutput, TokenLogprobs
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
                await self._before_resuming(exc, budget)
            finally:
                if attempt is not None:
                    attempt.span.end()

    async def _before_resuming(self, failure: Exception, budget: MigrationBudget) -> None:
        """Spend a migration on a replica's failure (raises when none is left), then wait for
        Serve to take the dead replica out of the routing set."""
        budget.spend(failure)
        logger.warning(
            "choice %s: its replica failed (%s); resuming after %d tokens elsewhere "
            "(migration %d of at most %d)",
            self.request.request_id,
            type(failure).__name__,
            len(self.emitted),
            budget.migrations,
            self.max_migrations,
        )
        await asyncio.sleep(0.2 * budget.migrations)

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
        response = self._generate(replica, request, trace)
        done = False
        try:
            async for out in response:
                delta = self._delta(out, request, text_stream)
                done = delta.finish_reason is not None
                if done:
                    deliver_kv_tail(out)  # the router has them before the client's next request
                    report_outcome(internal_request_id, ok=True)
                # The text of handed-back tokens goes out before the request moves.
                yield delta
                if done:
                    return
                if _handed_back(out):
                    raise ReplicaAbortedError(
                        f"request {request.request_id} was handed back by its replica"
                    )
        except Exception as exc:
            if is_replica_fault(exc):  # the router's circuit breaker counts it
                report_outcome(internal_request_id, ok=False)
            raise
        finally:
            # Unfinished, or stopped by a stop string: the replica is told to stop, so that it
            # aborts the request and frees its blocks.
            if not done or text_stream.stopped:
                response.cancel()

    def _generate(self, replica: Any, request: EngineRequest, trace: TraceContext | None) -> Any:
        """The replica's stream of outputs for the request (through the prefill deployment while
        nothing is emitted, on a disaggregated model)."""
        if self.prefill is not None and not request.output_token_ids:
            return DisaggResponse(self.prefill, replica, request, trace)
        if trace is None:
            return replica.options(stream=True).generate.remote(request)
        # The router and the replica parent their spans under the attempt's.
        return replica.options(stream=True).generate.remote(request, trace=trace)

    def _delta(
        self, out: RequestOutput, request: EngineRequest, text_stream: TextStream
    ) -> ChoiceDelta:
        """One replica output as the choice's delta; an output that failed raises."""
        tokens = out.new_token_ids
        self.emitted.extend(tokens)
        sent, finish = _text_and_finish(out, text_stream)
        if finish == "error":
            raise RequestFailedError(request.request_id, out.error)
        return ChoiceDelta(
            self.index,
            self.prompt_index,
            sent,
            tokens,
            out.new_logprobs,
            finish,
            len(request.prompt_token_ids),
            len(self.emitted),
            out.num_cached_tokens,
            self._prompt_logprobs(out),
        )

    def _prompt_logprobs(self, out: RequestOutput) -> list[TokenLogprobs] | None:
        """The prompt's log-probabilities, the first time a replica sends them."""
        if out.prompt_logprobs is None or self.has_prompt_logprobs:
            return None
        self.has_prompt_logprobs = True
        return out.prompt_logprobs


def _handed_back(out: RequestOutput) -> bool:
    """The replica handed the request back (it drains): the choice resumes on another one."""
    return out.finished and out.finish_reason == "abort"


def _text_and_finish(out: RequestOutput, text_stream: TextStream) -> tuple[str, str | None]:
    """The text an output's tokens add and the choice's finish reason, if this output ends it."""
    # A hand-back is not the end of the text: what the text stream holds back (a partial
    # character, a possible stop string) goes on on the next replica.
    finished = out.finished and not _handed_back(out)
    # Usage counts every token generated, including those past a stop string's cut.
    sent = text_stream.feed(out.new_token_ids, finished, finished and out.finish_reason == "stop")
    if text_stream.stopped:
        return sent, "stop"
    return sent, out.finish_reason if finished else None


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
    tasks = [asyncio.create_task(_pump(s, queue)) for s in streams]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is _STREAM_END:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


_STREAM_END = object()  # what _pump queues last


async def _pump(stream: AsyncIterator[ChoiceDelta], queue: asyncio.Queue) -> None:
    """One stream's deltas into the merge's queue, then its exception if it raised, then the
    end mark."""
    try:
        async for delta in stream:
            await queue.put(delta)
    except Exception as exc:
        await queue.put(exc)
    finally:
        await queue.put(_STREAM_END)
