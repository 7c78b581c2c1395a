"""One choice of a completion: replica stream -> token deltas -> text deltas, cut at stop strings."""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ray.serve.context import _set_request_context

from cluster.frontend import Frontend
from deploy.errors import RequestFailedError
from cluster.protocol import GenerateRequest
from scheduler.outputs import TokenLogprobs

logger = logging.getLogger(__name__)


def _route_as_own_request() -> None:
    """Give the next replica call an internal request id of its own.

    Ray Serve 2.60 copies the id from the HTTP request's context, so the n choices of one request
    would share it; its router indexes pending requests by that id (all but one would never be
    routed) and reports completions by it. Called inside each choice's own task context.
    """
    _set_request_context(_internal_request_id=uuid.uuid4().hex)


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


@dataclass(slots=True)
class UsageTally:
    """Token counts of a response: each prompt counted once, however many choices it has."""

    prompt: dict[int, int] = field(default_factory=dict)
    cached: dict[int, int] = field(default_factory=dict)
    completion: int = 0

    def add(self, delta: ChoiceDelta) -> None:
        if delta.finish_reason is None:
            return
        self.prompt[delta.prompt_index] = delta.num_prompt_tokens
        self.cached[delta.prompt_index] = max(self.cached.get(delta.prompt_index, 0), delta.num_cached_tokens)
        self.completion += delta.num_output_tokens

    def as_dict(self) -> dict:
        prompt = sum(self.prompt.values())
        return {"prompt_tokens": prompt, "completion_tokens": self.completion,
                "total_tokens": prompt + self.completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())}}


@dataclass(slots=True)
class Choice:
    """Streams one GenerateRequest through a replica handle, detokenizing on the way."""

    index: int
    prompt_index: int
    request: GenerateRequest
    frontend: Frontend

    async def stream(self, replica: Any) -> AsyncIterator[ChoiceDelta]:
        text_stream = self.frontend.text_stream(self.request.prompt_token_ids, self.request.sampling_params.stop)
        num_output = 0
        _route_as_own_request()
        response = replica.options(stream=True).generate.remote(self.request)
        done = False
        try:
            async for out in response:
                tokens = out.new_token_ids
                logprobs = out.new_logprobs
                # Usage counts every token generated, including those past a stop string's cut.
                sent = text_stream.feed(tokens, out.finished)
                num_output += len(tokens)
                finish = "stop" if text_stream.stopped else (out.finish_reason if out.finished else None)
                if finish == "abort":
                    raise RuntimeError(f"request {self.request.request_id} was aborted by its replica")
                if finish == "error":
                    raise RequestFailedError(self.request.request_id, out.error)
                done = finish is not None
                yield ChoiceDelta(self.index, self.prompt_index, sent, tokens, logprobs, finish,
                                  len(self.request.prompt_token_ids), num_output, out.num_cached_tokens)
                if done:
                    return
        finally:
            if not done:
                response.cancel()
            elif text_stream.stopped:
                response.cancel()  # the replica is told to stop: it aborts and frees the blocks


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
        except Exception as exc:  # noqa: BLE001 - re-raised in the consumer
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
