"""A request's greedy tokens do not depend on how the engine batched, chunked or evicted it.

The same 16 mixed requests run alone, batched, with a 32-token budget (chunked prefill), under
forced preemption (recompute and swap) and again over a warm prefix cache. Results may differ
only where the reference run had a true near-tie (tests/workers/greedy.py).

The model runs de-quantised to fp32: there a near-tie is 1e-3 and a layout the engine gets wrong
shows. The default int8 kernel rounds activations, so layouts agree only within its own rounding
(tests/workers/test_quantized.py holds that path to INT8_NEAR_TIE).
"""

from __future__ import annotations

import random

import pytest

from scheduler import SamplingParams
from tests.workers.greedy import assert_greedy_match, from_logprobs

pytestmark = pytest.mark.slow

FP32 = {"model": "default", "dtype": "float32", "quantization": "none"}
# 16 requests: each test runs all of them on an engine of its own (32 cost ~10 s a test in CI).
NUM_REQUESTS = 16
ALONE = (0, 7, 10, 13)  # requests also run one at a time
WORDS = [
    "river",
    "stone",
    "light",
    "market",
    "engine",
    "garden",
    "winter",
    "paper",
    "signal",
    "forest",
    "copper",
    "harbor",
    "lantern",
    "window",
    "orbit",
    "cotton",
    "meadow",
    "thunder",
]


@pytest.fixture(scope="module")
def workload(smollm2_tokenizer):
    """16 requests: chat prompts and raw text of 8-100 tokens, 4-16 new tokens each."""
    rng = random.Random(1234)
    prompts, params = [], []
    for i in range(NUM_REQUESTS):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 60)))
        if i % 2:
            text = smollm2_tokenizer.apply_chat_template(
                [{"role": "user", "content": f"Summarise: {text}"}],
                tokenize=False,
                add_generation_prompt=True,
            )
        prompts.append(smollm2_tokenizer.encode(text, add_special_tokens=False)[:160])
        params.append(
            SamplingParams(
                max_tokens=rng.randint(4, 16), temperature=0.0, ignore_eos=True, logprobs=2
            )
        )
    return prompts, params


def run(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.fixture(scope="module")
def batched_llm(llm_factory):
    return llm_factory(**FP32, max_num_batched_tokens=4096)


@pytest.fixture(scope="module")
def batched(batched_llm, workload):
    """The reference run: every request in one engine with a 4096-token budget."""
    return run(batched_llm, *workload)


def assert_all_match(outs, refs, what):
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert_greedy_match(
            out.token_ids, from_logprobs(ref.token_ids, ref.logprobs), f"{what}, request {i}"
        )


def test_a_batch_of_16_equals_each_request_alone(llm_factory, workload, batched):
    prompts, params = workload
    alone_llm = llm_factory(**FP32, enable_prefix_caching=False)
    for i in ALONE:
        alone = run(alone_llm, [prompts[i]], [params[i]])[0]
        assert_greedy_match(
            batched[i].token_ids, from_logprobs(alone.token_ids, alone.logprobs), f"request {i}"
        )
        assert batched[i].finish_reason == "length"
        assert len(batched[i].token_ids) == params[i].max_tokens


def test_chunked_prefill_budget_32_equals_budget_4096(llm_factory, workload, batched):
    llm = llm_factory(**FP32, max_num_batched_tokens=32)
    assert_all_match(run(llm, *workload), batched, "budget 32")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forced_preemption_keeps_tokens(mode, llm_factory, workload, batched):
    # 40 blocks of 16 tokens hold about half of the workload at once.
    kwargs = dict(num_gpu_blocks=40, max_model_len=40 * 16, preemption_mode=mode)
    if mode == "swap":
        kwargs["num_cpu_blocks"] = 400
    llm = llm_factory(**FP32, **kwargs)
    before = llm.engine.stats().num_preemptions
    assert_all_match(run(llm, *workload), batched, f"preemption by {mode}")
    assert llm.engine.stats().num_preemptions > before


def test_prefix_cache_hit_keeps_tokens(batched_llm, workload, batched):
    """The batched engine still holds the prompts' blocks: a second pass reuses them."""
    prompts, params = workload
    again = run(batched_llm, [prompts[i] for i in ALONE], [params[i] for i in ALONE])
    for i, out in zip(ALONE, again):
        if len(prompts[i]) > 16:
            assert out.num_cached_tokens >= 16, f"request {i} found no cached block"
        assert_greedy_match(
            out.token_ids,
            from_logprobs(batched[i].token_ids, batched[i].logprobs),
            f"prefix hit, request {i}",
        )
