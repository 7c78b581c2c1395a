"""Verification of proposed tokens on synthetic logits: the target's distribution exactly (a
chi-square test that also catches a biased verifier), and a seeded request's very tokens.

The verify path is the one the runner takes: spec_verify.position_states for a row's positions,
one Sampler.sample over all of them, spec_verify.accepted_run to keep the run.
"""

from __future__ import annotations

import random

import pytest
import torch

from scheduler.sampling_params import SamplingParams
from workers.sampler import Sampler, SamplingState
from workers.spec_verify import accepted_run, position_states

VOCAB = 8
# Chi-square critical values at significance 0.001: a correct verifier fails one run in 1,000.
CHI2_CRITICAL_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}
SAMPLES = 3000


def state(prompt: list[int] | None = None, outputs: list[int] | None = None, **params):
    return SamplingState.create(
        SamplingParams(max_tokens=100, **params), prompt or [3], torch.device("cpu"), outputs
    )


def verify(logits: torch.Tensor, st: SamplingState, drafts: list[int]) -> list[int]:
    """The tokens a verify row of drafts emits, given the target's logits at its k + 1 positions."""
    return verify_many(logits, [st], drafts)[0]


def verify_many(
    logits: torch.Tensor, sts: list[SamplingState], drafts: list[int]
) -> list[list[int]]:
    """verify for many requests with the same logits, as one batch (as the runner batches rows)."""
    states = [at for st in sts for at in position_states(st, drafts)]
    tokens = Sampler().sample(logits.repeat(len(sts), 1), states).token_ids
    width = len(drafts) + 1
    return [accepted_run(tokens[i * width : (i + 1) * width], drafts) for i in range(len(sts))]


