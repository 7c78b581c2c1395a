"""Pipeline parallelism over Ray workers (gloo on CPU) gives Hugging Face's greedy tokens: PP=2,
PP=3 (an explicit uneven split) and PP=2 x TP=3, under chunked prefill, preemption and prefix
caching, offline through LLM and served through the replica's engine loop."""

from __future__ import annotations

import asyncio

import pytest
import torch

from cluster.engine_loop import EngineLoop
from cluster.ray_executor import RayExecutor, ray_executor
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.executor import LocalExecutor
from engine.llm import LLM
from scheduler import EngineRequest, SamplingParams, SchedulerConfig
from tests.cluster.engine_driver import greedy_tokens
from tests.random_checkpoint import write_random_checkpoint
from tests.workers.greedy import Greedy, assert_greedy_match, hf_greedy
from tests.workers.test_pipeline_split import TINY_PP_LLAMA

pytestmark = pytest.mark.slow

MAX_LEN = 128
MAX_TOKENS = 10
# Lengths 9 to 33: a prompt longer than the cramped budget is prefilled in chunks.
PROMPTS = [[1 + (13 * i + 7 * j) % 240 for j in range(9 + 12 * i)] for i in range(3)]
# Turn two: the first prompt's 32-token prefix again (two full blocks), then new tokens.
SECOND_TURN = [PROMPTS[2][:32] + [5, 9, 3, 77]]
# 14 tokens each: prefilled in two chunks of an 8-token budget, then each needs a second block
# by its third token, more than a 4-block pool holds for three requests.
CRAMPED = [[1 + (17 * i + 5 * j) % 240 for j in range(14)] for i in range(3)]
# (tensor_parallel_size, pipeline_parallel_size, pipeline_layer_split) over the 6-layer model
LAYOUTS = {"pp2": (1, 2, None), "pp3-split-1-3-2": (1, 3, [1, 3, 2]), "pp2-tp3": (3, 2, None)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return write_random_checkpoint(TINY_PP_LLAMA, str(tmp_path_factory.mktemp("tiny-pp"))).path


@pytest.fixture(scope="module")
def hf_tokens(tiny) -> dict[tuple[int, ...], Greedy]:
    """Hugging Face's greedy continuation of every prompt the tests send, by prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    return {tuple(p): hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS + SECOND_TURN + CRAMPED}


def engine_config(model: str, tp: int, pp: int, split: list[int] | None, **kw) -> EngineConfig:
    return EngineConfig.from_kwargs(
        model=model,
        device="cpu",
        load_progress=False,
        kv_cache_memory_gb=0.05,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        pipeline_layer_split=split,
        **kw,
    )


def assert_hf(tokens: dict[str, list[int]], prompts: list[list[int]], hf, prefix: str) -> None:
    for i, prompt in enumerate(prompts):
        assert_greedy_match(tokens[f"{prefix}-{i}"], hf[tuple(prompt)], f"{prefix}-{i}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_stages_give_hf_greedy_tokens_under_chunking_preemption_and_prefix_hits(
    ray_cluster, tiny, hf_tokens, layout
):
    tp, pp, split = LAYOUTS[layout]
    config = engine_config(tiny, tp, pp, split)
    local = LocalExecutor(engine_config(tiny, 1, 1, None).runner_config(tiny, MAX_LEN))
    whole = local.determine_num_blocks()
    local.shutdown()
    executor = RayExecutor(config.runner_config(tiny, MAX_LEN), config.world_size)
    try:
        # A rank's pool holds its stage's layers and its share of the 3 KV heads: the same
        # kv_cache_memory_gb gives 6 / (the fullest stage's layers) x tp times the blocks.
        ratio = 6 // max(split or [6 // pp]) * tp
        assert 0 <= executor.determine_num_blocks() - ratio * whole <= ratio
        executor.init_kv_cache(64, 0)
        roomy = SchedulerConfig(num_gpu_blocks=64, max_model_len=MAX_LEN)
        tokens, scheduler = greedy_tokens(executor, roomy, PROMPTS, MAX_TOKENS, prefix="roomy")
        assert_hf(tokens, PROMPTS, hf_tokens, "roomy")
        # The same scheduler (its prefix cache) sees the first prompt's prefix again.
        tokens, _ = greedy_tokens(
            executor, roomy, SECOND_TURN, MAX_TOKENS, prefix="turn2", scheduler=scheduler
        )
        assert scheduler.stats().num_prompt_tokens_hit >= 32
        assert_hf(tokens, SECOND_TURN, hf_tokens, "turn2")
        # An 8-token budget (prompts in chunks), 4 blocks for 3 requests needing 6 (preemption).
        cramped = SchedulerConfig(
            num_gpu_blocks=4, max_model_len=64, max_num_batched_tokens=8, max_num_seqs=3
        )
        tokens, scheduler = greedy_tokens(executor, cramped, CRAMPED, MAX_TOKENS, prefix="cramped")
        assert scheduler.stats().num_preemptions > 0
        assert_hf(tokens, CRAMPED, hf_tokens, "cramped")
    finally:
        executor.shutdown()


def test_llm_with_pipeline_stages_generates_hf_greedy_tokens(tiny, hf_tokens):
    """Offline with no executor named: a spawned process per rank (engine/backends.py); the Ray
    executor's factory runs in the served test and the SmolLM2 one."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    stages = 3
    with LLM(
        model=tiny,
        device="cpu",
        load_progress=False,
        kv_cache_memory_gb=0.05,
        max_model_len=MAX_LEN,
        pipeline_parallel_size=stages,
    ) as llm:
        assert llm.engine.executor.pids and len(llm.engine.executor.pids) == stages
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert_greedy_match(out.token_ids, hf_tokens[tuple(prompt)], str(prompt[:4]))


def test_served_engine_loop_with_stages_streams_hf_greedy_tokens(ray_cluster, tiny, hf_tokens):
    """The replica's engine loop over an EngineCore of PP=2 Ray workers (the replica's factory)."""
    engine = EngineCore(engine_config(tiny, 1, 2, None, max_model_len=MAX_LEN), ray_executor)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    async def go() -> dict[str, list[int]]:
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
        done = {rid: asyncio.Event() for rid in tokens}
        errors: list[BaseException] = []

        def on_step(outputs, stats) -> None:
            for out in outputs:
                tokens[out.request_id].extend(out.new_token_ids)
                if out.finished:
                    done[out.request_id].set()

        def on_error(rid, exc) -> None:
            errors.append(exc)
            for event in done.values():
                event.set()

        loop = EngineLoop(engine, asyncio.get_running_loop(), on_step, on_error)
        try:
            for i, prompt in enumerate(PROMPTS):
                loop.add(EngineRequest(f"r{i}", prompt, params))
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in done.values())), 300)
        finally:
            loop.stop()
        assert not errors, errors
        return tokens

    try:
        tokens = asyncio.run(go())
    finally:
        engine.shutdown()
    for i, prompt in enumerate(PROMPTS):
        assert_greedy_match(tokens[f"r{i}"], hf_tokens[tuple(prompt)], f"r{i}")


def test_smollm2_in_two_stages_gives_hf_greedy_tokens(ray_cluster, hf_smollm2, smollm2_tokenizer):
    """The embedded SmolLM2 de-quantized to fp32 (the path transformers shares; 30 layers, tied
    embeddings): the default split, 18 and 12 layers, the last stage also holding the LM head
    (workers/pipeline_cost.py) (PP x TP runs on the tiny model: six ranks loading
    SmolLM2 on a 2-core CI machine cost minutes)."""
    prompts = [smollm2_tokenizer.encode("The capital of France is")]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(
        model="default",
        quantization="none",
        device="cpu",
        load_progress=False,
        kv_cache_memory_gb=0.05,
        max_model_len=MAX_LEN,
        pipeline_parallel_size=2,
        executor_factory=ray_executor,
    ) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert_greedy_match(out.token_ids, hf_greedy(hf_smollm2, prompt, MAX_TOKENS), str(prompt))
