"""Top-k and top-p (nucleus) filtering without sorting the whole vocabulary.

Sorting a 49,152-token row costs milliseconds on a CPU, more than a quantized decode step's sampler
should; the tokens a filter keeps are almost always a few hundred of the best. So each row first
takes its `size` best tokens (`topk`), orders only those, and decides there; a row whose decision
needs tokens past them tries the next size, and the full sort is the last resort.

Exactness: the candidates hold every token whose logit is above the size-th best, so their order
(logit descending, ties by token id) is the full sort's order over those ranks ("certain" ranks);
tokens tied with the size-th best may be any of the ties, so a decision that reaches them is not
taken there. The probabilities summed for top-p come from one softmax of the whole row in token
order (after top-k), whichever path ranks them, and the cumulative sum runs best-first over the
same values: a row decided among candidates keeps exactly the tokens the full sort keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Candidate set sizes tried in turn. 256 holds the nucleus of most sampled steps (SmolLM2-135M
# chat at temperature 1, top-p 0.95: median 52 tokens, p90 747, max 1,992 of 49,152); 4,096 almost
# all of the rest. topk of either over the whole row costs a small fraction of a full sort.
CANDIDATE_SIZES = (256, 4096)


@dataclass(slots=True)
class Ranked:
    """Each row's best tokens, best first (ties by token id): the first `certain` ranks are the
    full sort's own."""

    values: torch.Tensor  # [B, size] logits, descending
    ids: torch.Tensor  # [B, size] their token ids
    certain: torch.Tensor  # [B] ranks known to be the full sort's


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    sizes: tuple[int, ...] = CANDIDATE_SIZES,
) -> torch.Tensor:
    """Keep each row's k best tokens (k >= vocab: all), then the smallest best-first set whose
    probability reaches top_p (top_p > 1: all); the rest become -inf. Ties are broken by token
    id. Out of place; `sizes` are the candidate sets tried before the full sort."""
    vocab = logits.shape[-1]
    out = logits.clone()
    pending = ((top_k < vocab) | (top_p <= 1.0)).nonzero().flatten()  # rows that filter at all
    for size in (s for s in sizes if s < vocab):
        if not pending.numel():
            return out
        rows = logits[pending]
        kept, settled = _filter(rows, _candidates(rows, size), top_k[pending], top_p[pending])
        out[pending[settled]] = kept[settled]
        pending = pending[~settled]
    if pending.numel():
        rows = logits[pending]
        out[pending] = _filter(rows, _sorted(rows), top_k[pending], top_p[pending])[0]
    return out


def _candidates(rows: torch.Tensor, size: int) -> Ranked:
    """The `size` best tokens of each row, ordered as the full sort orders them."""
    values, ids = rows.topk(size, dim=-1)
    ids, by_id = ids.sort(dim=-1)  # topk leaves ties in any order: put them by token id first
    values, order = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, order)
    return Ranked(values, ids, (values > values[:, -1:]).sum(dim=-1))


def _sorted(rows: torch.Tensor) -> Ranked:
    values, ids = rows.sort(dim=-1, descending=True, stable=True)
    return Ranked(values, ids, torch.full_like(ids[:, 0], rows.shape[-1]))


def _filter(
    rows: torch.Tensor, ranked: Ranked, top_k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows filtered from their ranked tokens, and which rows that decided exactly: those whose
    kept tokens are all certain ranks and whose top-p cut (if any) fell on a certain rank."""
    size = ranked.values.shape[-1]
    rank = torch.arange(size, device=rows.device)
    in_k = rank < top_k[:, None]
    probs = _top_k_rows(rows, ranked, in_k, top_k).softmax(dim=-1).gather(1, ranked.ids)
    reached = (probs.cumsum(dim=-1) - probs) >= top_p[:, None]  # mass before the rank
    # The first rank whose mass before reaches p, and everything after it, is dropped.
    cut = torch.where(reached.any(dim=-1), reached.int().argmax(dim=-1), size)
    keep = torch.minimum(cut, top_k.clamp_max(size))
    # A k beyond the certain ranks leaves the k best unknown, and the mass measured with them.
    settled = (top_k <= ranked.certain) | ((top_k >= rows.shape[-1]) & (cut <= ranked.certain))
    values = ranked.values.masked_fill(rank >= keep[:, None], float("-inf"))
    kept = torch.full_like(rows, float("-inf")).scatter_(1, ranked.ids, values)
    return kept, settled


def _top_k_rows(
    rows: torch.Tensor, ranked: Ranked, in_k: torch.Tensor, top_k: torch.Tensor
) -> torch.Tensor:
    """Each row with only its k best tokens (all of them when k >= vocab), in token order: the
    distribution top-p measures."""
    vocab = rows.shape[-1]
    if not bool((top_k < vocab).any()):
        return rows
    values = ranked.values.masked_fill(~in_k, float("-inf"))
    only_k = torch.full_like(rows, float("-inf")).scatter_(1, ranked.ids, values)
    return torch.where((top_k < vocab)[:, None], only_k, rows)
