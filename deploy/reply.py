"""One choice's text as the parts of a reply: reasoning, plain content and tool calls.

The reasoning block comes first (frontend/reasoning.py); what follows it is the answer, read for
tool calls (deploy/tools.py) when the request declared tools. Used by chat completions and the
Responses API alike, whole or as the text streams.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deploy.tools import DeclaredTools, ToolCallParser
from frontend.reasoning import ReasoningSplitter


@dataclass(slots=True)
class ReplyPiece:
    """What a reply adds: reasoning text, content text and completed tool calls."""

    reasoning: str = ""
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)

    def __iadd__(self, other: ReplyPiece) -> ReplyPiece:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls
        return self


class ReplySplit:
    """Feeds one choice's text through the reasoning splitter, then the tool-call parser."""

    def __init__(
        self, tools: DeclaredTools | None, reasoning: ReasoningSplitter | None = None
    ) -> None:
        self.parser = ToolCallParser(tools) if tools is not None else None
        self.reasoning = reasoning

    @property
    def num_calls(self) -> int:
        return len(self.parser.calls) if self.parser is not None else 0

    def feed(self, text: str) -> ReplyPiece:
        reasoning, answer = self.reasoning.feed(text) if self.reasoning else ("", text)
        return self._answer(reasoning, answer)

    def finish(self) -> ReplyPiece:
        """What is left at the end of the reply."""
        reasoning, answer = self.reasoning.finish() if self.reasoning else ("", "")
        piece = self._answer(reasoning, answer)
        if self.parser is not None:
            rest, calls = self.parser.finish()
            piece += ReplyPiece("", rest, calls)
        return piece

    def whole(self, text: str) -> ReplyPiece:
        piece = self.feed(text)
        piece += self.finish()
        return piece

    def _answer(self, reasoning: str, answer: str) -> ReplyPiece:
        if self.parser is None:
            return ReplyPiece(reasoning, answer)
        content, calls = self.parser.feed(answer)
        return ReplyPiece(reasoning, content, calls)
