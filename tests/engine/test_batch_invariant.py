"""Under `batch_invariant` a request's tokens and logprobs are bit-identical alone or in any batch.

One target request (a greedy one and a seeded sampled one) runs alone, then inside 8 seeded
random batches of 1-32 requests on engines whose token budget (16-512, and a per-request prefill
cap) chunks its prompt differently, with the prefix cache cold or holding the target's blocks,
and on engines whose pool is small enough that the batch preempts it. Its tokens and every
logprob must equal the alone run's exactly: `==` on floats, no tolerance.

Two paths: the tiny random Llama in fp32 (head size 32, which the paged kernel takes) and the
default quantized path (the embedded SmolLM2's Q4_1 blocks through the int8 kernel).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from engine.llm import GenerationOutput
from scheduler import SamplingParams
from tests.random_checkpoint import TINY_SERVED_LLAMA, write_random_checkpoint

pytestmark = pytest.mark.slow

BUDGETS = (16, 128, 512)  # max_num_batched_tokens: the chunk sizes of the target's prompt
PREEMPT_BUDGET = 64  # the small-pool engine's
TARGET_LEN = 100
MAX_MODEL_LEN = 128
SMALL_POOL = 10  # blocks of 16: the target alone needs 7, a batch of several preempts
TARGETS = (
    SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3),
    SamplingParams(max_tokens=6, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True, logprobs=3),
)


@dataclass(frozen=True, slots=True)
class Case:
    size: int  # requests in the batch, the two targets included
    budget: int
    small_pool: bool  # preemption forced


def draw_cases(rng: random.Random) -> list[Case]:
    """Two batches on each of four engines (one per budget, one small pool): the first finds its
    engine's cache cold, the second the target's blocks cached. Each small-pool batch holds 16 or
    more requests, so that it preempts. Every budget meets both caches in 8 batches, where 20
    drawn at random cost the quantized path 22 s of CI."""
    engines = [(budget, False) for budget in BUDGETS] + [(PREEMPT_BUDGET, True)]
    return [
        Case(rng.randint(16 if small else 1, 32), budget, small)
        for _ in range(2)
        for budget, small in engines
    ]


def engine_kwargs(case: Case) -> dict:
    pool = dict(num_gpu_blocks=SMALL_POOL) if case.small_pool else dict(kv_cache_memory_gb=0.05)
    return dict(
        max_num_batched_tokens=case.budget,
        long_prefill_token_threshold=case.budget // 2,
        max_model_len=MAX_MODEL_LEN,
        batch_invariant=True,
        **pool,
    )


def as_result(out: GenerationOutput) -> tuple[list[int], list]:
    return out.token_ids, out.logprobs


def check_invariance(make, vocab: int) -> None:
    rng = random.Random(20261128)
    target = [rng.randrange(3, vocab) for _ in range(TARGET_LEN)]
    alone = make(max_num_batched_tokens=512, batch_invariant=True, enable_prefix_caching=False)
    expected = [as_result(alone.generate([target], [sp], use_tqdm=False)[0]) for sp in TARGETS]
    hits, preempted = set(), 0
    for i, case in enumerate(draw_cases(rng)):
        llm = make(**engine_kwargs(case))
        before = llm.engine.stats().num_preemptions
        prompts, params = batch_around(rng, target, case.size, vocab)
        outs = llm.generate(prompts, params, use_tqdm=False)
        for k in range(min(2, case.size)):
            got = as_result(outs[k])
            assert got == expected[k], f"batch {i} {case}, target {k}: {got} != {expected[k]}"
            hits.add(outs[k].num_cached_tokens > 0)
        preempted += llm.engine.stats().num_preemptions > before
    assert hits == {False, True}, "the batches must run the target both cold and after a hit"
    assert preempted, "some small-pool batch must preempt"


def batch_around(
    rng: random.Random, target: list[int], size: int, vocab: int
) -> tuple[list[list[int]], list[SamplingParams]]:
    """The targets first, then others: random prompts, some sharing the target's first blocks."""
    prompts = [target, target][:size]
    params = list(TARGETS[:size])
    while len(prompts) < size:
        head = target[: rng.choice((0, 16, 48))]
        prompts.append(head + [rng.randrange(3, vocab) for _ in range(rng.randint(4, 24))])
        params.append(
            SamplingParams(max_tokens=rng.randint(1, 6), ignore_eos=True, seed=len(prompts))
        )
    return prompts, params


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    spec = TINY_SERVED_LLAMA.with_fields(head_dim=32, max_position_embeddings=MAX_MODEL_LEN)
    path = tmp_path_factory.mktemp("tiny-llama-hd32")
    return write_random_checkpoint(spec, str(path), tokenizer=smollm2_tokenizer).path


def test_fp32_tokens_and_logprobs_do_not_depend_on_the_batch(llm_factory, tiny_llama_dir):
    check_invariance(lambda **kw: llm_factory(model=tiny_llama_dir, dtype="float32", **kw), 1000)


def test_quantized_tokens_and_logprobs_do_not_depend_on_the_batch(llm_factory):
    check_invariance(lambda **kw: llm_factory(model="default", quantization="auto", **kw), 40000)


def test_batch_invariant_is_refused_off_cpu():
    from workers.runner_config import RunnerConfig

    with pytest.raises(ValueError, match="batch_invariant: runs on CPU only"):
        RunnerConfig(
            model_dir="x",
            dtype="float32",
            device="cuda",
            block_size=16,
            max_model_len=64,
            max_num_batched_tokens=64,
            max_num_seqs=4,
            seed=0,
            attention_backend="auto",
            kv_cache_memory_gb=1.0,
            gpu_memory_utilization=0.9,
            load_progress=False,
            batch_invariant=True,
        )


@pytest.mark.parametrize("value", [2**64, -1, float("nan"), "x" * 100_000, "yes"])
def test_batch_invariant_takes_only_a_bool(value):
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="batch_invariant: must be true or false"):
        EngineConfig(batch_invariant=value)
