"""Verification of proposed tokens: sample the target at every proposed position, keep the run.

A verify row runs the request's last token and its k proposed tokens in one forward, which gives
the target's logits at k + 1 positions. Each position is sampled exactly as a plain decode step
would sample it there: position j sees the request's outputs followed by the first j proposed
tokens (penalties count them; a seeded request's noise is keyed by that output position), with
the same temperature, min-p, top-k, top-p and logit bias. The request keeps the samples up to and
including the first that differs from its proposal: every proposed token that matched, then one
of the target's own (a correction, or a bonus when all k matched).

Why this is exact: every kept token is the target's own sample at its position given the tokens
before it, so the output has the target's distribution, and a seeded request gets the very tokens
it gets without speculation. For a proposal that is a single token (a point mass, as n-gram
proposals and greedy drafts are), it is the rejection sampling of Leviathan et al. and Chen et
al.: the proposal t is accepted with probability p(t), and on rejection the token is drawn from p
with t removed and renormalised. (For a draft that samples from a spread distribution q, the
standard scheme accepts more often, sum min(p, q) against sum p q; both are exact.)
"""

from __future__ import annotations

from workers.sampler import SamplingState


def position_states(state: SamplingState, drafts: list[int]) -> list[SamplingState]:
    """The sampling state at each of the len(drafts) + 1 positions of a verify row: position j as
    if drafts[:j] had been appended to the request's outputs."""
    states = [state]
    penalised = state.has_penalties
    seen = state.seen_tokens() if penalised else None
    outputs = state.output_token_ids
    for j in range(1, len(drafts) + 1):
        at = SamplingState(
            state.params,
            state.prompt_token_ids,
            outputs + drafts[:j],
            state.generator,
            bans=state.bans,  # min_tokens and bad words, judged on these outputs
        )
        if seen is not None:  # count on from the request's own counts, not from scratch
            at.seen = dict(seen)
            for token in drafts[:j]:
                at.seen[token] = at.seen.get(token, 0) + 1
            at.num_counted = len(at.output_token_ids)
        states.append(at)
    return states


def accepted_run(samples: list[int], drafts: list[int]) -> list[int]:
    """The tokens a verify row emits: samples (len(drafts) + 1 of them) while they equal the
    drafts, then the first that does not (or the last, when all matched)."""
    for j, draft in enumerate(drafts):
        if samples[j] != draft:
            return samples[: j + 1]
    return samples[: len(drafts) + 1]
