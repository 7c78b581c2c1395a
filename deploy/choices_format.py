"""What OpenAI's two `choices` formats share (chat.completion and text_completion): the chunk
head, the usage chunks, the error event and `[DONE]` of a stream; a whole reply collected per
choice and encoded on a thread when its log-probabilities are many.

Each format (deploy/chat_format.py, deploy/completion_format.py) says what one choice is, as a
chunk and whole.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import Response

from deploy.engine_requests import Generation
from deploy.errors import error_event
from deploy.generation import ChoiceDelta, UsageTally
from deploy.logprobs import num_entries, response_json
from deploy.reply_format import sse
from scheduler.outputs import TokenLogprobs

# A response with more log-probabilities than this is built and encoded on a thread.
LOGPROBS_OFF_LOOP = 4096


@dataclass(slots=True)
class Collected:
    """A whole reply's choices as their deltas arrive: text, log-probabilities, prompt
    log-probabilities, finish reason, and the usage."""

    texts: list[str]
    logprobs: list[list[TokenLogprobs]]
    prompt_logprobs: list[list[TokenLogprobs]]
    finish: list[str | None]
    tally: UsageTally = field(default_factory=UsageTally)

    @classmethod
    def of(cls, n: int, prefixes: list[str] | None = None) -> Collected:
        """prefixes: the text each choice begins with (an echoed prompt)."""
        texts = list(prefixes) if prefixes is not None else [""] * n
        return cls(texts, [[] for _ in range(n)], [[] for _ in range(n)], [None] * n)

    def add(self, d: ChoiceDelta) -> None:
        self.texts[d.index] += d.text
        if d.logprobs:
            self.logprobs[d.index] += d.logprobs
        if d.prompt_logprobs:
            self.prompt_logprobs[d.index] = d.prompt_logprobs
        if d.finish_reason is not None:
            self.finish[d.index] = d.finish_reason
        self.tally.add(d)

    def num_logprobs(self) -> int:
        return sum(num_entries(lp) for lp in self.logprobs + self.prompt_logprobs)


class ChoicesFormat:
    """A reply of OpenAI's `choices` shape; a format gives its object names and one choice's JSON
    (`_chunk_choice` streamed, `_whole_choices` whole)."""

    CHUNK_OBJECT = ""
    WHOLE_OBJECT = ""

    def __init__(self, gen: Generation, prefixes: list[str] | None = None) -> None:
        self.gen = gen
        self.texts = gen.model.texts
        options = gen.body.stream_options
        self.include_usage = bool(options and options.include_usage)
        # vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far.
        self.continuous_usage = bool(options and options.continuous_usage_stats)
        self.collected = Collected.of(len(gen.choices), prefixes)
        self.tally = UsageTally()  # a stream's usage so far
        self.head: dict[str, Any] = {}

    def _head(self, object_: str) -> dict[str, Any]:
        return {
            "id": self.gen.request_id,
            "object": object_,
            "created": int(time.time()),
            "model": self.gen.name,
        }

    # ---- streamed ------------------------------------------------------------------------------
    def start(self) -> list[bytes]:
        self.head = self._head(self.CHUNK_OBJECT)
        return []

    def feed(self, delta: ChoiceDelta) -> list[bytes]:
        self.tally.add(delta)
        choice = self._chunk_choice(delta)
        if choice is None:  # nothing to send yet (held-back text, a possible stop string)
            return []
        usage = {"usage": self.tally.as_dict()} if self.continuous_usage else {}
        return [sse({**self.head, "choices": [choice], **usage})]

    def end(self) -> list[bytes]:
        if not self.include_usage:
            return []
        return [sse({**self.head, "choices": [], "usage": self.tally.as_dict()})]

    def error(self, exc: Exception) -> list[bytes]:
        return [sse(error_event(exc))]

    def close(self) -> list[bytes]:
        return [sse("[DONE]")]

    def _chunk_choice(self, delta: ChoiceDelta) -> dict[str, Any] | None:
        raise NotImplementedError

    # ---- whole ---------------------------------------------------------------------------------
    def add(self, delta: ChoiceDelta) -> None:
        self.collected.add(delta)

    async def whole(self) -> Response:
        self._collected()
        large = self.collected.num_logprobs() > LOGPROBS_OFF_LOOP
        content = await asyncio.to_thread(self._encode) if large else self._encode()
        return Response(content, media_type="application/json")

    def _collected(self) -> None:
        """Called once every delta is in, before the reply is encoded."""

    def _encode(self) -> bytes:
        """The whole reply as JSON bytes (on a thread when its log-probabilities are many)."""
        head = self._head(self.WHOLE_OBJECT)
        head["usage"] = self.collected.tally.as_dict()
        choices, logprobs = self._whole_choices(head)
        return response_json(head, choices, logprobs)

    def _whole_choices(self, head: dict[str, Any]) -> tuple[list[dict[str, Any]], list]:
        """Each choice's JSON without its logprobs, and its logprobs (None: not asked); may add
        fields to `head`."""
        raise NotImplementedError
