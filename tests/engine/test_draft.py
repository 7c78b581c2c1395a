"""The draft-model proposer on the tiny random Llama (CPU): the same tokens as without speculation.

The model drafting for itself must have every proposal accepted under greedy decoding: the draft's
KV (paged by the model's own block ids) is then right at every position, through chunked prefill,
prefix hits, and preemption by recompute and by swap. A second random model (one layer, another
seed) drafts for a mixed greedy and seeded batch with penalties and logprobs, where most proposals
are rejected. Every block is back in the pool once the engine is idle.
"""

from __future__ import annotations

import pytest

from engine.llm import LLM
from scheduler import SamplingParams
from scheduler.structured_output import StructuredOutput
from tests.engine.paired_engines import SMALL_POOL
from tests.engine.test_speculative import assert_idle, generate, workload
from tests.random_checkpoint import TINY_FAMILIES, TINY_TP_LLAMA, write_random_checkpoint
from workers.draft_pacing import DraftPacing
from workers.features.draft import DraftFeature

SPEC = {"method": "draft", "num_tokens": 4, "min_acceptance_rate": 0.0}


@pytest.fixture(scope="module")
def model(tiny_checkpoint) -> str:
    return tiny_checkpoint("llama")[0]


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory, smollm2_tokenizer) -> str:
    """A one-layer random Llama with the model's tokenizer: a draft that is mostly wrong."""
    path = str(tmp_path_factory.mktemp("draft"))
    spec = TINY_FAMILIES["llama"].with_fields(num_hidden_layers=1)
    write_random_checkpoint(spec, path, seed=7, tokenizer=smollm2_tokenizer)
    return path


def engine(model: str, mode: str = "recompute", **kwargs) -> LLM:
    pool = dict(SMALL_POOL, preemption_mode=mode, num_cpu_blocks=200 if mode == "swap" else 0)
    return LLM(model, device="cpu", load_progress=False, **pool, **kwargs)


@pytest.fixture(scope="module")
def llms(model):
    """mode -> (the plain engine, an engine whose model drafts for itself in that preemption
    mode), each built on first use (the plain engine's tokens do not depend on the mode)."""
    made: dict[str, LLM] = {}

    def make(mode: str = "recompute") -> tuple[LLM, LLM]:
        if "plain" not in made:
            made["plain"] = engine(model)
        if mode not in made:
            made[mode] = engine(model, mode, speculative={**SPEC, "draft_model": model})
        return made["plain"], made[mode]

    yield make
    for llm in made.values():
        llm.shutdown()


@pytest.fixture(scope="module")
def greedy_case(llms):
    """Greedy requests without penalties that preempt each other and share a prefix, and the
    plain engine's tokens for them (the same in either preemption mode)."""
    prompts, _ = workload(1)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    return prompts, params, generate(llms()[0], prompts, params)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_model_drafting_for_itself_is_always_right(llms, greedy_case, mode):
    """The draft's argmax is the model's, so every proposal is kept, which holds only if the
    draft's KV is right after chunked prefill, prefix hits and preemption."""
    spec = llms(mode)[1]
    prompts, params, want = greedy_case
    before, preemptions = spec.engine.stats(), spec.engine.scheduler.num_preemptions
    assert generate(spec, prompts, params) == want
    after = spec.engine.stats()
    proposed = after.num_spec_proposed_tokens - before.num_spec_proposed_tokens
    accepted = after.num_spec_accepted_tokens - before.num_spec_accepted_tokens
    assert proposed > 0 and accepted == proposed
    assert spec.engine.scheduler.num_preemptions > preemptions
    assert after.prefix_cache_hit_rate > 0
    assert_idle(spec)


@pytest.fixture(scope="module")
def mixed_case(llms):
    """Greedy and seeded requests with penalties and logprobs, and the plain engine's tokens."""
    prompts, params = workload(12, n=3)
    return prompts, params, generate(llms()[0], prompts, params)


def test_seeded_rows_with_penalties_keep_their_tokens(llms, mixed_case):
    spec = llms()[1]
    prompts, params, want = mixed_case
    assert generate(spec, prompts, params) == want
    assert spec.engine.stats().num_spec_accepted_tokens > 0
    assert_idle(spec)


def test_a_wrong_draft_changes_no_token(model, other_draft, mixed_case):
    spec = engine(model, speculative={**SPEC, "num_tokens": 2, "draft_model": other_draft})
    try:
        prompts, params, want = mixed_case
        assert generate(spec, prompts, params) == want
        stats = spec.engine.stats()
        assert stats.num_spec_proposed_tokens > stats.num_spec_accepted_tokens
        assert_idle(spec)
    finally:
        spec.shutdown()


class CountingPacing(DraftPacing):
    """DraftPacing counting the rows that sampled (each of which asked the draft for a proposal
    every step before pacing) and those it lets propose."""

    def __init__(self) -> None:
        super().__init__()
        self.sampled = self.asked = 0

    def asks(self, rid: str) -> bool:
        asks = super().asks(rid)
        self.sampled, self.asked = self.sampled + 1, self.asked + asks
        return asks


def test_a_request_that_stopped_speculating_costs_the_draft_little(model, other_draft, mixed_case):
    """With a mostly wrong draft every request soon stops speculating (min_acceptance_rate 0.9):
    paced (workers/draft_pacing.py), the draft proposes for fewer than half of the rows that
    sampled (all of which it proposed for before), and the tokens are the plain engine's."""
    spec = engine(
        model,
        speculative={
            **SPEC,
            "num_tokens": 2,
            "draft_model": other_draft,
            "min_acceptance_rate": 0.9,
        },
    )
    try:
        draft = spec.engine.executor.runner.feature(DraftFeature)  # type: ignore[attr-defined]
        draft.pacing = pacing = CountingPacing()
        prompts, params, want = mixed_case
        assert generate(spec, prompts, params) == want
        assert 0 < pacing.asked < pacing.sampled / 2
        assert spec.engine.stats().num_spec_verify_rows > 0
        assert_idle(spec)
    finally:
        spec.shutdown()


@pytest.mark.parametrize("kind", ["vocabulary", "tokenizer"])
def test_a_draft_with_another_vocabulary_is_refused(model, tmp_path, kind):
    path = str(tmp_path)
    if kind == "vocabulary":  # 250 tokens
        write_random_checkpoint(TINY_TP_LLAMA, path)
    else:  # the model's 49,152 ids, spelled by a word-level tokenizer
        spec = TINY_TP_LLAMA.with_fields(vocab_size=49152, num_hidden_layers=1)
        write_random_checkpoint(spec, path)
    with pytest.raises(ValueError, match=r"speculative\.draft_model: .*" + kind):
        LLM(model, device="cpu", load_progress=False, speculative={**SPEC, "draft_model": path})


def test_constrained_rows_draft_and_keep_their_tokens(llms):
    """Constrained rows ask the draft too; its proposals (the model's unmasked argmax, which on
    this random model the regex never allows) are cut to their grammar before verification, and
    the rows keep their plain tokens, greedy and seeded."""
    plain, spec = llms()
    constraint = StructuredOutput("regex", "(ab|cd){2,8}-[0-9]{1,3}")
    prompts, _ = workload(5, n=3)
    params = [
        SamplingParams(max_tokens=24, temperature=0.0, structured=constraint),
        SamplingParams(max_tokens=24, temperature=0.9, seed=11, structured=constraint),
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    ]
    assert generate(spec, prompts, params) == generate(plain, prompts, params)
    assert_idle(spec)
