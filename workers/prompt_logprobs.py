"""The log-probabilities of a prompt's own tokens, from the prefill's hidden states.

Position p's hidden state predicts token p + 1: the entry of prompt token t (t >= 1) is its
log-probability under the model given tokens 0..t-1, then the top-k alternatives, in the shape of
a sampled token's logprobs. Logits are computed a slice of rows at a time, so a long prompt never
holds a [prompt, vocabulary] tensor. Every tensor-parallel rank calls this alike (the logits are
gathered to rank 0); the others get None.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from scheduler.outputs import TokenLogprobs

# Rows of logits at once: 256 x a 150k vocabulary in float32 is 150 MB.
ROWS_PER_SLICE = 256


def prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
    hidden: torch.Tensor,
    next_token_ids: list[int],
    top_k: int,
) -> list[TokenLogprobs] | None:
    """One entry per row of hidden: next_token_ids[i]'s log-probability, then the top_k best."""
    entries: list[TokenLogprobs] = []
    for lo in range(0, len(next_token_ids), ROWS_PER_SLICE):
        logits = compute_logits(hidden[lo : lo + ROWS_PER_SLICE])
        if logits is None:  # not rank 0: the gather went there
            continue
        logprobs = logits.float().log_softmax(dim=-1)
        ids = next_token_ids[lo : lo + ROWS_PER_SLICE]
        index = torch.tensor(ids, dtype=torch.long, device=logprobs.device)
        chosen = logprobs.gather(1, index[:, None]).squeeze(1).tolist()
        top_ids: list[list[int]] = [[] for _ in ids]
        top_values: list[list[float]] = [[] for _ in ids]
        if top_k:
            values, indices = logprobs.topk(min(top_k, logprobs.shape[-1]), dim=-1)
            top_values, top_ids = values.tolist(), indices.tolist()
        for token, value, alt_ids, alt_values in zip(ids, chosen, top_ids, top_values):
            entries.append([(token, value), *zip(alt_ids, alt_values)])
    return entries if entries or not next_token_ids else None
