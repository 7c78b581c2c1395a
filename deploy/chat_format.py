"""The chat completion format: `chat.completion` whole, `chat.completion.chunk` streamed. Each
choice's text becomes message fields: reasoning (with a reasoning parser), content, or tool calls
when tools are on."""

from __future__ import annotations

from typing import Any

from deploy.choices_format import ChoicesFormat
from deploy.engine_requests import Generation
from deploy.generation import ChoiceDelta
from deploy.logprobs import chat_logprobs, prompt_logprobs_json
from deploy.reply import ReplySplit


class ChatSplit:
    """One chat choice's text as OpenAI message fields."""

    def __init__(self, split: ReplySplit) -> None:
        self.split = split

    def message(self, text: str) -> dict[str, Any]:
        """The whole reply as a message."""
        piece = self.split.whole(text)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": piece.content or (None if piece.calls else ""),
        }
        if self.split.reasoning is not None:
            message["reasoning_content"] = piece.reasoning or None
        if piece.calls:
            message["tool_calls"] = piece.calls
        return message

    def delta(self, text: str, last: bool, first: bool) -> dict[str, Any]:
        """The streamed delta for `text` more (empty when nothing can be sent yet)."""
        piece = self.split.feed(text)
        if last:
            piece += self.split.finish()
        start = self.split.num_calls - len(piece.calls)  # this delta's first call's index
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if piece.reasoning:
            delta["reasoning_content"] = piece.reasoning
        if piece.content or (first and not piece.calls and not piece.reasoning):
            delta["content"] = piece.content
        if piece.calls:
            delta["tool_calls"] = [
                {"index": start + k, **call} for k, call in enumerate(piece.calls)
            ]
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        """A reply that made calls and stopped by itself finishes with "tool_calls"."""
        if reason == "stop" and self.split.num_calls:
            return "tool_calls"
        return reason


class ChatFormat(ChoicesFormat):
    """A chat completion's reply; prompt log-probabilities (one prompt) go at the top, as vLLM's."""

    CHUNK_OBJECT = "chat.completion.chunk"
    WHOLE_OBJECT = "chat.completion"

    def __init__(self, gen: Generation) -> None:
        super().__init__(gen)
        self.splits: dict[int, ChatSplit] = {}  # a stream's, by choice index
        self.prompt_logprobs = gen.body.prompt_logprobs is not None

    def _chunk_choice(self, d: ChoiceDelta) -> dict[str, Any] | None:
        first = d.index not in self.splits
        split = self.splits.setdefault(d.index, ChatSplit(self.gen.reply_split()))
        delta = split.delta(d.text, d.finish_reason is not None, first)
        lp = chat_logprobs(d.logprobs, self.texts) if d.logprobs else None
        # A delta whose text is held back (partial UTF-8, a possible stop string or tool-call
        # marker) sends nothing.
        if not (delta or lp or d.finish_reason is not None):
            return None
        return {
            "index": d.index,
            "delta": delta,
            "logprobs": lp,
            "finish_reason": split.finish_reason(d.finish_reason),
        }

    def _whole_choices(self, head: dict[str, Any]) -> tuple[list[dict[str, Any]], list]:
        c = self.collected
        choices, logprobs = [], []
        for i, text in enumerate(c.texts):
            split = ChatSplit(self.gen.reply_split())
            message = split.message(text)
            choices.append(
                {"index": i, "message": message, "finish_reason": split.finish_reason(c.finish[i])}
            )
            logprobs.append(chat_logprobs(c.logprobs[i], self.texts) if c.logprobs[i] else None)
        if self.prompt_logprobs and c.prompt_logprobs:
            head["prompt_logprobs"] = prompt_logprobs_json(c.prompt_logprobs[0], self.texts)
        return choices, logprobs
