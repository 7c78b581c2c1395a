"""Embeddings offline: LLM.embed pools the final hidden states of each prompt through the same
scheduler as generation (prefill-only requests)."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from tests.random_checkpoint import random_prompts


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    path, hf = tiny_checkpoint("llama")
    # A small token budget cuts the longer prompts into chunks: a mean is summed across them.
    with LLM(
        model=path,
        device="cpu",
        dtype="float32",
        load_progress=False,
        kv_cache_memory_gb=0.05,
        max_num_batched_tokens=32,
    ) as llm:
        yield llm, hf


PROMPTS = random_prompts(6, 1000, 3, 90, seed=7)


def _reference(hf, ids: list[int], pooling: str) -> torch.Tensor:
    with torch.no_grad():
        hidden = hf.model(torch.tensor([ids])).last_hidden_state[0]
    vector = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vector, dim=0)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_are_the_models_pooled_hidden_states_normalised(llama, pooling):
    llm, hf = llama
    vectors = llm.embed(PROMPTS, pooling=pooling)
    assert len(vectors) == len(PROMPTS)
    for ids, vector in zip(PROMPTS, vectors):
        got = torch.tensor(vector)
        assert got.norm().item() == pytest.approx(1.0, abs=1e-5)
        torch.testing.assert_close(got, _reference(hf, ids, pooling), atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_batched_embeddings_equal_one_at_a_time_and_repeat_exactly(llama, pooling):
    llm, _ = llama
    batched = llm.embed(PROMPTS, pooling=pooling)
    alone = [llm.embed([p], pooling=pooling)[0] for p in PROMPTS]
    torch.testing.assert_close(torch.tensor(batched), torch.tensor(alone), atol=1e-5, rtol=1e-5)
    assert llm.embed(PROMPTS, pooling=pooling) == batched  # deterministic


def test_mean_pooling_is_not_cut_short_by_the_prefix_cache(llama):
    llm, hf = llama
    prompt = PROMPTS[-1]
    llm.generate([prompt], use_tqdm=False)  # its blocks are now cached
    (vector,) = llm.embed([prompt], pooling="mean")
    torch.testing.assert_close(
        torch.tensor(vector), _reference(hf, prompt, "mean"), atol=2e-4, rtol=1e-3
    )


def test_a_bad_pooling_is_refused_naming_it():
    from scheduler.sampling_params import SamplingParams

    with pytest.raises(ValueError, match="^pooling:"):
        SamplingParams(max_tokens=1, pooling="max")
    with pytest.raises(ValueError, match="^pooling:"):
        SamplingParams(max_tokens=2, pooling="mean")
