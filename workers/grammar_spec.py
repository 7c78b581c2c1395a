"""Speculation under a grammar: cut proposals the grammar rejects, mask each verify position.

A verify row samples k + 1 positions; position j must be sampled under the mask of the grammar's
state after the request's outputs and the first j proposed tokens, exactly as a plain decode step
would mask it there. Both functions here advance a *copy* of the request's matcher over the
proposal, so the matcher itself only ever consumes tokens the request keeps (it catches up on them
at the next mask, workers.structured): nothing is advanced past the accepted run, and there is
nothing to roll back. (llguidance's own `rollback` miscounts a token consumed once the grammar has
stopped, so a copy is the safe way to look ahead.)

Proposals are cut before the first token the grammar rejects: such a token is masked out of its
position's distribution, so it could never be accepted, and verifying it would only spend a slot.
"""

from __future__ import annotations

from typing import Any

import llguidance.torch
import torch


def grammar_prefix(matcher: Any, tokens: list[int], proposal: list[int]) -> int:
    """How many of `proposal`'s first tokens the grammar allows after `tokens`; `matcher` (a copy:
    it consumes `tokens`) stands before `tokens`. 0 when `tokens` themselves leave the grammar.
    The proposal is only checked (`validate_tokens`), never consumed: a rejected token would put
    the copy in an error state and log a parser warning for what is routine here."""
    if tokens and not matcher.consume_tokens(tokens):
        return 0
    return int(matcher.validate_tokens(proposal)) if proposal else 0


def fill_verify_masks(matcher: Any, drafts: list[int], bitmask: torch.Tensor, first: int) -> None:
    """Rows first .. first + len(drafts) of `bitmask`: row first + j the mask after drafts[:j].

    `matcher` stands after the request's outputs and is left there (the look-ahead runs on a
    copy). A draft the grammar rejects (proposals are cut before one, so only if the grammar
    changed its mind) is cleared from its own row, so it cannot be accepted, and the rows after it
    repeat that row: they are sampled but never kept."""
    llguidance.torch.fill_next_token_bitmask(matcher, bitmask, first)
    if not drafts:
        return
    ahead = matcher.deep_copy()
    for j, token in enumerate(drafts):
        if not ahead.consume_token(token):
            _clear(bitmask, first + j, token)
            bitmask[first + j + 1 : first + len(drafts) + 1] = bitmask[first + j]
            return
        llguidance.torch.fill_next_token_bitmask(ahead, bitmask, first + j + 1)


def _clear(bitmask: torch.Tensor, row: int, token: int) -> None:
    """Disallow one token in one row of an int32 bitmask (bit token % 32 of word token // 32)."""
    word = int(bitmask[row, token // 32]) & 0xFFFFFFFF
    word &= ~(1 << (token % 32)) & 0xFFFFFFFF
    bitmask[row, token // 32] = word - (1 << 32) if word >= 1 << 31 else word
