"""Reasoning output: a thinking model's `<think>...</think>` block, split from its answer.

A reasoning model writes its thinking between two markers before the answer. The splitter cuts
one choice's text into reasoning and content, whole or as it streams, holding back text that may
still be the start of a marker. Whether a reply starts inside the block is decided by the prompt
(a template that opens `<think>` for the model, as DeepSeek-R1's and Qwen3's thinking templates
do) or by the model writing the start marker first.

Constraints (tools, response formats) apply to the answer only: the constraint carries the end
marker's token id and starts after it (scheduler/structured_output.py `after`), so the end marker
must be one token of the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_WHITESPACE = " \t\r\n"


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """How one model family marks its reasoning."""

    name: str
    start: str
    end: str
    # The reply is reasoning until the end marker even when neither the prompt nor the reply
    # opened the block (DeepSeek-R1's convention: its template opens it, older ones did not).
    always_opens: bool


PARSERS: dict[str, ReasoningFormat] = {
    "qwen3": ReasoningFormat("qwen3", "<think>", "</think>", always_opens=False),
    "deepseek_r1": ReasoningFormat("deepseek_r1", "<think>", "</think>", always_opens=True),
}


@dataclass(frozen=True, slots=True)
class Reasoning:
    """A reasoning format bound to a tokenizer: its markers' token ids."""

    fmt: ReasoningFormat
    start_id: int
    end_id: int

    @classmethod
    def of(cls, name: str, tokenizer: Any) -> Reasoning:
        """ValueError naming `reasoning_parser` unless both markers are single tokens."""
        if name not in PARSERS:
            raise ValueError(f"reasoning_parser: must be one of {sorted(PARSERS)}, got {name!r}")
        fmt = PARSERS[name]
        ids = [_single_token(tokenizer, marker) for marker in (fmt.start, fmt.end)]
        if None in ids:
            raise ValueError(
                f"reasoning_parser: {name} needs {fmt.start!r} and {fmt.end!r} to be single "
                "tokens of the model's vocabulary"
            )
        return cls(fmt, ids[0], ids[1])  # type: ignore[arg-type]

    def opened_by(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether the reply starts inside the block: the prompt leaves one open, or the format
        always opens it."""
        for token in reversed(prompt_token_ids):
            if token == self.end_id:
                break
            if token == self.start_id:
                return True
        return self.fmt.always_opens

    def splitter(self, prompt_token_ids: Sequence[int]) -> ReasoningSplitter:
        return ReasoningSplitter(self.fmt, self.opened_by(prompt_token_ids))

    def num_reasoning_tokens(self, output_token_ids: Sequence[int], opened: bool) -> int:
        """Output tokens up to and including the end marker (0 when the reply never reasoned)."""
        ids = list(output_token_ids)
        if not opened and not (ids and ids[0] == self.start_id):
            return 0
        return ids.index(self.end_id) + 1 if self.end_id in ids else len(ids)


def _single_token(tokenizer: Any, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


class ReasoningSplitter:
    """Splits one choice's text into (reasoning, content), whole or as it streams.

    Each piece of text is sent once: text that may still be the start of a marker is held back
    until the next delta or the end decides it.
    """

    def __init__(self, fmt: ReasoningFormat, opened: bool) -> None:
        self.fmt = fmt
        # "start": the start marker may still come (an opened block may repeat it);
        # "reasoning": inside the block; "content": after it, or without one.
        self.state = "start"
        self.opened = opened
        self._held = ""
        self._strip = False  # the whitespace after the end marker is not content

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) to send after `delta` more text."""
        text, self._held = self._held + delta, ""
        reasoning = ""
        if self.state == "start":
            past = self._past_start(text)
            if past is None:
                return "", ""
            text = past
        if self.state == "reasoning":
            end = text.find(self.fmt.end)
            if end < 0:
                keep = _partial_suffix(text, self.fmt.end)
                self._held = text[len(text) - keep :]
                return text[: len(text) - keep], ""
            reasoning, text = text[:end], text[end + len(self.fmt.end) :]
            self.state, self._strip = "content", True
        if self._strip:
            text = text.lstrip(_WHITESPACE)
            self._strip = not text
        return reasoning, text

    def _past_start(self, text: str) -> str | None:
        """The text after the start marker (all of it when the reply has none), the state set to
        where it stands; None: held back, since it may still become the marker."""
        stripped = text.lstrip(_WHITESPACE)
        if stripped.startswith(self.fmt.start):
            self.state, self.opened = "reasoning", True
            return stripped[len(self.fmt.start) :]
        if not stripped or self.fmt.start.startswith(stripped):
            self._held = text
            return None
        self.state = "reasoning" if self.opened else "content"
        return text

    def finish(self) -> tuple[str, str]:
        """What is held back, at the end of the reply."""
        held, self._held = self._held, ""
        if self.state == "reasoning" or (self.state == "start" and self.opened):
            return held, ""
        return "", held


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
