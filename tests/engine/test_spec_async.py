"""Speculative decoding (n-gram and draft) under async scheduling: the plain engine's tokens.

With async overlap step N+1 is scheduled before step N's proposals exist and before the scheduler
knows how many of N's drafts were kept: it reserves draft slots optimistically, and the runner
fills them with the proposals it made at step N and starts each row where N really ended
(scheduler/features_spec.py, workers/spec_async.py). Greedy and seeded rows (penalties, logprobs)
are checked token for token against an engine without either feature, through chunked prefill,
prefix hits and forced preemption by recompute and by swap; every KV block is back in the pool
once the engine is idle.
"""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm import LLM
from scheduler import SamplingParams
from scheduler.features_async import AsyncOverlap
from scheduler.features_spec import SpecDecoding
from scheduler.speculative import SpecPolicy, SpeculativeConfig
from tests.engine.paired_engines import SMALL_POOL
from tests.engine.test_speculative import SPEC, assert_idle, generate, with_oracle, workload

DRAFT = {"method": "draft", "num_tokens": 3, "min_acceptance_rate": 0.0}


@pytest.fixture(scope="module")
def model(tiny_checkpoint) -> str:
    return tiny_checkpoint("llama")[0]


# Fewer blocks than the plain engines of the other tests: speculative slots reserved a step ahead
# finish requests sooner, and the workload must still preempt.
POOL = dict(SMALL_POOL, num_gpu_blocks=8, max_model_len=8 * 16)


def engine(model: str, mode: str = "recompute", **kwargs) -> LLM:
    pool = dict(POOL, preemption_mode=mode, num_cpu_blocks=200 if mode == "swap" else 0)
    return LLM(model, device="cpu", load_progress=False, **pool, **kwargs)


@pytest.fixture(scope="module")
def llms(model):
    """name -> engine, each built on first use: `plain` (neither feature), `ngram-<mode>` and
    `draft-<mode>` (speculation and async scheduling together, in that preemption mode)."""
    made: dict[str, LLM] = {}

    def make(name: str) -> LLM:
        if name not in made:
            if name == "plain":
                made[name] = engine(model)
            else:
                method, mode = name.split("-")
                spec = SPEC if method == "ngram" else {**DRAFT, "draft_model": model}
                made[name] = engine(model, mode, speculative=spec, async_scheduling=True)
        return made[name]

    yield make
    for llm in made.values():
        llm.shutdown()


def spec_counts(llm: LLM) -> tuple[int, int, int]:
    stats = llm.engine.stats()
    return (
        stats.num_spec_proposed_tokens,
        stats.num_spec_accepted_tokens,
        llm.engine.scheduler.num_preemptions,
    )


def test_speculation_and_async_scheduling_compose_as_features(llms):
    on = llms("ngram-recompute").engine
    assert EngineConfig.from_kwargs(speculative=SPEC, async_scheduling=True).speculative
    assert [type(f) for f in on.scheduler.features] == [SpecDecoding, AsyncOverlap]
    assert on.pipeline is not None  # steps overlap: one is scheduled while the last runs


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_verified_proposals_under_async_give_the_plain_tokens(llms, mode):
    """An oracle proposer (the plain engine's tokens, 15% spoiled) makes every step verify: kept
    runs, rejections and unused slots all happen while a step is in flight."""
    plain, spec = llms("plain"), llms(f"ngram-{mode}")
    prompts, params = workload(1)
    want = generate(plain, prompts, params)
    before = spec_counts(spec)
    with_oracle(spec, 0.15, prompts, want)
    assert generate(spec, prompts, params) == want
    proposed, accepted, preemptions = (a - b for a, b in zip(spec_counts(spec), before))
    assert 0 < accepted < proposed  # proposals were kept, and rejected
    assert preemptions > 0
    assert_idle(spec)


def test_ngram_proposals_under_async_give_the_plain_tokens(llms):
    plain, spec = llms("plain"), llms("ngram-recompute")
    prompts, params = workload(3, n=5)
    assert generate(spec, prompts, params) == generate(plain, prompts, params)
    assert_idle(spec)


def test_adaptive_lengths_under_async_give_the_plain_tokens(llms):
    """max_num_tokens while steps overlap: slots reserved a step ahead at a length that grows
    after full runs and falls back after a miss; the tokens are the plain engine's."""
    plain, spec = llms("plain"), llms("ngram-recompute")
    prompts, params = workload(5, n=4)
    want = generate(plain, prompts, params)
    (feature,) = [f for f in spec.engine.scheduler.features if isinstance(f, SpecDecoding)]
    before, fixed = spec_counts(spec), feature.policy
    rows = spec.engine.stats().num_spec_verify_rows
    feature.policy = SpecPolicy(SpeculativeConfig(**SPEC, max_num_tokens=12))
    with_oracle(spec, 0.05, prompts, want).num_tokens = 12
    try:
        assert generate(spec, prompts, params) == want
    finally:
        feature.policy = fixed
    proposed, accepted, _ = (a - b for a, b in zip(spec_counts(spec), before))
    assert 0 < accepted < proposed
    assert proposed > SPEC["num_tokens"] * (spec.engine.stats().num_spec_verify_rows - rows)
    assert_idle(spec)


def test_one_request_at_a_time_verifies_every_step(llms):
    """Batch 1: every step verifies the proposal made one step before it."""
    plain, spec = llms("plain"), llms("ngram-recompute")
    prompts, params = workload(2, n=3)
    for prompt, p in zip(prompts, params):
        want = generate(plain, [prompt], p)
        with_oracle(spec, 0.3, [prompt], want)
        assert generate(spec, [prompt], p) == want
    assert_idle(spec)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_model_drafting_for_itself_under_async_gives_the_plain_tokens(llms, mode):
    """The draft's argmax is the model's: a greedy row keeps every draft that ran, which holds
    only if the draft's KV and the runner's own row starts are right while steps overlap."""
    plain, spec = llms("plain"), llms(f"draft-{mode}")
    prompts, _ = workload(1)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    want = generate(plain, prompts, params)
    before = spec_counts(spec)
    assert generate(spec, prompts, params) == want
    proposed, accepted, preemptions = (a - b for a, b in zip(spec_counts(spec), before))
    assert 0 < accepted <= proposed and preemptions > 0
    assert_idle(spec)


def test_a_draft_under_async_keeps_seeded_rows_with_penalties(llms):
    plain, spec = llms("plain"), llms("draft-recompute")
    prompts, params = workload(12, n=3)
    assert generate(spec, prompts, params) == generate(plain, prompts, params)
    assert_idle(spec)
