"""Bulk work beside a decoding neighbour, on the tiny model: prompt logprobs and embeddings are
computed in the step's bounded share over many steps (scheduler/bulk_budget.py), the neighbour
decodes in every one of them, and the results equal those computed in one step alone."""

from __future__ import annotations

import math

import pytest

from engine.llm import LLM
from scheduler.bulk_budget import PROMPT_LOGPROB_ROW_COST, bulk_share
from scheduler.outputs import RequestOutput
from scheduler.request import EngineRequest
from scheduler.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # loads a model

BUDGET = 512
SHARE = bulk_share(BUDGET)
ROWS = SHARE // PROMPT_LOGPROB_ROW_COST  # prompt-logprob rows a step beside a neighbour
PROMPT = [100 + (i * 7) % 140 for i in range(200)]  # one step alone, 50 beside a neighbour


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with LLM(
        tiny_model_dir,
        device="cpu",
        load_progress=False,
        kv_cache_memory_gb=0.05,
        max_num_batched_tokens=BUDGET,
    ) as llm:
        yield llm


def run(llm: LLM, requests: list[EngineRequest], neighbour: bool) -> tuple[dict, int]:
    """Each request's final output and the steps they took; with a neighbour decoding (it must
    have decoded in each of those steps)."""
    engine = llm.engine
    if neighbour:
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        engine.add_request(EngineRequest("neighbour", [7, 8, 9], params))
        engine.step()
    for r in requests:
        engine.add_request(r)
    done: dict[str, RequestOutput] = {}
    steps = 0
    while len(done) < len(requests):
        outputs = {o.request_id: o for o in engine.step()}
        steps += 1
        if neighbour:
            assert len(outputs["neighbour"].new_token_ids) == 1  # it decoded in this step
        done.update({rid: o for rid, o in outputs.items() if o.finished and rid != "neighbour"})
    if neighbour:
        engine.abort_requests(["neighbour"])
    return done, steps


def scored(rid: str) -> EngineRequest:
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=5)
    return EngineRequest(rid, PROMPT, params)


def test_prompt_logprobs_in_chunks_equal_those_of_one_step(llm):
    alone, alone_steps = run(llm, [scored("alone")], neighbour=False)
    beside, beside_steps = run(llm, [scored("beside")], neighbour=True)
    assert alone_steps == 1
    assert beside_steps == -(-len(PROMPT) // ROWS)  # the share each step
    want, got = alone["alone"].prompt_logprobs, beside["beside"].prompt_logprobs
    assert want is not None and got is not None and len(got) == len(want) == len(PROMPT) - 1
    for w, g in zip(want, got):
        assert [t for t, _ in g] == [t for t, _ in w]
        assert all(math.isclose(a, b, abs_tol=1e-4) for (_, a), (_, b) in zip(g, w))


def embedding(rid: str, shift: int) -> EngineRequest:
    prompt = [100 + (i * 11 + shift) % 140 for i in range(180)]
    return EngineRequest(rid, prompt, SamplingParams(max_tokens=1, temperature=0, pooling="mean"))


def test_an_embeddings_request_larger_than_the_budget_runs_over_steps_with_the_same_vectors(llm):
    # Four inputs of 180 tokens: 720 tokens, more than one step's budget of 512.
    alone, alone_steps = run(llm, [embedding(f"a{i}", i) for i in range(4)], neighbour=False)
    beside, beside_steps = run(llm, [embedding(f"b{i}", i) for i in range(4)], neighbour=True)
    assert alone_steps == 2
    assert beside_steps == -(-4 * 180 // SHARE)  # one allowance shared by the four inputs
    for i in range(4):
        want, got = alone[f"a{i}"].pooled, beside[f"b{i}"].pooled
        assert want is not None and got is not None and len(got) == len(want)
        assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(got, want))
