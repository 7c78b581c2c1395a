"""Incremental detokenization (safe across multi-byte UTF-8 pieces) and stop-string matching."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Prompt tokens decoded as context before the first output token, so tokenizers that strip a
# leading space from the first decoded piece (SentencePiece) still produce it.
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"
# How many deltas in a row may be held back waiting for a character to complete. A character
# split over tokens completes within a few (four byte tokens at most); past this many, text that
# still ends in U+FFFD (a lone continuation byte, an invalid sequence) is emitted as the
# tokenizer decodes it. Without the cap each such token re-decodes a window one token longer:
# quadratic work. Counted in deltas, not tokens: one delta of many tokens (a chunk) may end
# inside a character like any other.
MAX_HELD_DELTAS = 8


class IncrementalDetokenizer:
    """Turns token ids, a few at a time, into text deltas.

    Decodes a sliding window [prefix_offset:] and emits only what grew beyond the window's already
    emitted part; text ending in U+FFFD (an incomplete UTF-8 byte sequence) is held back until the
    next token completes it, for at most MAX_HELD_DELTAS deltas. Each delta decodes a bounded
    window, never the whole output.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Only slow (Python) tokenizers read it; fast ones join special tokens as they are.
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.ids: list[int] = list((prompt_token_ids or [])[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self._deltas: list[str] = []
        self._held = 0  # deltas held back in a row, waiting for a character to complete

    @property
    def text(self) -> str:
        return "".join(self._deltas)

    def _decode(self, ids: list[int]) -> str:
        if self.spaces_between_special_tokens:
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, spaces_between_special_tokens=False
        )

    def add(self, token_ids: list[int]) -> str:
        """Append token ids; return the newly complete text (may be empty)."""
        if not token_ids:
            return ""
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        complete = len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT)
        if not complete and self._held < MAX_HELD_DELTAS:
            self._held += 1
            return ""
        return self._advance(new_text[len(prefix_text) :])

    def flush(self) -> str:
        """At the end of generation: whatever is still held back (a truncated UTF-8 sequence)."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        return self._advance(new_text[len(prefix_text) :])

    def _advance(self, delta: str) -> str:
        """Emit delta: the window now starts at the tokens it was decoded from."""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._held = 0
        if delta:
            self._deltas.append(delta)
        return delta


@dataclass(slots=True)
class StopMatcher:
    """Applies stop strings to streamed text: holds back a possible partial match, cuts at a full
    one.

    feed(delta) returns the text that is safe to send now; stopped turns True once a stop string
    appeared (the text is cut before it, as OpenAI does). Each feed searches only the held-back
    tail and the new delta.
    """

    stops: list[str]
    include_stop: bool = False  # the text ends after the stop string instead of before it
    stopped: bool = False
    _hold: int = field(init=False, default=0)
    _sent: list[str] = field(init=False, default_factory=list)
    _pending: str = field(init=False, default="")  # not yet sent: it may begin a stop string

    def __post_init__(self) -> None:
        self._hold = max((len(s) for s in self.stops), default=1) - 1

    @property
    def text(self) -> str:
        """Everything fed so far, cut before the stop string once one appeared."""
        return "".join(self._sent) + self._pending

    def feed(self, delta: str, final: bool = False) -> str:
        if self.stopped:
            return ""
        # Everything before the pending tail was sent, so it holds no start of a stop string.
        window = self._pending + delta
        cut = self._find(window)
        if cut is not None:
            window = window[:cut]
            self.stopped = final = True
        end = len(window) if final else max(0, len(window) - self._hold)
        out, self._pending = window[:end], window[end:]
        if out:
            self._sent.append(out)
        return out

    def _find(self, window: str) -> int | None:
        """Where the stop string that completes first begins (the one beginning first, of those
        completing at the same character): the cut depends on the text, never on how it was
        split into deltas."""
        hits = [(i + len(s), i) for s in self.stops if (i := window.find(s)) != -1]
        if not hits:
            return None
        end, start = min(hits)
        return end if self.include_stop else start


@dataclass(slots=True)
class TextStream:
    """One generation's text: token deltas in, stop-cut text deltas out (detokenizer + stop
    matcher)."""

    detokenizer: IncrementalDetokenizer
    matcher: StopMatcher

    # False: a generation that ends on a stop token (EOS, a stop id) leaves that token's text out.
    include_stop_token: bool = True

    def feed(self, token_ids: list[int], finished: bool, stop_token: bool = False) -> str:
        """The text safe to emit after these tokens; `stopped` turns True at a stop string.

        finished flushes what is held back (a truncated character, a possible stop string's
        start): only the generation's real end may do that, never a hand-back to another
        replica, where the text goes on. stop_token: the last of token_ids ended the generation.
        """
        if stop_token and not self.include_stop_token:
            token_ids = token_ids[:-1]
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
