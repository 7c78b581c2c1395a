"""Tensor parallelism over Ray workers (gloo on CPU) yields the greedy tokens of a single
process."""

from __future__ import annotations

import pytest
import torch

from cluster.ray_executor import RayExecutor
from engine.config import EngineConfig
from engine.executor import LocalExecutor
from scheduler import SchedulerConfig
from tests.cluster.engine_driver import greedy_tokens
from workers.runner import RunnerConfig

pytestmark = pytest.mark.slow

MAX_LEN = 128
NUM_BLOCKS = 64
TINY_PROMPTS = [[1 + (11 * i + 3 * j) % 240 for j in range(7 + 5 * i)] for i in range(3)]
SMOL_TEXTS = [
    "The capital of France is",
    "Write a haiku about the sea:",
    "1, 2, 3, 4,",
    "In machine learning, a transformer is a model that",
]


def runner_config(model_dir: str) -> RunnerConfig:
    config = EngineConfig(
        model=model_dir, device="cpu", load_progress=False, kv_cache_memory_gb=0.05
    )
    return config.runner_config(model_dir, MAX_LEN)


def roomy() -> SchedulerConfig:
    """Every prompt prefilled in one step, no preemption."""
    return SchedulerConfig(num_gpu_blocks=NUM_BLOCKS, max_model_len=MAX_LEN)


def cramped() -> SchedulerConfig:
    """8-token budget (prompts are prefilled in chunks) and 9 blocks for 4 requests (forced
    preemption)."""
    return SchedulerConfig(
        num_gpu_blocks=9, max_model_len=MAX_LEN, max_num_batched_tokens=8, max_num_seqs=4
    )


def started(executor):
    executor.init_kv_cache(NUM_BLOCKS, 0)
    return executor


@pytest.fixture(scope="module")
def one_thread():
    """The in-process reference runs on one thread, as each CPU worker does on this 2-core
    machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_tp4_replicates_kv_heads_and_gives_the_greedy_tokens_of_tp1(
    ray_cluster, tiny_llama, one_thread
):
    local = started(LocalExecutor(runner_config(tiny_llama)))
    expected, _ = greedy_tokens(local, roomy(), TINY_PROMPTS, max_tokens=16)
    tp4 = RayExecutor(runner_config(tiny_llama), 4)
    try:
        # 2 KV heads over 4 ranks: each rank holds one (replicated) head, half a TP=1 block.
        assert 0 <= tp4.determine_num_blocks() - 2 * local.determine_num_blocks() <= 1
        tokens, _ = greedy_tokens(started(tp4), roomy(), TINY_PROMPTS, max_tokens=16)
    finally:
        tp4.shutdown()
        local.shutdown()
    assert tokens == expected


@pytest.fixture(scope="module")
def smol_prompts() -> list[list[int]]:
    from workers.model_files import load_tokenizer

    tokenizer = load_tokenizer("default")
    return [tokenizer.encode(text) for text in SMOL_TEXTS]


@pytest.fixture(scope="module")
def smol_dir() -> str:
    from workers.model_files import resolve_model

    return resolve_model("default")


@pytest.fixture(scope="module")
def smol_expected(smol_dir, smol_prompts, one_thread) -> dict[int, list[int]]:
    """SmolLM2 greedy tokens of a single process, whole prompts at once, by prompt index."""
    local = started(LocalExecutor(runner_config(smol_dir)))
    tokens, _ = greedy_tokens(local, roomy(), smol_prompts, max_tokens=32)
    local.shutdown()
    return _by_index(tokens)


@pytest.fixture(scope="module")
def smol_tp3(ray_cluster, smol_dir):
    """SmolLM2 (9 heads, 3 KV heads) over 3 ranks: 3 heads and 1 KV head each."""
    executor = started(RayExecutor(runner_config(smol_dir), 3))
    yield executor
    executor.shutdown()


def _by_index(tokens: dict[str, list[int]]) -> dict[int, list[int]]:
    return {int(rid.rsplit("-", 1)[1]): t for rid, t in tokens.items()}


def test_smollm2_tp3_gives_the_greedy_tokens_of_tp1(smol_tp3, smol_prompts, smol_expected):
    tokens, _ = greedy_tokens(smol_tp3, roomy(), smol_prompts, max_tokens=32, prefix="roomy")
    assert _by_index(tokens) == smol_expected


def test_smollm2_tp3_under_chunked_prefill_and_preemption_gives_the_same_tokens(
    smol_tp3, smol_prompts, smol_expected
):
    config = cramped()
    assert max(map(len, smol_prompts)) > config.max_num_batched_tokens  # some prompt is chunked
    tokens, scheduler = greedy_tokens(
        smol_tp3, config, smol_prompts, max_tokens=32, prefix="cramped"
    )
    assert scheduler.stats().num_preemptions > 0
    assert _by_index(tokens) == smol_expected


def test_llm_with_tensor_parallel_size_2_generates_what_one_process_does(
    ray_cluster, tiny_checkpoint, one_thread
):
    from cluster.ray_executor import ray_executor
    from engine.executor import local_executor
    from engine.llm import LLM
    from scheduler import SamplingParams

    model_dir, _ = tiny_checkpoint("llama")  # 4 heads, 2 KV heads, with a tokenizer
    prompts = [[1 + (11 * i + 3 * j) % 1000 for j in range(6 + 4 * i)] for i in range(3)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = {}
    for tp in (1, 2):
        llm = LLM(
            model=model_dir,
            tensor_parallel_size=tp,
            device="cpu",
            load_progress=False,
            kv_cache_memory_gb=0.05,
            max_model_len=MAX_LEN,
            executor_factory=ray_executor if tp > 1 else local_executor,
        )
        try:
            tokens[tp] = [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.shutdown()
    assert tokens[2] == tokens[1]
    assert all(len(t) == 12 for t in tokens[2])


@pytest.mark.parametrize("device, backend", [("cpu", "gloo"), ("cuda", "nccl"), ("cuda:3", "nccl")])
def test_the_collective_backend_follows_the_device(device, backend):
    from workers.distributed import backend_for

    assert backend_for(device) == backend
