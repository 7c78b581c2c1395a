"""The disk tier's files under a real engine: private (0600 files in 0700 directories), and a
block file someone rewrote with a zeroed payload and a checksum of their own is a miss: the
prefix is recomputed and the tokens are those of an engine with no tiers at all."""

from __future__ import annotations

import random
import stat
from pathlib import Path

import pytest

from engine.llm import LLM
from scheduler import SamplingParams
from tests.workers.test_kv_disk import forge
from workers.kv_disk import OVERHEAD_BYTES

pytestmark = pytest.mark.slow  # loads a model

# 16 blocks of 16 tokens: two 200-token prompts evict everything the first one cached.
POOL = dict(num_gpu_blocks=16, max_model_len=256, max_num_batched_tokens=256)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
RNG = random.Random(45)
PROMPTS = [[RNG.randrange(3, 2000) for _ in range(n)] for n in (100, 200, 200)]


def two_turns(llm: LLM, between=lambda: None) -> list[int]:
    """The first prompt, two that evict it, `between()`, then the first's second turn."""
    first = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].token_ids
    llm.generate(PROMPTS[1:], GREEDY, use_tqdm=False)
    between()
    second = PROMPTS[0] + first + [5] * 20
    return llm.generate([second], GREEDY, use_tqdm=False)[0].token_ids


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_forged_block_files_are_misses_and_recomputed(tiny_model_dir, tmp_path):
    with LLM(tiny_model_dir, device="cpu", load_progress=False, **POOL) as llm:
        reference = two_turns(llm)
    root = tmp_path / "kv-tier"
    with LLM(
        tiny_model_dir,
        device="cpu",
        load_progress=False,
        num_cpu_tier_blocks=1,
        num_disk_tier_blocks=64,
        kv_disk_tier_dir=str(root),
        **POOL,
    ) as llm:
        files: list[Path] = []

        def forge_every_block() -> None:
            files.extend(root.rglob("*.kvblock"))
            for path in files:
                assert (
                    mode(path) == 0o600 and mode(path.parent) == mode(path.parent.parent) == 0o700
                )
                forge(path, bytes(path.stat().st_size - OVERHEAD_BYTES))  # zeroed KV

        tokens = two_turns(llm, forge_every_block)
        assert len(files) >= 6  # the first prompt's blocks went to disk
        assert tokens == reference
        assert llm.engine.stats().num_tier_failed_loads > 0
    assert not list(root.iterdir()), "the engine left its tier directory behind"
