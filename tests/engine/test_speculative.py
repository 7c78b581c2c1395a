"""Speculative decoding on a real model (the tiny random Llama, CPU): the same tokens as without it.

Engines with and without speculation run the same requests: greedy and seeded rows with penalties
and logprobs mixed, chunked prefill, forced preemption by recompute and by swap, prefix hits, stop
ids, and constrained rows (JSON schema, regex, a choice after a marker). Every KV block is back
in the pool once the engine is idle.

A random model seldom repeats itself, so n-gram proposals are seldom right. To verify many right
and wrong proposals, most tests plug in a proposer (through the runner's Proposer interface) that
knows the plain engine's outputs and spoils some of its proposals at random; the n-gram proposer
itself runs in the last tests.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence

import pytest
import torch

from engine.llm import LLM
from scheduler import SamplingParams
from scheduler.features_spec import SpecDecoding
from scheduler.speculative import SpecPolicy, SpeculativeConfig
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
        self.swap: dict[int, int] = {}  # a wrong token's replacement (default: the next id)
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
                return [t if self.rng.random() >= self.wrong else self._spoil(t) for t in nxt]
        return []

    def _spoil(self, token: int) -> int:
        return self.swap.get(token, token + 1)


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


def test_adaptive_lengths_give_the_same_tokens(llms):
    """max_num_tokens: runs of accepted proposals lengthen the verify rows (up to 12 tokens here),
    a miss shortens them again; the tokens are the plain engine's."""
    plain, spec = llms()
    prompts, params = workload(5, n=4)
    want = generate(plain, prompts, params)
    (feature,) = [f for f in spec.engine.scheduler.features if isinstance(f, SpecDecoding)]
    before, fixed = spec.engine.stats(), feature.policy
    feature.policy = SpecPolicy(SpeculativeConfig(**SPEC, max_num_tokens=12))
    oracle = with_oracle(spec, 0.05, prompts, want)
    oracle.num_tokens = 12
    try:
        assert generate(spec, prompts, params) == want
    finally:
        feature.policy = fixed
    stats = spec.engine.stats()
    proposed = stats.num_spec_proposed_tokens - before.num_spec_proposed_tokens
    rows = stats.num_spec_verify_rows - before.num_spec_verify_rows
    assert proposed > SPEC["num_tokens"] * rows  # some rows verified more than num_tokens
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


SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "tag"],
    "additionalProperties": False,
}
REGEX = "(ab|cd){2,5}-[0-9]{1,3}"
MARK = 1234  # a constraint that starts after this token (the end of a reasoning block)


def constrained_workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """JSON-schema and regex requests, greedy and seeded, and one constrained after a marker."""
    prompts, _ = workload(4, n=4)
    choice = StructuredOutput.choice(["yes", "no"])
    kinds = [
        StructuredOutput.json_schema(SCHEMA),
        StructuredOutput("regex", REGEX),
        StructuredOutput("regex", REGEX),
        StructuredOutput(choice.kind, choice.spec, after=MARK),
    ]
    params = [
        SamplingParams(
            max_tokens=32,
            temperature=0.0 if i % 2 == 0 else 0.9,
            seed=None if i % 2 == 0 else 100 + i,
            presence_penalty=0.5 if i == 2 else 0.0,
            logit_bias={MARK: 100.0} if i == 3 else {},
            logprobs=2 if i == 1 else None,
            structured=kind,
        )
        for i, kind in enumerate(kinds)
    ]
    return prompts, params


def assert_valid(llm: LLM, outs, params) -> None:
    """Every output that ended (not cut by max_tokens) obeys its constraint."""
    ended = [(o, p.structured) for o, p in zip(outs, params) if o.finish_reason == "stop"]
    assert len(ended) >= 2
    for out, constraint in ended:
        if constraint.kind == "json_schema":
            value = json.loads(out.text)
            assert set(value) == {"ok", "tag"} and value["tag"] in ("red", "green", "blue")
        elif constraint.kind == "regex":
            assert re.fullmatch(REGEX, out.text), out.text
        else:
            assert out.token_ids[0] == MARK
            assert llm.frontend.decode(out.token_ids[1:]) in ("yes", "no")


def test_constrained_requests_verify_proposals_and_give_the_same_tokens(llms, smollm2_tokenizer):
    """Each verify position is masked after the proposed tokens before it, and the matcher
    consumes only what is kept. Spoiled proposals are either cut (the grammar rejects them) or
    verified and rejected (`ab` for `cd`: the grammar allows both)."""
    plain, spec = llms()
    prompts, params = constrained_workload()
    want = generate(plain, prompts, params)
    before = spec.engine.stats()
    oracle = with_oracle(spec, 0.25, prompts, want)
    ab, cd = (smollm2_tokenizer.encode(t, add_special_tokens=False)[0] for t in ("ab", "cd"))
    oracle.swap = {ab: cd, cd: ab}
    outs = spec.generate(prompts, params, use_tqdm=False)
    got = [(o.token_ids, o.finish_reason, [lp[0][0] for lp in o.logprobs or []]) for o in outs]
    assert got == want
    stats = spec.engine.stats()
    accepted = stats.num_spec_accepted_tokens - before.num_spec_accepted_tokens
    proposed = stats.num_spec_proposed_tokens - before.num_spec_proposed_tokens
    assert 0 < accepted < proposed
    assert_valid(spec, outs, params)
    assert_idle(spec)


def test_constrained_requests_speculate_with_ngram_proposals(llms):
    plain, spec = llms()
    constraint = StructuredOutput("regex", "(ab|cd){3,12}")
    params = SamplingParams(max_tokens=20, temperature=0.0, structured=constraint)
    prompts = [[5, 6, 5, 6, 5, 6], [7, 8, 7, 8, 7, 8, 7, 8]]
    mixed = [params, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)]
    before = spec.engine.stats().num_spec_proposed_tokens
    assert generate(spec, prompts[:1], [params]) == generate(plain, prompts[:1], [params])
    assert spec.engine.stats().num_spec_proposed_tokens > before  # the constrained row verified
    assert generate(spec, prompts, mixed) == generate(plain, prompts, mixed)
    assert_idle(spec)


PASSAGE = (
    "The river rose through the night, and by morning the lower streets of the town were under "
    "water. The bakers carried their flour to the upper floors, and the children watched from the "
    "bridge."
)


@pytest.mark.slow
def test_ngram_on_smollm2_gives_its_plain_tokens(smollm2_gguf_llm):
    """The embedded model as served by default (int8 kernel) copying a passage (where prompt
    lookup is right), greedy and seeded: every verified position is computed as the decode row
    it would have been, so even int8-rounded activations give the plain tokens."""
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
        want = [o.token_ids for o in smollm2_gguf_llm.chat(convs, params, use_tqdm=False)]
        assert [o.token_ids for o in spec.chat(convs, params, use_tqdm=False)] == want
        assert spec.engine.stats().num_spec_accepted_tokens > 0
    finally:
        spec.shutdown()
