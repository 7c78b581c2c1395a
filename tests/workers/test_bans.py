"""min_tokens and bad_words in the sampler, on logits built by hand: EOS and stop ids cannot be
drawn before min_tokens outputs, and a banned word's last token is masked exactly where it would
complete the word."""

from __future__ import annotations

import pytest
import torch

from scheduler.sampling_params import SamplingParams
from workers.bans import Bans
from workers.sampler import Sampler, SamplingState

EOS = 0
VOCAB = 8


def _state(outputs: list[int], eos: tuple[int, ...] = (EOS,), **params) -> SamplingState:
    params.setdefault("max_tokens", 32)
    state = SamplingState.create(SamplingParams(**params), [5], torch.device("cpu"), None, eos)
    state.output_token_ids.extend(outputs)
    return state


def _favouring(token: int, runner_up: int) -> list[float]:
    """Logits whose argmax is `token`, then `runner_up`."""
    row = [0.0] * VOCAB
    row[token], row[runner_up] = 10.0, 5.0
    return row


def _greedy(row: list[float], state: SamplingState) -> int:
    return Sampler().sample(torch.tensor([row]), [state]).token_ids[0]


@pytest.mark.parametrize("seeded", [False, True])
def test_eos_and_stop_ids_are_masked_until_min_tokens(seeded):
    seed = {"seed": 3, "temperature": 1.0} if seeded else {"temperature": 0.0}
    eos_row, stop_row = _favouring(EOS, 4), _favouring(6, 4)
    for n in range(3):  # 3 outputs needed: EOS and the stop id 6 are masked before
        assert _greedy(eos_row, _state([1] * n, min_tokens=3, stop_token_ids=[6], **seed)) != EOS
        assert _greedy(stop_row, _state([1] * n, min_tokens=3, stop_token_ids=[6], **seed)) != 6
    assert _greedy(eos_row, _state([1] * 3, min_tokens=3, temperature=0.0)) == EOS
    assert _greedy(stop_row, _state([1] * 3, min_tokens=3, stop_token_ids=[6])) == 6


def test_min_tokens_leaves_eos_alone_under_ignore_eos_and_other_rows_untouched():
    bans = Bans.of(SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=[6]), [EOS])
    assert bans is not None and bans.until_min_tokens == (6,)
    rows = torch.tensor([_favouring(EOS, 4), _favouring(EOS, 4)])
    states = [_state([], min_tokens=2, temperature=0.0), _state([], temperature=0.0)]
    assert Sampler().sample(rows, states).token_ids == [4, EOS]


def test_a_banned_word_is_masked_only_where_it_would_complete():
    params = {"bad_words": ["x"], "bad_words_token_ids": [[2, 3], [7]], "temperature": 0.0}
    row = _favouring(3, 1)
    assert _greedy(row, _state([2], **params)) == 1  # 2 then 3 would complete [2, 3]
    assert _greedy(row, _state([4], **params)) == 3  # 3 alone is free
    assert _greedy(_favouring(7, 1), _state([], **params)) == 1  # a one-token word: always
    assert Bans.of(SamplingParams(), [EOS]) is None  # nothing to ban: no per-step work


def test_sampled_outputs_never_contain_a_banned_sequence():
    torch.manual_seed(0)
    params = {"bad_words": ["x"], "bad_words_token_ids": [[1, 2, 3], [4]], "temperature": 2.0}
    state = _state([], eos=(), **params)
    sampler = Sampler()
    for _ in range(400):
        token = sampler.sample(torch.zeros(1, VOCAB), [state]).token_ids[0]
        state.output_token_ids.append(token)
    text = ",".join(map(str, state.output_token_ids))
    assert "1,2,3" not in text and 4 not in state.output_token_ids
    assert "1,2" in text  # the prefix itself stays free


@pytest.mark.parametrize(
    "field, value",
    [
        ("min_tokens", -1),
        ("min_tokens", 2**64),
        ("min_tokens", 33),  # past max_tokens
        ("min_tokens", float("nan")),
        ("bad_words", ["a"] * 100_000),
        ("bad_words", ["a" * (10 << 20)]),
        ("bad_words", [""]),
        ("bad_words", [2**64]),
        ("bad_words_token_ids", [[-1]]),
        ("bad_words_token_ids", [[2**64]]),
        ("bad_words_token_ids", [[1] * 100_000]),
        ("truncate_prompt_tokens", -1),
        ("truncate_prompt_tokens", 0),
        ("truncate_prompt_tokens", 2**64),
        ("include_stop_str_in_output", float("nan")),
        ("skip_special_tokens", "no"),
        ("spaces_between_special_tokens", 2**64),
    ],
)
def test_bad_values_of_the_new_fields_name_their_field(field, value):
    with pytest.raises(ValueError) as err:
        SamplingParams(max_tokens=32, **{field: value})
    assert str(err.value).startswith(f"{field.removesuffix('_token_ids')}:")


def test_min_tokens_with_a_constraint_is_refused():
    from scheduler.structured_output import StructuredOutput

    with pytest.raises(ValueError, match="^min_tokens:"):
        SamplingParams(min_tokens=2, structured=StructuredOutput("regex", "a+", "guided_regex"))
