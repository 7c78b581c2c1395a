"""A constraint that starts after a token (a reasoning block's end): the output before that token
is sampled as without a constraint, the output after it obeys the constraint."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from scheduler.structured_output import StructuredOutput

MARK = 1234  # any ordinary token stands for the end-of-think marker


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama")
    with LLM(model=path, device="cpu", load_progress=False, kv_cache_memory_gb=0.05) as llm:
        yield llm


def _params(after: int | None, **kw) -> SamplingParams:
    choice = StructuredOutput.choice(["yes", "no"], "guided_choice")
    if after is not None:
        choice = StructuredOutput(choice.kind, choice.spec, choice.field_name, after=after)
    return SamplingParams(max_tokens=24, temperature=1.0, seed=3, structured=choice, **kw)


def test_the_output_is_free_until_the_marker_then_constrained(llm):
    prompt = [[5, 6, 7, 8]]
    free = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=1.0, seed=3), False)[0]
    waiting = llm.generate(prompt, _params(MARK), False)[0]
    assert MARK not in free.token_ids
    assert waiting.token_ids == free.token_ids  # the marker never came: never constrained
    # The marker forced first (a bias the mask later overrides), then the choice, then the end.
    marked = llm.generate(prompt, _params(MARK, logit_bias={MARK: 100.0}), False)[0]
    assert marked.token_ids[0] == MARK and marked.finish_reason == "stop"
    assert llm.frontend.decode(marked.token_ids[1:]) in ("yes", "no")
    direct = llm.generate(prompt, _params(None), False)[0]
    assert direct.text in ("yes", "no")


def test_after_must_be_a_token_id():
    for bad in (-1, True, "7", 1.5):
        with pytest.raises(ValueError, match="^guided_choice:"):
            StructuredOutput("choice", '["a"]', "guided_choice", after=bad)
