"""The sampler, specified on logits built by hand: each knob does what its definition says."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.sampling_params import SamplingParams
from workers.sampler import Sampler, SamplingState, apply_min_p, apply_penalties, apply_top_k_top_p

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# Four tokens with probabilities 0.5, 0.3, 0.15, 0.05 at temperature 1.
PROBS = [0.5, 0.3, 0.15, 0.05]
LOGITS = [math.log(p) for p in PROBS]
DRAWS = 4000  # rows per batched draw; a frequency's standard error is then below 0.008

# No subnormals: dividing one by the temperature can round it to zero, which makes it tie with a
# real 0.0 logit at the k-th place (ties are kept), a float artefact rather than a top-k rule.
logits_rows = st.lists(
    st.floats(-10.0, 10.0, allow_nan=False, allow_subnormal=False, width=32),
    min_size=2,
    max_size=30,
)


def make_state(device: str = "cpu", prompt: list[int] | None = None, **params) -> SamplingState:
    return SamplingState.create(SamplingParams(**params), prompt or [], torch.device(device))


def draw(row: list[float], n: int = DRAWS, device: str = "cpu", **params) -> torch.Tensor:
    """Sample one row n times in a single batch; returns the n token ids."""
    logits = torch.tensor([row], device=device).expand(n, -1)
    states = [make_state(device, **params) for _ in range(n)]
    return torch.tensor(Sampler().sample(logits, states).token_ids)


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / len(tokens)


def kept(masked_row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(masked_row).nonzero().flatten().tolist())


@pytest.fixture(autouse=True)
def _fixed_global_seed():
    torch.manual_seed(0)


def test_create_gives_a_generator_only_to_seeded_requests():
    assert make_state(seed=3).generator is not None
    assert make_state().generator is None


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_picks_the_argmax_of_each_row(device):
    logits = torch.randn(6, 50, device=device)
    out = Sampler().sample(logits, [make_state(device, temperature=0.0, seed=i) for i in range(6)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None


def test_greedy_applies_penalties_before_the_argmax():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    repeated = make_state(temperature=0.0, presence_penalty=0.5)
    repeated.output_token_ids = [0]
    in_prompt = make_state(prompt=[0], temperature=0.0, repetition_penalty=2.0)
    assert Sampler().sample(logits.expand(2, -1), [repeated, in_prompt]).token_ids == [1, 1]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_samples_softmax_of_scaled_logits(temperature):
    expected = torch.tensor(LOGITS, dtype=torch.float64).div(temperature).softmax(-1)
    observed = frequencies(draw(LOGITS, temperature=temperature), len(LOGITS))
    torch.testing.assert_close(observed, expected, atol=0.03, rtol=0)


def test_lower_temperature_sharpens_and_higher_flattens():
    top_share = {t: frequencies(draw(LOGITS, temperature=t), 4)[0].item() for t in (0.3, 1.0, 2.0)}
    assert top_share[0.3] > PROBS[0] + 0.1
    assert abs(top_share[1.0] - PROBS[0]) < 0.03
    assert top_share[2.0] < PROBS[0] - 0.08  # 0.38 expected at temperature 2


@settings(max_examples=60, deadline=None)
@given(row=logits_rows, data=st.data())
def test_top_k_keeps_exactly_the_k_best(row, data):
    k = data.draw(st.integers(1, len(row)))
    masked = apply_top_k_top_p(torch.tensor([row]), torch.tensor([k]), torch.tensor([2.0]))[0]
    survivors = kept(masked)
    assert len(survivors) == k
    dropped = set(range(len(row))) - survivors
    assert all(row[i] >= row[j] for i in survivors for j in dropped)
    assert all(masked[i].item() == row[i] for i in survivors)


@settings(max_examples=30, deadline=None)
@given(row=logits_rows, data=st.data())
def test_top_k_never_samples_outside_the_k_best(row, data):
    k = data.draw(st.integers(1, len(row)))
    kth_best = sorted(row, reverse=True)[k - 1]
    tokens = draw(row, n=200, top_k=k, temperature=data.draw(st.floats(0.1, 2.0)))
    assert all(row[t] >= kth_best for t in tokens.tolist())


def test_top_k_samples_the_renormalised_k_best():
    tokens = draw(LOGITS, top_k=2)
    expected = torch.tensor([0.5, 0.3, 0.0, 0.0], dtype=torch.float64) / 0.8
    torch.testing.assert_close(frequencies(tokens, 4), expected, atol=0.03, rtol=0)


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.4, {0}),
        (0.75, {0, 1}),
        (0.85, {0, 1, 2}),
        (0.99, {0, 1, 2, 3}),
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, expected):
    masked = apply_top_k_top_p(torch.tensor([LOGITS]), torch.tensor([4]), torch.tensor([top_p]))[0]
    assert kept(masked) == expected
    assert set(draw(LOGITS, top_p=top_p).tolist()) == expected


@settings(max_examples=60, deadline=None)
@given(row=logits_rows, top_p=st.floats(0.05, 0.99))
def test_top_p_support_is_minimal(row, top_p):
    masked = apply_top_k_top_p(
        torch.tensor([row]), torch.tensor([len(row)]), torch.tensor([top_p])
    )[0]
    probs = torch.tensor(row, dtype=torch.float64).softmax(-1)
    survivors = sorted(kept(masked), key=lambda i: probs[i].item())
    mass = sum(probs[i].item() for i in survivors)
    assert mass >= top_p - 1e-5  # reaches p
    # ... and would not without its least likely token.
    assert mass - probs[survivors[0]].item() < top_p + 1e-5
    assert all(
        probs[j] <= probs[survivors[0]] + 1e-7 for j in set(range(len(row))) - set(survivors)
    )


def test_top_p_samples_the_renormalised_nucleus():
    expected = torch.tensor([0.5, 0.3, 0.0, 0.0], dtype=torch.float64) / 0.8
    torch.testing.assert_close(
        frequencies(draw(LOGITS, top_p=0.75), 4), expected, atol=0.03, rtol=0
    )


@pytest.mark.parametrize(
    ("min_p", "expected"),
    [
        (0.0, {0, 1, 2, 3}),
        (0.2, {0, 1, 2}),
        (0.5, {0, 1}),
        (1.0, {0}),
    ],
)
def test_min_p_drops_tokens_below_min_p_times_the_top_probability(min_p, expected):
    # Thresholds: 0.2 * 0.5 = 0.1 drops 0.05; 0.5 * 0.5 = 0.25 also drops 0.15.
    masked = apply_min_p(torch.tensor([LOGITS]), torch.tensor([min_p]))[0]
    assert kept(masked) == expected
    assert set(draw(LOGITS, min_p=min_p).tolist()) == expected


def test_min_p_is_relative_to_the_tempered_distribution():
    # At temperature 2 the probabilities flatten, so 0.05 is no longer below 0.2 * p_max.
    assert set(draw(LOGITS, temperature=2.0, min_p=0.2).tolist()) == {0, 1, 2, 3}


def test_seen_tokens_follow_appended_outputs_incrementally():
    state = make_state(prompt=[5, 1, 5], repetition_penalty=1.2)
    assert state.seen_tokens() == {5: 0, 1: 0}  # prompt tokens enter with no output count
    state.output_token_ids.extend([1, 7])
    assert state.seen_tokens() == {5: 0, 1: 1, 7: 1}
    state.output_token_ids.append(7)
    assert state.seen_tokens() == {5: 0, 1: 1, 7: 2}
    state.output_token_ids = [9]  # replaced by a shorter list (a resumed history): recounted
    assert state.seen_tokens() == {5: 0, 1: 0, 9: 1}
    no_repetition = make_state(prompt=[5], presence_penalty=0.5)
    no_repetition.output_token_ids.append(3)
    assert no_repetition.seen_tokens() == {3: 1}  # presence/frequency ignore the prompt


def penalise(logits, seen: list[dict[int, int]], repetition, presence, frequency):
    rows = torch.tensor([r for r, d in enumerate(seen) for _ in d], dtype=torch.long)
    ids = torch.tensor([t for d in seen for t in d], dtype=torch.long)
    counts = torch.tensor([c for d in seen for c in d.values()], dtype=torch.float32)
    return apply_penalties(
        logits,
        rows,
        ids,
        counts,
        torch.tensor(repetition),
        torch.tensor(presence),
        torch.tensor(frequency),
    )


def test_penalties_follow_their_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -4.0]])
    seen = [{0: 0, 4: 0, 1: 2, 2: 1}]  # prompt tokens 0 and 4; outputs 1, 1, 2
    out = penalise(logits, seen, repetition=[2.0], presence=[0.5], frequency=[0.25])
    expected = [
        2.0 / 2,  # prompt token, positive: divided; presence/frequency ignore prompts
        -1.0 * 2 - 0.5 - 0.25 * 2,  # output token twice, negative: multiplied, then both penalties
        0.5 / 2 - 0.5 - 0.25 * 1,  # output token once
        3.0,  # never seen
        -4.0 * 2,  # prompt token, negative: multiplied
    ]
    torch.testing.assert_close(out[0], torch.tensor(expected))
    assert logits[0, 0].item() == 2.0  # out of place


def test_negative_presence_and_frequency_reward_repeats():
    out = penalise(torch.zeros(1, 3), [{2: 3}], [1.0], presence=[-1.0], frequency=[-0.5])
    assert out[0].tolist() == [0.0, 0.0, 2.5]


def test_sparse_penalties_equal_a_dense_pass_bitwise():
    """Touching only seen tokens gives exactly what the whole-vocabulary formula gives."""
    gen = torch.Generator().manual_seed(5)
    batch, vocab = 6, 300
    logits = torch.randn(batch, vocab, generator=gen) * 4
    prompt = torch.zeros(batch, vocab)
    output = torch.zeros(batch, vocab)
    seen = []
    for r in range(batch):
        for t in torch.randint(vocab, (40,), generator=gen).tolist():
            prompt[r, t] += 1
        for t in torch.randint(vocab, (25,), generator=gen).tolist():
            output[r, t] += 1
        seen.append(
            {t: int(output[r, t]) for t in (prompt[r] + output[r]).nonzero().flatten().tolist()}
        )
    repetition = torch.rand(batch, generator=gen) + 0.5
    presence, frequency = torch.randn(batch, generator=gen), torch.randn(batch, generator=gen)
    dense_penalty = torch.where((prompt + output) > 0, repetition[:, None], 1.0)
    dense = torch.where(logits > 0, logits / dense_penalty, logits * dense_penalty)
    dense = dense - frequency[:, None] * output - presence[:, None] * (output > 0)
    sparse = penalise(logits, seen, repetition.tolist(), presence.tolist(), frequency.tolist())
    assert torch.equal(sparse, dense)


def test_sampler_penalises_each_row_with_its_own_history():
    # Token 0 leads token 1 by 0.5; each row's own history decides whether a penalty overturns that.
    logits = torch.tensor([[1.0, 0.5, -5.0]]).expand(4, -1)
    frequency = make_state(temperature=0.0, frequency_penalty=0.3)
    frequency.output_token_ids = [0, 0]  # 1.0 - 0.6 < 0.5
    once = make_state(temperature=0.0, frequency_penalty=0.3)
    once.output_token_ids = [0]  # 1.0 - 0.3 > 0.5
    presence_prompt_only = make_state(prompt=[0, 0, 0], temperature=0.0, presence_penalty=2.0)
    repetition = make_state(prompt=[0], temperature=0.0, repetition_penalty=4.0)  # 1.0 / 4 < 0.5
    out = Sampler().sample(logits, [frequency, once, presence_prompt_only, repetition])
    assert out.token_ids == [1, 0, 0, 1]


def run_seeded(
    sampler: Sampler,
    logits: torch.Tensor,
    seed: int,
    steps: int,
    position: int,
    companions: list[SamplingState],
) -> list[int]:
    """Decode `steps` tokens for a seeded request sitting at `position` among `companions`."""
    state = make_state(str(logits.device), seed=seed, top_p=0.9, presence_penalty=0.3)
    for _ in range(steps):
        batch = companions[:position] + [state] + companions[position:]
        token = sampler.sample(logits.expand(len(batch), -1), batch).token_ids[position]
        state.output_token_ids.append(token)
    return state.output_token_ids


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_requests_reproduce_whatever_the_batch(device):
    sampler = Sampler()
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(1)).to(device)
    alone = run_seeded(sampler, logits, seed=42, steps=12, position=0, companions=[])
    torch.manual_seed(123)  # unseeded companions draw from the global generator; must not matter
    companions = [
        make_state(device),
        make_state(device, seed=7),
        make_state(device, temperature=0.0),
        make_state(device, seed=42, top_k=5),
        make_state(device, logprobs=2),
    ]
    crowded = run_seeded(sampler, logits, seed=42, steps=12, position=3, companions=companions)
    assert crowded == alone
    assert run_seeded(sampler, logits, seed=43, steps=12, position=0, companions=[]) != alone


def test_seeded_token_depends_on_how_many_tokens_came_before():
    logits = torch.zeros(1, 1000)
    state = make_state(seed=5)
    first = Sampler().sample(logits, [state]).token_ids[0]
    assert Sampler().sample(logits, [make_state(seed=5)]).token_ids[0] == first
    state.output_token_ids.append(first)
    assert Sampler().sample(logits, [state]).token_ids[0] != first


def test_a_resumed_seeded_request_continues_with_exactly_its_own_tokens():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(3))
    sampler = Sampler()
    whole = run_seeded(sampler, logits, seed=11, steps=10, position=0, companions=[])
    resumed = make_state(seed=11, top_p=0.9, presence_penalty=0.3)
    resumed.output_token_ids.extend(whole[:6])  # what another replica had emitted before it died
    for _ in range(4):
        resumed.output_token_ids.append(sampler.sample(logits, [resumed]).token_ids[0])
    assert resumed.output_token_ids == whole


def test_logprobs_are_sampled_first_then_top_n_of_the_raw_distribution():
    logits = torch.randn(3, 20)
    raw = logits.log_softmax(-1)
    states = [
        make_state(logprobs=3, temperature=0.7, presence_penalty=1.0),
        make_state(logprobs=0, temperature=0.0),
        make_state(),
    ]
    states[0].output_token_ids = [int(logits[0].argmax())]
    out = Sampler().sample(logits, states)
    assert out.logprobs is not None
    first, only_sampled, not_asked = out.logprobs
    token = out.token_ids[0]
    assert first[0] == (token, pytest.approx(raw[0, token].item()))
    top = raw[0].topk(3)
    assert [t for t, _ in first[1:]] == top.indices.tolist()
    assert [lp for _, lp in first[1:]] == pytest.approx(top.values.tolist())
    assert [lp for _, lp in first[1:]] == sorted((lp for _, lp in first[1:]), reverse=True)
    assert only_sampled == [(out.token_ids[1], pytest.approx(raw[1].max().item()))]
    assert not_asked is None


def test_logprobs_top_n_is_capped_at_the_vocabulary():
    out = Sampler().sample(torch.tensor([[0.0, 1.0]]), [make_state(temperature=0.0, logprobs=5)])
    assert out.logprobs is not None and len(out.logprobs[0]) == 3


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_of_greedy_random_and_seeded_rows(device):
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(2)).to(device)
    states = [
        make_state(device, temperature=0.0),
        make_state(device, top_k=3),
        make_state(device, seed=11, temperature=0.8),
        make_state(device, temperature=0.0, logprobs=1),
    ]
    out = Sampler().sample(logits, states)
    solo = Sampler().sample(logits[2:3], [make_state(device, seed=11, temperature=0.8)])
    assert out.token_ids[0] == logits[0].argmax().item()
    assert out.token_ids[1] in logits[1].topk(3).indices.tolist()
    assert out.token_ids[2] == solo.token_ids[0]
    assert out.token_ids[3] == logits[3].argmax().item()
    assert out.logprobs is not None and out.logprobs[:3] == [None, None, None]


def test_sampler_leaves_the_callers_logits_untouched():
    logits = torch.randn(2, 10)
    before = logits.clone()
    states = [
        make_state(repetition_penalty=1.5, prompt=[1, 2], min_p=0.1, top_k=4),
        make_state(top_p=0.5),
    ]
    Sampler().sample(logits, states)
    assert torch.equal(logits, before)


def test_empty_batch_and_shape_mismatch():
    assert Sampler().sample(torch.empty(0, 10), []).token_ids == []
    with pytest.raises(ValueError, match="logits"):
        Sampler().sample(torch.zeros(2, 10), [make_state()])


def test_logit_bias_moves_only_its_own_rows_tokens():
    from workers.sampler import Sampler, SamplingState

    logits = torch.zeros(3, 8)
    logits[:, 2] = 1.0  # every row's argmax is token 2 without a bias
    states = [
        SamplingState.create(
            SamplingParams(temperature=0, logit_bias=bias), [1], torch.device("cpu")
        )
        for bias in ({5: 100.0}, {}, {2: -100.0, 7: 0.5})
    ]
    assert Sampler().sample(logits, states).token_ids == [5, 2, 7]


def test_logit_bias_leaves_the_reported_logprobs_raw():
    from workers.sampler import Sampler, SamplingState

    logits = torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    state = SamplingState.create(
        SamplingParams(temperature=0, logprobs=0, logit_bias={3: 50.0}), [1], torch.device("cpu")
    )
    out = Sampler().sample(logits, [state])
    assert out.token_ids == [3]
    assert out.logprobs[0][0][1] == pytest.approx(torch.log_softmax(logits, -1)[0, 3].item())


def test_a_temperature_that_underflows_float32_is_greedy():
    # 1e-46 is 0 in float32: dividing by it would turn every logit into inf or NaN.
    row = [0.1, 2.0, -1.0, 1.5]
    assert set(draw(row, n=50, temperature=1e-46).tolist()) == {1}
