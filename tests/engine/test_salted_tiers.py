"""Cache salts down through the KV tiers, on a real model: a prefix evicted to the CPU tier or to
disk under one salt is loaded back for that salt and for no other (the tiers are keyed by block
hash, and a salted chain's hashes are its own)."""

from __future__ import annotations

import random

import pytest

from engine.llm import LLM
from scheduler import SamplingParams
from scheduler.request import EngineRequest

# 16 blocks of 16 tokens: two 200-token prompts evict everything an earlier prompt cached.
POOL = dict(num_gpu_blocks=16, max_model_len=256, max_num_batched_tokens=256)
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
PROMPT_BLOCKS = 6  # of the 100-token prompt, leaving its last token to compute


def run(llm: LLM, rid: str, prompt: list[int], salt: str | None) -> int:
    """Generate for one request to its end; its cached prompt tokens."""
    llm.engine.add_request(EngineRequest(rid, prompt, GREEDY, cache_salt=salt))
    while True:
        for out in llm.engine.step():
            if out.request_id == rid and out.finished:
                return out.num_cached_tokens


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_an_evicted_prefix_comes_back_for_its_own_salt_only(tier, tiny_model_dir, tmp_path):
    rng = random.Random(45)
    prompt, *evictors = [[rng.randrange(3, 2000) for _ in range(n)] for n in (100, 200, 200)]
    sizes = dict(num_cpu_tier_blocks=64)
    if tier == "disk":  # a CPU tier of two blocks: the prefix goes on to disk
        sizes = dict(num_cpu_tier_blocks=2, num_disk_tier_blocks=64, kv_disk_tier_dir=str(tmp_path))
    with LLM(tiny_model_dir, device="cpu", load_progress=False, **POOL, **sizes) as llm:
        assert run(llm, "a-first", prompt, "tenant-a") == 0
        for i, other in enumerate(evictors):  # the device pool forgets tenant a's blocks
            run(llm, f"evict-{i}", other, "tenant-c")
        loaded = llm.engine.stats().num_tier_loaded_blocks
        # Another salt, and no salt at all, find nothing in any tier: no block is loaded for them.
        assert run(llm, "b", prompt, "tenant-b") == 0
        assert run(llm, "unsalted", prompt, None) == 0
        assert llm.engine.stats().num_tier_loaded_blocks == loaded
        for i, other in enumerate(evictors):
            run(llm, f"evict-again-{i}", other, "tenant-c")
        # Tenant a's own prefix is still in the tier and comes back.
        assert run(llm, "a-again", prompt, "tenant-a") == PROMPT_BLOCKS * 16
        assert llm.engine.stats().num_tier_loaded_blocks >= loaded + PROMPT_BLOCKS
