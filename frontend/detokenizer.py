"""Incremental detokenization (safe across multi-byte UTF-8 pieces) and stop-string matching."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Prompt tokens decoded as context before the first output token, so tokenizers that strip a
# leading space from the first decoded piece (SentencePiece) still produce it.
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns token ids, a few at a time, into text deltas.

    Decodes a sliding window [prefix_offset:] and emits only what grew beyond the window's already
    emitted part; text ending in U+FFFD (an incomplete UTF-8 byte sequence) is held back until the
    next token completes it. Each step decodes a handful of tokens, not the whole output.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list((prompt_token_ids or [])[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Append token ids; return the newly complete text (may be empty)."""
        if not token_ids:
            return ""
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of generation: whatever is still held back (a truncated UTF-8 sequence)."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta


@dataclass(slots=True)
class StopMatcher:
    """Applies stop strings to streamed text: holds back a possible partial match, cuts at a full
    one.

    feed(delta) returns the text that is safe to send now; stopped turns True once a stop string
    appeared (the text is cut before it, as OpenAI does).
    """

    stops: list[str]
    text: str = ""
    sent: int = 0
    stopped: bool = False
    _hold: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._hold = max((len(s) for s in self.stops), default=1) - 1

    def feed(self, delta: str, final: bool = False) -> str:
        if self.stopped:
            return ""
        start = max(0, len(self.text) - self._hold)
        self.text += delta
        cut = self._find(start)
        if cut is not None:
            self.text = self.text[:cut]
            self.stopped = True
            final = True
        end = len(self.text) if final else max(self.sent, len(self.text) - self._hold)
        out = self.text[self.sent : end]
        self.sent = end
        return out

    def _find(self, start: int) -> int | None:
        hits = [i for s in self.stops if (i := self.text.find(s, start)) != -1]
        return min(hits) if hits else None


@dataclass(slots=True)
class TextStream:
    """One generation's text: token deltas in, stop-cut text deltas out (detokenizer + stop
    matcher)."""

    detokenizer: IncrementalDetokenizer
    matcher: StopMatcher

    def feed(self, token_ids: list[int], finished: bool) -> str:
        """The text safe to emit after these tokens; `stopped` turns True at a stop string."""
        delta = self.detokenizer.add(token_ids)
        if finished:
            delta += self.detokenizer.flush()
        return self.matcher.feed(delta, final=finished)

    @property
    def stopped(self) -> bool:
        return self.matcher.stopped

    @property
    def text(self) -> str:
        return self.matcher.text
