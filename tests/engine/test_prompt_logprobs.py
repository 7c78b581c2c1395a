"""prompt_logprobs offline, on the tiny model: each prompt token's entry is what generating that
token would have reported, however the prefill is chunked, and the entries come once."""

from __future__ import annotations

import math

import pytest

from engine.llm import LLM
from scheduler.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # loads a model

PROMPT = list(range(100, 140))  # 40 tokens: several chunks of 16


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    # Prefill chunks of 16 tokens: a prompt's entries come from several steps.
    with LLM(
        tiny_model_dir,
        device="cpu",
        load_progress=False,
        kv_cache_memory_gb=0.05,
        max_num_batched_tokens=16,
    ) as llm:
        yield llm


def test_prompt_entries_equal_the_logprobs_of_generating_those_tokens(llm):
    greedy = SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True)
    generated = llm.generate([PROMPT], greedy, use_tqdm=False)[0]
    asked = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3)
    out = llm.generate([PROMPT + generated.token_ids], asked, use_tqdm=False)[0]
    entries = out.prompt_logprobs
    assert entries is not None and entries[0] is None
    assert len(entries) == len(PROMPT) + len(generated.token_ids)
    assert [e[0][0] for e in entries[1:]] == (PROMPT + generated.token_ids)[1:]
    for want, got in zip(generated.logprobs, entries[len(PROMPT) :]):
        assert [t for t, _ in got] == [t for t, _ in want]
        assert all(math.isclose(a, b, abs_tol=1e-4) for (_, a), (_, b) in zip(got, want))


def test_a_cached_prompt_is_computed_again_for_its_entries(llm):
    whole = llm
    asked = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0)
    first, again = (whole.generate([PROMPT], asked, use_tqdm=False)[0] for _ in range(2))
    assert again.prompt_logprobs == first.prompt_logprobs and len(first.prompt_logprobs) == 40
    plain = whole.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None


@pytest.mark.parametrize("value", [-1, 21, 2**64, float("nan"), "1"])
def test_bad_prompt_logprobs_name_the_field(value):
    with pytest.raises(ValueError, match="^prompt_logprobs:"):
        SamplingParams(prompt_logprobs=value)
