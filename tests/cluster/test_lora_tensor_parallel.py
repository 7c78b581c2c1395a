"""LoRA adapters under tensor parallelism (Ray workers, gloo on CPU) give the tokens of one process.

TP=2 over a tiny Llama with 4 query heads and one KV head covers every way an adapter is sliced: q
rows split by head, k and v rows of the one KV head replicated on both ranks, gate/up rows split,
and the row-parallel o and down projections' A split by columns with their partial updates
all-reduced."""

from __future__ import annotations

import os

import pytest

from scheduler import SamplingParams
from tests.random_checkpoint import random_prompts
from tests.random_lora import write_random_lora

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def make_llm(model_dir: str, modules: dict[str, str], tp: int):
    from cluster.ray_executor import ray_executor
    from engine.executor import local_executor
    from engine.llm import LLM

    return LLM(
        model=model_dir,
        tensor_parallel_size=tp,
        device="cpu",
        load_progress=False,
        kv_cache_memory_gb=0.05,
        max_model_len=128,
        max_loras=2,
        lora_modules=modules,
        executor_factory=ray_executor if tp > 1 else local_executor,
    )


def test_tp2_with_adapters_gives_the_tokens_of_tp1(ray_cluster, tiny_checkpoint, tmp_path):
    model_dir, _ = tiny_checkpoint("llama_mqa")
    modules = {
        "all": write_random_lora(model_dir, str(tmp_path / "all"), seed=31, rank=8),
        "qv": write_random_lora(
            model_dir,
            str(tmp_path / "qv"),
            seed=32,
            rank=4,
            use_rslora=True,
            targets=["q_proj", "v_proj"],
        ),
        "mlp": write_random_lora(
            model_dir,
            str(tmp_path / "mlp"),
            seed=33,
            rank=16,
            targets=["gate_proj", "up_proj", "down_proj", "o_proj"],
        ),
    }
    assert all(os.path.isdir(p) for p in modules.values())
    prompts = random_prompts(2, 256, 10, 20, seed=5)
    names = [None, "all", "qv", "mlp"]
    batch = [p for p in prompts for _ in names]
    loras = names * len(prompts)
    with make_llm(model_dir, modules, 1) as one:
        expected = [o.token_ids for o in one.generate(batch, PARAMS, use_tqdm=False, lora=loras)]
    with make_llm(model_dir, modules, 2) as tp2:
        tokens = [o.token_ids for o in tp2.generate(batch, PARAMS, use_tqdm=False, lora=loras)]
    assert tokens == expected
    assert len({tuple(t) for t in expected}) == len(expected)  # each adapter changed the tokens
