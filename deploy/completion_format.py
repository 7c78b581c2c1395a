"""The completion format: `text_completion`, whole or streamed, with what each choice shows of
its prompt (the echoed text, the prompt's log-probabilities)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deploy.choices_format import ChoicesFormat
from deploy.engine_requests import Generation
from deploy.generation import ChoiceDelta
from deploy.logprobs import completion_logprobs, prompt_logprobs_json


@dataclass(slots=True)
class PromptSide:
    """What a response shows of each choice's prompt: its echoed text, its log-probabilities."""

    prefixes: list[str] | None = None  # echo: the text each choice begins with
    first_tokens: list[int] = field(default_factory=list)  # each choice's first prompt token
    echo_logprobs: int | None = None  # echo with logprobs: alternatives shown per position
    prompt_logprobs: bool = False  # a `prompt_logprobs` list per choice


class CompletionFormat(ChoicesFormat):
    """A completion's reply; an echoed prompt leads its choice's text (and, with logprobs, its
    log-probabilities)."""

    CHUNK_OBJECT = "text_completion"
    WHOLE_OBJECT = "text_completion"

    def __init__(self, gen: Generation, side: PromptSide) -> None:
        super().__init__(gen, side.prefixes)
        self.side = side
        self.unechoed = set(range(len(side.prefixes))) if side.prefixes is not None else set()

    def _chunk_choice(self, d: ChoiceDelta) -> dict[str, Any] | None:
        lp = completion_logprobs(d.logprobs, self.texts) if d.logprobs else None
        text = d.text
        if d.index in self.unechoed and self.side.prefixes is not None:  # the echo goes first
            self.unechoed.discard(d.index)
            text = self.side.prefixes[d.index] + text
        if not (text or lp or d.finish_reason is not None):
            return None
        return {"index": d.index, "text": text, "logprobs": lp, "finish_reason": d.finish_reason}

    def _collected(self) -> None:
        k = self.side.echo_logprobs
        if k is None:
            return
        c = self.collected  # the prompt's entries lead each choice's logprobs
        c.logprobs = [[e[: k + 1] for e in p] + g for p, g in zip(c.prompt_logprobs, c.logprobs)]

    def _whole_choices(self, head: dict[str, Any]) -> tuple[list[dict[str, Any]], list]:
        c, side = self.collected, self.side
        echo_first = side.first_tokens if side.echo_logprobs is not None else None
        choices, logprobs = [], []
        for i, text in enumerate(c.texts):
            choice: dict[str, Any] = {"index": i, "text": text, "finish_reason": c.finish[i]}
            if side.prompt_logprobs:
                choice["prompt_logprobs"] = prompt_logprobs_json(c.prompt_logprobs[i], self.texts)
            choices.append(choice)
            first = echo_first[i] if echo_first is not None else None
            asked = c.logprobs[i] or first is not None
            logprobs.append(
                completion_logprobs(c.logprobs[i], self.texts, first) if asked else None
            )
        return choices, logprobs
