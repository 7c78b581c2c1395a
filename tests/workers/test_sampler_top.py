"""Top-k / top-p from candidate sets (workers/sampling_top.py): the same tokens kept, and with the
same generator the same tokens drawn, as sorting the whole vocabulary."""

from __future__ import annotations

from itertools import pairwise

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.sampling_params import SamplingParams
from workers.sampler import Sampler, SamplingState, apply_min_p
from workers.sampling_top import CANDIDATE_SIZES, apply_top_k_top_p

NEG_INF = float("-inf")
# A few values drawn often (ties, also across a candidate set's edge), any float, and -inf.
logit = st.one_of(
    st.sampled_from([0.0, 1.0, -1.0, 2.5, NEG_INF]),
    st.floats(-20.0, 20.0, allow_nan=False, allow_subnormal=False, width=32),
)
rows = st.lists(logit, min_size=2, max_size=48).filter(lambda r: any(v > NEG_INF for v in r))
top_p = st.one_of(st.sampled_from([1e-30, 1e-7, 0.5, 1.0, 2.0]), st.floats(0.0, 1.0))
sizes = st.lists(st.integers(1, 50), min_size=1, max_size=3).map(lambda s: tuple(sorted(s)))


def sorted_reference(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor):
    """The filter as it was before candidate sets (one stable sort of the whole row), kept here as
    the oracle: the mass of each rank from a softmax of the sorted row."""
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(logits.shape[-1])
    drop = rank >= top_k[:, None]
    probs = sorted_logits.masked_fill(drop, NEG_INF).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p[:, None]
    return torch.empty_like(logits).scatter_(1, order, sorted_logits.masked_fill(drop, NEG_INF))


def mass_before(row: torch.Tensor, k: int) -> dict[int, float]:
    """Token id -> the float64 probability of the tokens ranked above it among the k best."""
    values, order = row.double().sort(descending=True, stable=True)
    probs = values.masked_fill(torch.arange(len(row)) >= k, NEG_INF).softmax(-1)
    return dict(zip(order.tolist(), (probs.cumsum(-1) - probs).tolist()))


@settings(max_examples=80, deadline=None)
@given(batch=st.lists(rows, min_size=1, max_size=4), sizes=sizes, data=st.data())
def test_candidate_sets_keep_exactly_what_the_full_sort_keeps(batch, sizes, data):
    vocab = min(len(r) for r in batch)
    logits = torch.tensor([r[:vocab] for r in batch])
    ks = data.draw(st.lists(st.integers(1, vocab + 2), min_size=len(batch), max_size=len(batch)))
    ps = data.draw(st.lists(top_p, min_size=len(batch), max_size=len(batch)))
    top_k, p = torch.tensor(ks), torch.tensor(ps)
    fast = apply_top_k_top_p(logits, top_k, p, sizes)
    assert torch.equal(fast, apply_top_k_top_p(logits, top_k, p, sizes=()))
    assert torch.equal(fast, apply_top_k_top_p(logits, top_k, p))  # the default sizes


@settings(max_examples=100, deadline=None)
@given(row=rows, data=st.data())
def test_kept_tokens_are_the_sorted_filters_but_where_the_mass_rounds_onto_p(row, data):
    k = data.draw(st.integers(1, len(row) + 2))
    p = data.draw(top_p)
    args = (torch.tensor([row]), torch.tensor([k]), torch.tensor([p]))
    new, old = apply_top_k_top_p(*args, sizes=(3,))[0], sorted_reference(*args)[0]
    differ = (torch.isfinite(new) != torch.isfinite(old)).nonzero().flatten().tolist()
    before = mass_before(torch.tensor(row), k)
    # Both sum float32 probabilities, in different orders: a token may differ only when the
    # mass above it is p to within that rounding.
    assert all(abs(before[t] - p) < 1e-6 for t in differ), (differ, before, p)
    assert torch.equal(new[torch.isfinite(new)], torch.tensor(row)[torch.isfinite(new)])


