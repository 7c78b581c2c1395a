"""Tokens a request may not sample next: its stop ids before min_tokens, and banned words.

A banned word is one or more token sequences (bad_words_token_ids). Only a sequence's last token is
ever masked, and only where the outputs already end with the rest of it: the word cannot complete,
while its first tokens stay free for other words that share them (vLLM's bad_words rule).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from scheduler.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class Bans:
    """One request's banning rules, built once when its sampling state is."""

    min_tokens: int
    until_min_tokens: tuple[int, ...]  # EOS (unless ignore_eos) and the stop ids
    always: tuple[int, ...]  # one-token banned words
    after: tuple[tuple[tuple[int, ...], int], ...]  # (prefix, last token) of longer ones

    @classmethod
    def of(cls, params: SamplingParams, eos_token_ids: Sequence[int]) -> Bans | None:
        """The rules of params, or None when it bans nothing (most requests)."""
        if not params.min_tokens and not params.bad_words_token_ids:
            return None
        stops = list(params.stop_token_ids)
        if not params.ignore_eos:
            stops += list(eos_token_ids)
        seqs = params.bad_words_token_ids
        return cls(
            params.min_tokens,
            tuple(sorted(set(stops))),
            tuple(sorted({s[0] for s in seqs if len(s) == 1})),
            tuple((tuple(s[:-1]), s[-1]) for s in seqs if len(s) > 1),
        )

    def banned(self, outputs: Sequence[int]) -> list[int]:
        """The ids masked for the next token after `outputs`."""
        ids = list(self.always)
        if len(outputs) < self.min_tokens:
            ids += self.until_min_tokens
        n = len(outputs)
        for prefix, last in self.after:
            k = len(prefix)
            if k <= n and tuple(outputs[n - k :]) == prefix:
                ids.append(last)
        return ids


def apply_bans(logits: torch.Tensor, rows: list[tuple[Bans | None, Sequence[int]]]) -> torch.Tensor:
    """-inf at every banned (row, token) of the batch, in one index_put. Out of place."""
    index_rows: list[int] = []
    index_cols: list[int] = []
    for row, (bans, outputs) in enumerate(rows):
        if bans is not None:
            ids = bans.banned(outputs)
            index_rows += [row] * len(ids)
            index_cols += ids
    if not index_rows:
        return logits
    device = logits.device
    index = (torch.tensor(index_rows, device=device), torch.tensor(index_cols, device=device))
    return logits.index_put(index, torch.tensor(float("-inf"), device=device))
