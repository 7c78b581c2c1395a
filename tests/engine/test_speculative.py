"""Speculative decoding on a real model (the tiny random Llama, CPU): the same tokens as without it.

Engines with and without speculation run the same requests: greedy and seeded rows with penalties
and logprobs mixed, chunked prefill, forced preemption by recompute and by swap, prefix hits, stop
ids, and a constrained row (which never speculates). Every KV block is back in the pool once the
engine is idle.

A random model seldom repeats itself, so n-gram proposals are seldom right. To verify many right
and wrong proposals, most tests plug in a proposer (through the runner's Proposer interface) that
knows the plain engine's outputs and spoils some of its proposals at random; the n-gram proposer
itself runs in the last tests.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch

from engine.config import EngineConfig
from engine.llm import LLM
from scheduler import SamplingParams
from scheduler.speculative import SpeculativeConfig
from scheduler.structured_output import StructuredOutput
from tests.engine.paired_engines import paired_engines
from workers.proposer import NgramProposer

# 12 blocks of 16 tokens hold a fraction of the workload: preemption is certain.
SPEC = {"num_tokens": 4, "ngram_min": 1, "ngram_max": 3, "min_acceptance_rate": 0.0}


@pytest.fixture(scope="module")
def model(tiny_checkpoint) -> str:
    return tiny_checkpoint("llama")[0]


class OracleProposer:
    """Proposes what the plain engine produced after each prompt, each token wrong with
    probability `wrong` (a wrong one is a token the plain engine did not produce there)."""

    uses_hidden_states = False

    def __init__(self, num_tokens: int, wrong: float, seed: int = 0) -> None:
        self.num_tokens, self.wrong = num_tokens, wrong
        self.rng = random.Random(seed)
        self.expected: list[tuple[list[int], list[int]]] = []  # (prompt, outputs)

    def propose(
        self, contexts: Sequence[Sequence[int]], hidden_states: torch.Tensor | None = None
    ) -> list[list[int]]:
        return [self._one(list(ctx)) for ctx in contexts]

    def _one(self, ctx: list[int]) -> list[int]:
        for prompt, outputs in self.expected:
            n = len(prompt)
            if ctx[:n] == prompt and outputs[: len(ctx) - n] == ctx[n:]:
                nxt = outputs[len(ctx) - n : len(ctx) - n + self.num_tokens]
                return [t if self.rng.random() >= self.wrong else t + 1 for t in nxt]
        return []


def with_oracle(spec: LLM, wrong: float, prompts, outputs) -> OracleProposer:
    oracle = OracleProposer(SPEC["num_tokens"], wrong)
    oracle.expected = sorted(zip(prompts, [o[0] for o in outputs]), key=lambda po: -len(po[0]))
    spec.engine.executor.runner.proposer = oracle  # type: ignore[attr-defined]
    return oracle


@pytest.fixture(scope="module")
def llms(model):
    """(plain, speculative) LLM pairs by preemption mode, built once."""
    yield from paired_engines(model, "speculative", (None, SPEC))


@pytest.fixture(autouse=True)
def ngram_again(llms):
    """Each test starts with the n-gram proposer the engines were built with."""
    yield
    runner = llms("recompute")[1].engine.executor.runner
    runner.proposer = NgramProposer(SpeculativeConfig(**SPEC))


def workload(seed: int, n: int = 8) -> tuple[list[list[int]], list[SamplingParams]]:
    """Repetitive prompts of 4-60 tokens (a few motifs repeated), some sharing a prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 2000) for _ in range(34)]
    prompts, params = [], []
    for i in range(n):
        motif = [rng.randrange(3, 2000) for _ in range(rng.randint(2, 6))]
        prompt = motif * rng.randint(1, 8) + [rng.randrange(3, 2000)]
        prompts.append((shared + prompt if i % 3 == 0 else prompt)[:60])
        greedy = rng.random() < 0.5
        params.append(
            SamplingParams(
                max_tokens=rng.randint(1, 32),
                temperature=0.0 if greedy else rng.choice([0.7, 1.0]),
                seed=None if greedy else rng.randrange(1 << 30),
                top_k=rng.choice([0, 0, 20]),
                presence_penalty=rng.choice([0.0, 0.0, 0.5]),
                ignore_eos=True,
                logprobs=rng.choice([None, None, 2]),
            )
        )
    return prompts, params