def chi_square(counts: list[int], probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the categories with positive probability, and its degrees of
    freedom."""
    n = sum(counts)
    stat, cells = 0.0, 0
    for count, p in zip(counts, probs.tolist()):
        if p > 0:
            expected = n * p
            stat += (count - expected) ** 2 / expected
            cells += 1
        else:
            assert count == 0, "a token of probability 0 was emitted"
    return stat, cells - 1


LOGITS = torch.tensor(
    [
        [1.0, 0.2, -0.5, 0.7, 0.0, -1.0, 0.3, 0.5],
        [0.1, 1.2, 0.4, -0.3, 0.8, 0.0, -0.7, 0.2],
        [0.5, -0.2, 0.9, 0.1, -0.4, 0.6, 0.0, 0.3],
    ]
)


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=1.3, top_k=5, min_p=0.05),
    ],
)
def test_first_token_has_the_target_distribution(params):
    """Chi-square at significance 0.001 over 3,000 seeds; the draft is the target's third-likeliest
    token, so acceptances and rejections both happen often."""
    target = _target_probs(LOGITS[0], params)
    draft = int(target.argsort(descending=True)[2])
    counts = [0] * VOCAB
    accepted = 0
    for out in verify_many(
        LOGITS, [state(seed=seed, **params) for seed in range(SAMPLES)], [draft, 1]
    ):
        counts[out[0]] += 1
        accepted += out[0] == draft
    stat, dof = chi_square(counts, target)
    assert stat < CHI2_CRITICAL_001[dof], (stat, counts)
    assert accepted > 0 and accepted < SAMPLES


def test_second_token_given_an_accepted_first_has_the_target_distribution():
    params = dict(temperature=1.0, presence_penalty=0.8)  # position 1 must see the first draft
    first = 0
    counts = [0] * VOCAB
    for out in verify_many(
        LOGITS, [state(seed=seed, **params) for seed in range(SAMPLES)], [first, 1]
    ):
        if out[0] == first:
            counts[out[1]] += 1
    penalised = LOGITS[1].clone()
    penalised[first] -= 0.8
    stat, dof = chi_square(counts, penalised.softmax(-1))
    assert stat < CHI2_CRITICAL_001[dof], (stat, counts)


def test_the_chi_square_check_catches_a_biased_verifier():
    """A verifier that accepts the draft with probability p(t) but on rejection draws from the whole
    of p (t included) over-weights t: the same test must reject it."""
    target = LOGITS[0].softmax(-1)
    draft = int(target.argsort(descending=True)[2])
    rng = random.Random(0)
    counts = [0] * VOCAB
    for _ in range(SAMPLES):
        if rng.random() < float(target[draft]):
            token = draft
        else:
            token = rng.choices(range(VOCAB), weights=target.tolist())[0]
        counts[token] += 1
    stat, dof = chi_square(counts, target)
    assert stat > CHI2_CRITICAL_001[dof]


def _target_probs(logits: torch.Tensor, params: dict) -> torch.Tensor:
    """What the sampler draws from at one position, computed by hand."""
    t = params.get("temperature", 1.0)
    probs = (logits / t).softmax(-1)
    keep = torch.ones(VOCAB, dtype=torch.bool)
    if params.get("min_p"):
        keep &= probs >= params["min_p"] * probs.max()
    if params.get("top_k"):
        keep &= torch.zeros(VOCAB, dtype=torch.bool).index_fill(
            0, probs.masked_fill(~keep, -1).topk(params["top_k"]).indices, True
        )
    if params.get("top_p"):
        order = probs.masked_fill(~keep, 0).argsort(descending=True)
        p = probs.masked_fill(~keep, 0)[order]
        before = (p / p.sum()).cumsum(0) - p / p.sum()
        nucleus = torch.zeros(VOCAB, dtype=torch.bool)
        nucleus[order[before < params["top_p"]]] = True
        keep &= nucleus
    probs = probs.masked_fill(~keep, 0)
    return probs / probs.sum()


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.0),
        dict(temperature=0.0, repetition_penalty=1.5),
        dict(temperature=0.9, seed=11, frequency_penalty=0.5, top_p=0.95),
        dict(temperature=1.2, seed=5, top_k=4, logit_bias={2: 1.5}),
    ],
)
def test_verify_emits_the_tokens_plain_decoding_samples(params):
    """Sampled one position at a time (as without speculation) or verified in one row, with right
    and wrong proposals: the same tokens, since draws are keyed by output position and penalties
    see the proposed tokens before each position."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, VOCAB, generator=gen) * 2
    plain = state([1, 2], [4], **params)
    want = []
    for row in logits:
        token = Sampler().sample(row[None], [plain]).token_ids[0]
        plain.output_token_ids.append(token)
        want.append(token)
    for drafts in (want[:5], want[:2] + [(want[2] + 1) % VOCAB, 0, 0], [(want[0] + 3) % VOCAB]):
        got = verify(logits[: len(drafts) + 1], state([1, 2], [4], **params), drafts)
        kept = len(accepted_run(want, drafts))
        assert got == want[:kept]


def test_accepted_run_keeps_matches_then_the_targets_own_token():
    assert accepted_run([5, 6, 7], [5, 6]) == [5, 6, 7]  # all accepted, one bonus
    assert accepted_run([5, 9, 7], [5, 6]) == [5, 9]  # correction at the first mismatch
    assert accepted_run([4, 6, 7], [5, 6]) == [4]
    assert accepted_run([4], []) == [4]


def test_position_states_count_the_drafts_for_penalties_and_seeds():
    base = state([1], [2, 2], temperature=1.0, seed=3, frequency_penalty=1.0)
    states = position_states(base, [2, 5])
    assert [len(s.output_token_ids) for s in states] == [2, 3, 4]
    assert states[2].seen_tokens() == {2: 3, 5: 1}
    assert base.output_token_ids == [2, 2]  # the request's own state is untouched


def test_min_tokens_and_bad_words_hold_at_every_proposed_position():
    """Each position bans what a plain decode would ban there: the stop token 7 before min_tokens
    outputs, and the bad word [4, 9]'s 9 after a 4."""
    base = state(temperature=0.0, min_tokens=4, stop_token_ids=[7], bad_words_token_ids=[[4, 9]])
    logits = torch.zeros(3, 10)
    logits[:, 7] = 3.0  # every position's argmax, banned throughout
    logits[0, 9], logits[1, 4], logits[2, 9], logits[2, 3] = 2.0, 2.0, 2.0, 1.0
    assert all(s.bans is base.bans for s in position_states(base, [9, 4]))
    # position 1 (after 9) takes 4, not 7; position 2 (after 9, 4) bans 7 and 9, takes 3
    assert verify(logits, base, [9, 4]) == [9, 4, 3]
    assert verify(logits, base, [9, 9]) == [9, 4]
