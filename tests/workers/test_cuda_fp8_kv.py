"""The FP8 KV cache on a real GPU, through the engine: twice the blocks at the same
gpu_memory_utilization, and greedy tokens close to a bf16 cache's (CUDA graphs, chunked prefill,
prefix-cache hits). Skipped without a GPU; run there with `python -m pytest
tests/workers/test_cuda_fp8_kv.py` (the kernel's own parity is in test_triton_fp8_kv.py, which
runs compiled on a GPU)."""

from __future__ import annotations

import pytest
import torch

from scheduler import SamplingParams
from tests.random_checkpoint import SHAPES, random_prompts, write_random_checkpoint
from tests.workers.test_cuda import make_llm, shutdown

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_fp8_cache_doubles_the_blocks_and_keeps_greedy_tokens(tmp_path):
    path = write_random_checkpoint(SHAPES["llama3-1b"], str(tmp_path), device="cuda").path
    if torch.cuda.get_device_capability() < (8, 9):
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            make_llm(path, "bfloat16", kv_cache_dtype="fp8")
        return
    # Prompts longer than the 128-token budget (chunked) and two sharing a 256-token prefix.
    shared = random_prompts(1, 128000, 256, 256, seed=2)[0]
    prompts = random_prompts(6, 128000, 20, 400, seed=1)
    prompts += [shared + p for p in random_prompts(2, 128000, 10, 40, seed=3)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    blocks, tokens = {}, {}
    for kv in ("auto", "fp8"):
        llm = make_llm(
            path, "bfloat16", kv_cache_dtype=kv, num_gpu_blocks=None, gpu_memory_utilization=0.3
        )
        try:
            runner = llm.engine.executor.runner
            assert runner.graphs is not None and runner.backend.name == "triton"
            blocks[kv] = llm.engine.num_gpu_blocks
            tokens[kv] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            shutdown(llm)
    assert blocks["fp8"] >= 1.9 * blocks["auto"], blocks
    # Tokens equal up to the first divergence; a random model's near-ties let FP8 rounding change
    # a token, but a misread cache changes nearly all of them.
    same = []
    for a, b in zip(tokens["auto"], tokens["fp8"], strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        same.append(n / len(a))
    print(f"blocks {blocks}; share of each continuation before it parts: {same}")
    assert sum(same) / len(same) >= 0.5, same
