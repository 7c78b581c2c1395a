"""One choice's text as the parts of a reply: reasoning, plain content and tool calls.

The reasoning block comes first (frontend/reasoning.py); what follows it is the answer, read for
tool calls (deploy/tools.py) when the request declared tools. Used by chat completions and the
Responses API alike, whole or as the text streams.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from deploy.tools import DeclaredTools, ToolCallParser
from frontend.reasoning import ReasoningSplitter

if TYPE_CHECKING:
    from deploy.generation import ChoiceDelta, UsageTally


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


class PieceEvents(ABC):
    """A streamed reply's events in the order every API sends them: reasoning, then the answer,
    each appended to its open block (another block closed first), and each tool call after the
    open block closes. Subclasses name the two kinds of text block and write the events."""

    reasoning_kind: str
    answer_kind: str
    split: ReplySplit
    tally: UsageTally

    def feed(self, delta: ChoiceDelta) -> list[dict[str, Any]]:
        """The events of one delta of the choice (its finish included)."""
        self.tally.add(delta)
        piece = self.split.feed(self._shown(delta))
        if delta.finish_reason is not None:
            piece += self.split.finish()
        events = self._piece(piece)
        if delta.finish_reason is not None:
            events += self._finish(delta.finish_reason)
        return events

    def _shown(self, delta: ChoiceDelta) -> str:
        """The part of a delta's text the reply shows (all of it unless a format cuts some)."""
        return delta.text

    def _piece(self, piece: ReplyPiece) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if piece.reasoning:
            events += self._text(self.reasoning_kind, piece.reasoning)
        if piece.content:
            events += self._text(self.answer_kind, piece.content)
        for call in piece.calls:
            events += self._close()
            events += self._call(call)
        return events

    @abstractmethod
    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        """Text for the open block of this kind (opened first when another is open)."""

    @abstractmethod
    def _close(self) -> list[dict[str, Any]]:
        """Close the open block, if any."""

    @abstractmethod
    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """One complete tool call's events."""

    @abstractmethod
    def _finish(self, reason: str) -> list[dict[str, Any]]:
        """The events that end the reply, for the choice's finish reason."""
