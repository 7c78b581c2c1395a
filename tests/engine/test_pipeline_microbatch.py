"""Pipeline micro-batches through a real engine: two stages (a spawned gloo process each, the mp
executor) keep two steps in flight over disjoint requests, and every request still gets Hugging
Face's greedy tokens under chunked prefill and recompute preemption (the scheduler's side, prefix
caching and aborts included, is proved against the contract runner in
tests/scheduler/test_micro_batches.py)."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.mp_executor import MPExecutor
from scheduler import EngineRequest, SamplingParams
from scheduler.features_pipeline import MicroBatches
from tests.random_checkpoint import write_random_checkpoint
from tests.workers.greedy import Greedy, assert_greedy_match, hf_greedy
from tests.workers.test_pipeline_split import TINY_PP_LLAMA

pytestmark = pytest.mark.slow  # two spawned rank processes

MAX_TOKENS = 8
# Six prompts of 9 to 34 tokens: most are longer than the 12-token budget (prefilled in chunks).
PROMPTS = [[1 + (11 * i + 7 * j) % 240 for j in range(9 + 5 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return write_random_checkpoint(TINY_PP_LLAMA, str(tmp_path_factory.mktemp("pp-mb"))).path


@pytest.fixture(scope="module")
def hf_tokens(tiny) -> dict[tuple[int, ...], Greedy]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    return {tuple(p): hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS}


@pytest.fixture(scope="module")
def run(tiny):
    """The six requests through PP=2 with a 12-token budget and a 12-block pool (together they
    need 45 blocks of 4: preemption), step by step, recording what was in flight."""
    config = EngineConfig.from_kwargs(
        model=tiny,
        device="cpu",
        load_progress=False,
        pipeline_parallel_size=2,
        num_gpu_blocks=12,
        block_size=4,
        max_model_len=44,
        max_num_batched_tokens=12,
    )
    engine = EngineCore(config)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    in_flight: list[list[set[str]]] = []  # after each step: the requests of each step in flight
    try:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(EngineRequest(f"r{i}", prompt, params))
        for _ in range(500):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                tokens[out.request_id].extend(out.new_token_ids)
            in_flight.append([set(out.num_scheduled_tokens) for out, _ in engine._in_flight])
        else:
            raise AssertionError("the engine did not drain")
        yield engine, tokens, in_flight
    finally:
        engine.shutdown()


def test_two_stages_run_two_micro_batches_on_the_mp_executor(run):
    engine, _, in_flight = run
    assert isinstance(engine.executor, MPExecutor) and engine.executor.answer_rank == 1
    assert [type(f) for f in engine.scheduler.features] == [MicroBatches]
    # Between steps two steps are in flight over disjoint requests: the requests a step()
    # returns are already posted again (engine/core.py), so stage 0 does not wait on the caller.
    assert max(len(steps) for steps in in_flight) == 2
    assert any(len(steps) == 2 and all(steps) for steps in in_flight)
    assert not any(len(steps) == 2 and steps[0] & steps[1] for steps in in_flight)


def test_micro_batched_stages_give_hf_greedy_tokens_under_chunks_and_preemption(run, hf_tokens):
    engine, tokens, _ = run
    stats = engine.stats()
    assert stats.num_preemptions > 0
    for i, prompt in enumerate(PROMPTS):
        assert_greedy_match(tokens[f"r{i}"], hf_tokens[tuple(prompt)], f"r{i}")
    assert stats.num_free_blocks == 12
