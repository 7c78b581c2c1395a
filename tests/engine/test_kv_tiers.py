"""The prefix cache's lower tiers on a real model: a prefix evicted to the CPU tier or to disk is
loaded back, gives the tokens recomputation gives, and only the rest of the prompt is computed;
corrupt or missing block files are recomputed instead."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.executor import Executor, LocalExecutor
from engine.llm import LLM, GenerationOutput
from scheduler import ModelRunnerOutput, SamplingParams, SchedulerOutput
from workers.runner import RunnerConfig

# 16 blocks of 16 tokens: two 200-token prompts evict everything an earlier prompt cached.
POOL = dict(num_gpu_blocks=16, max_model_len=256, max_num_batched_tokens=256)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


class CountingExecutor:
    """The local executor, counting the tokens each request computes (the tiers' whole point)."""

    def __init__(self, runner_config: RunnerConfig) -> None:
        self.inner = LocalExecutor(runner_config)
        self.computed: dict[str, int] = {}

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid, n in out.num_scheduled_tokens.items():
            self.computed[rid] = self.computed.get(rid, 0) + n
        return self.inner.execute_model(out)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def counting(config: EngineConfig, runner_config: RunnerConfig) -> Executor:
    return CountingExecutor(runner_config)  # type: ignore[return-value]


def gen(llm: LLM, prompt: list[int]) -> GenerationOutput:
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(36)
    return [[rng.randrange(3, 2000) for _ in range(n)] for n in (100, 200, 200)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir, prompts) -> list[int]:
    """The second turn's tokens with nothing cached at all."""
    with LLM(tiny_model_dir, device="cpu", load_progress=False, **POOL) as llm:
        first = gen(llm, prompts[0]).token_ids
        return gen(llm, prompts[0] + first + [5] * 20).token_ids


def second_turn(llm: LLM, prompts: list[list[int]]) -> tuple[list[int], int, int]:
    """Run a prompt, evict it with two others, then its second turn: the tokens, the cached
    tokens and the prompt tokens computed for that second turn."""
    first = gen(llm, prompts[0]).token_ids
    llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    out = gen(llm, prompts[0] + first + [5] * 20)
    executor = llm.engine.executor
    assert isinstance(executor, CountingExecutor)
    decodes = len(out.token_ids) - 1  # the first token comes with the prompt's last chunk
    return out.token_ids, out.num_cached_tokens, executor.computed[out.request_id] - decodes


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_evicted_prefix_is_loaded_back_with_the_same_tokens(
    tier, tiny_model_dir, prompts, reference, tmp_path
):
    sizes = dict(num_cpu_tier_blocks=64)
    if tier == "disk":  # a CPU tier of two blocks: the prefix goes on to disk
        sizes = dict(num_cpu_tier_blocks=2, num_disk_tier_blocks=64, kv_disk_tier_dir=str(tmp_path))
    with LLM(
        tiny_model_dir,
        device="cpu",
        load_progress=False,
        executor_factory=counting,
        **POOL,
        **sizes,
    ) as llm:
        tokens, cached, computed = second_turn(llm, prompts)
        stats = llm.engine.stats()
        if tier == "disk":
            assert any(tmp_path.rglob("*.kvblock")), "no block reached the disk tier"
            assert stats.num_disk_tier_blocks > 0
        assert tokens == reference
        assert cached == 96  # the first turn's 6 full blocks came back from the tier
        assert computed == len(prompts[0]) + len(reference) + 20 - 96  # the rest of the prompt
        assert stats.num_tier_loaded_blocks >= 6 and stats.num_tier_failed_loads == 0
        assert stats.num_free_blocks == POOL["num_gpu_blocks"], "a block was not given back"
    assert not list(tmp_path.iterdir()), "the engine left its tier directory behind"


def test_damaged_block_files_are_recomputed(tiny_model_dir, prompts, reference, tmp_path):
    with LLM(
        tiny_model_dir,
        device="cpu",
        load_progress=False,
        executor_factory=counting,
        num_cpu_tier_blocks=1,
        num_disk_tier_blocks=64,
        kv_disk_tier_dir=str(tmp_path),
        **POOL,
    ) as llm:
        first = gen(llm, prompts[0]).token_ids
        llm.generate(prompts[1:], GREEDY, use_tqdm=False)
        files = sorted(tmp_path.rglob("*.kvblock"))
        assert len(files) >= 4
        for i, path in enumerate(files):  # every kind of damage, each to a quarter of the files
            spoil(path, DAMAGE[i % len(DAMAGE)])
        out = gen(llm, prompts[0] + first + [5] * 20)
        assert out.token_ids == reference
        stats = llm.engine.stats()
        assert stats.num_tier_failed_loads > 0
        assert stats.num_free_blocks == POOL["num_gpu_blocks"]


DAMAGE = ("flip", "truncate", "delete", "garbage")


def spoil(path: Path, damage: str) -> None:
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-1] ^= 0xFF
        path.write_bytes(data)
    elif damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "delete":
        path.unlink()
    else:
        path.write_bytes(b"not a KV block" * 100)


def test_tier_settings_are_checked():
    with pytest.raises(ValueError, match="kv_cpu_tier_gb"):
        EngineConfig(kv_cpu_tier_gb=-1)
    with pytest.raises(ValueError, match="kv_disk_tier_gb"):
        EngineConfig(kv_disk_tier_gb=float("nan"))
    with pytest.raises(ValueError, match="kv_disk_tier_dir"):
        EngineConfig(kv_disk_tier_dir="x" * 10_000_000)
    with pytest.raises(ValueError, match="num_disk_tier_blocks"):
        EngineConfig.from_kwargs(num_disk_tier_blocks=4)
    with pytest.raises(ValueError, match="num_cpu_tier_blocks"):
        EngineConfig.from_kwargs(num_cpu_tier_blocks=2**64)
    with pytest.raises(ValueError, match="num_cpu_tier_blocks"):
        EngineConfig.from_kwargs(num_cpu_tier_blocks=4, enable_prefix_caching=False)
