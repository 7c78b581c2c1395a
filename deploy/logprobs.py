"""Logprobs as OpenAI's JSON, and the budget that bounds how many one request may ask for.

Each position's entry is `[(sampled id, logprob), (top id, logprob), ...]` (scheduler/outputs.py
`TokenLogprobs`). A token's text is decoded once per vocabulary (TokenTexts), not once per entry.
"""

from __future__ import annotations

import itertools
import json
import math
from typing import Any

from deploy.errors import BadRequestError
from scheduler.outputs import TokenLogprobs

# A response's per-position lists are encoded this many positions at a time: the encoder holds the
# interpreter while it runs, and a thread encoding a large response lets the event loop in between.
POSITIONS_PER_PIECE = 256
MIN_LOGPROB = -9999.0


class TokenTexts:
    """Each token's text as logprobs show it (`tokenizer.decode([id])`), decoded once."""

    __slots__ = ("_bytes", "_texts", "_tokenizer")

    def __init__(self, texts: list[str], tokenizer: Any) -> None:
        self._texts = texts
        self._bytes: dict[int, list[int]] = {}  # at most one list per id of the vocabulary
        self._tokenizer = tokenizer

    @classmethod
    def of(cls, tokenizer: Any, vocab_size: int = 0) -> TokenTexts:
        """Every id the model can sample: the tokenizer's, and the embedding's padding beyond."""
        ids = range(max(len(tokenizer), vocab_size))
        return cls([tokenizer.decode([i]) for i in ids], tokenizer)

    def text(self, token_id: int) -> str:
        if 0 <= token_id < len(self._texts):
            return self._texts[token_id]
        return self._tokenizer.decode([token_id])

    def utf8(self, token_id: int) -> list[int]:
        """The text's UTF-8 bytes, as chat logprobs list them."""
        found = self._bytes.get(token_id)
        if found is None:
            found = list(self.text(token_id).encode())
            if 0 <= token_id < len(self._texts):
                self._bytes[token_id] = found
        return found


def check_budget(entries: int, budget: int, param: str, max_tokens_param: str) -> None:
    """A 400 naming the fields when a request asks for more log-probabilities than `budget`."""
    if entries > budget:
        raise BadRequestError(
            f"{param}: n x {max_tokens_param} x ({param} + 1) asks for {entries} "
            f"log-probabilities, more than this server's {budget} per request (an unset "
            f"{max_tokens_param} counts the context left); lower n, {max_tokens_param} or {param}",
            param=param,
        )


def finite(logprob: float) -> float:
    """A logprob JSON can carry: an impossible token (-inf, or NaN from a broken row) reads as
    OpenAI's floor for "never", so no response fails to encode after its generation."""
    return logprob if math.isfinite(logprob) and logprob >= MIN_LOGPROB else MIN_LOGPROB


def num_entries(logprobs: list[TokenLogprobs]) -> int:
    """Log-probabilities in a list of positions (the sampled token's and the alternatives')."""
    return sum(len(entry) for entry in logprobs)


def chat_logprobs(logprobs: list[TokenLogprobs], texts: TokenTexts) -> dict[str, Any]:
    """`choices[i].logprobs` of a chat completion: `{"content": [...]}`."""
    content = []
    for entry in logprobs:
        (token_id, logprob), top = entry[0], entry[1:]
        content.append(
            {
                "token": texts.text(token_id),
                "logprob": finite(logprob),
                "bytes": texts.utf8(token_id),
                "top_logprobs": [
                    {"token": texts.text(t), "logprob": finite(v), "bytes": texts.utf8(t)}
                    for t, v in top
                ],
            }
        )
    return {"content": content}


def completion_logprobs(
    logprobs: list[TokenLogprobs], texts: TokenTexts, first_token: int | None = None
) -> dict[str, Any]:
    """`choices[i].logprobs` of a completion: tokens, their logprobs, top alternatives, offsets.

    first_token: an echoed prompt's first token, which nothing precedes: its logprob and
    alternatives are null (the entries of the prompt's other tokens lead `logprobs`)."""
    rows: list[tuple[str, float | None, dict[str, float] | None]] = []
    if first_token is not None:
        rows.append((texts.text(first_token), None, None))
    for entry in logprobs:
        (token_id, logprob), top = entry[0], entry[1:]
        alternatives = {texts.text(t): finite(v) for t, v in top}
        rows.append((texts.text(token_id), finite(logprob), alternatives))
    tokens = [token for token, _, _ in rows]
    return {
        "tokens": tokens,
        "token_logprobs": [logprob for _, logprob, _ in rows],
        "top_logprobs": [top for _, _, top in rows],
        # Each token's offset in the text: the lengths of the tokens before it.
        "text_offset": list(itertools.accumulate(map(len, tokens), initial=0))[:-1],
    }


def prompt_logprobs_json(
    entries: list[TokenLogprobs], texts: TokenTexts
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: null for the first prompt token, then per token a map from token
    id to `{logprob, rank, decoded_token}`: the prompt's token (its rank among the alternatives
    when it is one of them, else null) and the top alternatives (ranks 1, 2, ...)."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for entry in entries:
        (token_id, logprob), top = entry[0], entry[1:]
        ranks = {t: rank for rank, (t, _) in enumerate(top, 1)}
        position = {
            str(t): {"logprob": finite(v), "rank": rank, "decoded_token": texts.text(t)}
            for rank, (t, v) in enumerate(top, 1)
        }
        position[str(token_id)] = {
            "logprob": finite(logprob),
            "rank": ranks.get(token_id),
            "decoded_token": texts.text(token_id),
        }
        out.append(position)
    return out


def response_json(head: dict[str, Any], choices: list[dict[str, Any]], logprobs: list) -> bytes:
    """The response `{**head, "choices": [...]}` as JSON bytes (as JSONResponse encodes it),
    choice i with `logprobs[i]` (a dict of per-position lists, or None) encoded piece by piece."""
    encoded = [
        _json(choice)[:-1] + b',"logprobs":' + (_pieces(lp) if lp else b"null") + b"}"
        for choice, lp in zip(choices, logprobs, strict=True)
    ]
    return _json(head)[:-1] + b',"choices":[' + b",".join(encoded) + b"]}"


def _pieces(logprobs: dict[str, list]) -> bytes:
    fields = []
    for name, items in logprobs.items():
        pieces = [
            _json(items[i : i + POSITIONS_PER_PIECE])[1:-1]
            for i in range(0, len(items), POSITIONS_PER_PIECE)
        ]
        fields.append(_json(name) + b":[" + b",".join(pieces) + b"]")
    return b"{" + b",".join(fields) + b"}"


def _json(value: Any) -> bytes:
    return json.dumps(
        value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode()