def seeded(temperature: float, top_k: int, top_p: float, min_p: float, seed: int, outputs: int):
    state = SamplingState.create(
        SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed),
        [],
        torch.device("cpu"),
    )
    state.output_token_ids = list(range(outputs))  # the noise is keyed by output position
    return state


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    scale=st.sampled_from([0.5, 3.0, 12.0]),
    ties=st.booleans(),
    temperature=st.sampled_from([0.3, 1.0, 1.7]),
    top_k=st.sampled_from([0, 1, 7, 255, 256, 257, 700, 5000]),
    min_p=st.sampled_from([0.0, 0.02]),
    data=st.data(),
)
def test_a_seeded_draw_gives_the_tokens_of_the_full_sort(
    seed, scale, ties, temperature, top_k, min_p, data
):
    """600 tokens: past the first candidate set (256), so both it and the full sort decide rows."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 600, generator=gen) * scale
    logits = logits.round() if ties else logits
    tempered = logits / torch.tensor([temperature] * 4)[:, None]  # as the sampler divides
    if min_p > 0.0:
        tempered = apply_min_p(tempered, torch.tensor([min_p] * 4))
    k = top_k if 0 < top_k < 600 else 600
    ps = [data.draw(p_between_masses(row, k)) for row in tempered]
    states = [seeded(temperature, top_k, p, min_p, seed + i, i) for i, p in enumerate(ps)]
    drawn = Sampler().sample(logits, states).token_ids
    p_arg = torch.tensor([p if p < 1.0 else 2.0 for p in ps])
    reference = sorted_reference(tempered, torch.tensor([k] * 4), p_arg)
    plain = [seeded(1.0, 0, 1.0, 0.0, seed + i, i) for i in range(4)]
    assert drawn == Sampler().sample(reference, plain).token_ids


def p_between_masses(row: torch.Tensor, k: int) -> st.SearchStrategy[float]:
    """top_p far from every rank's mass before it (no float rounding can move the cut), 1.0 or
    a tiny p: the cases where the sorted filter's own rounding cannot decide."""
    masses = sorted(set(mass_before(row, k).values()))
    gaps = [(a + b) / 2 for a, b in pairwise(masses) if b - a > 1e-4 and b < 0.999]
    return st.sampled_from(gaps + [1e-30, 1.0])


def test_a_nucleus_wider_than_every_candidate_set_is_cut_by_the_full_sort():
    """49,152 tokens: flat, top-p 0.4999 keeps 24,572 (the candidates hold only ties, so the
    full sort decides), lowest token ids first; 100 tokens a logit above the rest, top-p 0.001
    keeps 19 of them (mass 5.5e-5 each: 18 of them hold 0.00099), decided among the first
    candidates."""
    vocab = 49_152
    assert CANDIDATE_SIZES[-1] < 24_572
    flat = apply_top_k_top_p(torch.zeros(1, vocab), torch.tensor([vocab]), torch.tensor([0.4999]))
    assert torch.isfinite(flat[0]).nonzero().flatten().tolist() == list(range(24_572))
    logits = torch.zeros(1, vocab)
    logits[0, 1000:1100] = 1.0
    narrow = apply_top_k_top_p(logits, torch.tensor([vocab]), torch.tensor([0.001]))
    assert torch.isfinite(narrow[0]).nonzero().flatten().tolist() == list(range(1000, 1019))


def test_top_p_measures_mass_over_all_k_tokens_even_past_the_candidates():
    """Top-6 of these logits gives token 0 a mass of 0.634; the 3 candidates alone would give it
    0.665, and top-p 0.65 would then keep token 0 alone. Tokens 0 and 1 it is."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0]])
    kept = apply_top_k_top_p(logits, torch.tensor([6]), torch.tensor([0.65]), sizes=(3,))
    assert torch.isfinite(kept[0]).nonzero().flatten().tolist() == [0, 1]