def generate(llm: LLM, prompts, params) -> list[tuple]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.token_ids, o.finish_reason, [lp[0][0] for lp in o.logprobs or []]) for o in outs]


def assert_idle(llm: LLM) -> None:
    core = llm.engine
    assert core.scheduler.kv.num_free_blocks == core.num_gpu_blocks
    assert not core.scheduler.kv.req_blocks


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_verified_proposals_give_the_same_tokens(llms, mode):
    plain, spec = llms(mode)
    prompts, params = workload(1)
    want = generate(plain, prompts, params)
    before = spec.engine.stats()
    with_oracle(spec, 0.15, prompts, want)
    assert generate(spec, prompts, params) == want
    stats = spec.engine.stats()
    accepted = stats.num_spec_accepted_tokens - before.num_spec_accepted_tokens
    proposed = stats.num_spec_proposed_tokens - before.num_spec_proposed_tokens
    assert 0 < accepted < proposed  # proposals were kept, and rejected
    assert spec.engine.scheduler.num_preemptions > 0
    assert_idle(spec)


def test_one_request_at_a_time_matches_too(llms):
    """Batch 1, where every step verifies (and prompts hit the prefix cache of earlier ones)."""
    plain, spec = llms()
    prompts, params = workload(2, n=3)
    for prompt, p in zip(prompts, params):
        want = generate(plain, [prompt], p)
        with_oracle(spec, 0.3, [prompt], want)
        assert generate(spec, [prompt], p) == want
    assert_idle(spec)


def test_ngram_proposals_give_the_same_tokens(llms):
    plain, spec = llms()
    prompts, params = workload(3, n=5)
    assert generate(spec, prompts, params) == generate(plain, prompts, params)
    assert_idle(spec)


def test_stop_ids_inside_an_accepted_run_end_the_request_there(llms):
    plain, spec = llms()
    prompt = [11, 12, 13, 14] * 6
    greedy = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
    free = generate(plain, [prompt], SamplingParams(**greedy))[0][0]
    stop = free[len(free) // 2]
    params = SamplingParams(**greedy, stop_token_ids=[stop])
    want = generate(plain, [prompt], params)
    with_oracle(spec, 0.0, [prompt], [(free,)])  # proposes past the stop
    assert generate(spec, [prompt], params) == want
    assert want[0][0][-1] == stop and want[0][1] == "stop"


def test_a_constrained_request_does_not_speculate_and_stays_valid(llms):
    plain, spec = llms()
    constraint = StructuredOutput("regex", "(ab|cd){3,6}")
    params = SamplingParams(max_tokens=20, temperature=0.0, structured=constraint)
    prompts = [[5, 6, 5, 6, 5, 6], [7, 8, 7, 8, 7, 8, 7, 8]]
    mixed = [params, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)]
    assert generate(spec, prompts, mixed) == generate(plain, prompts, mixed)


def test_async_scheduling_is_refused_with_speculation():
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig.from_kwargs(speculative=SPEC, async_scheduling=True)


PASSAGE = (
    "The river rose through the night, and by morning the lower streets of the town were under "
    "water. The bakers carried their flour to the upper floors, and the children watched from the "
    "bridge."
)


@pytest.mark.slow
def test_ngram_on_smollm2_gives_its_plain_tokens(smollm2_llm):
    """The embedded model copying a passage (where prompt lookup is right), greedy and seeded."""
    spec = LLM(
        "default", device="cpu", load_progress=False, kv_cache_memory_gb=0.25, speculative={}
    )
    try:
        convs = [
            [{"role": "user", "content": f"Repeat this passage word for word.\n\n{PASSAGE}"}],
            [{"role": "user", "content": f"Summarise this passage.\n\n{PASSAGE}"}],
        ]
        params = [
            SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=48, temperature=0.8, seed=7, ignore_eos=True),
        ]
        want = [o.token_ids for o in smollm2_llm.chat(convs, params, use_tqdm=False)]
        assert [o.token_ids for o in spec.chat(convs, params, use_tqdm=False)] == want
        assert spec.engine.stats().num_spec_accepted_tokens > 0
    finally:
        spec.shutdown()
