"""DeepSeek (multi-head latent attention) with the engine's features: the prefix cache's CPU and
disk tiers hold latent blocks (one part a layer, not K and V), a latent draft model proposes for a
latent target on the target's own backend rule, LoRA is refused by name, and the KV bytes a token
takes are the latent row's, as the allocated pool holds them.

The checkpoints are tests/random_checkpoint.py's TINY_DEEPSEEK (fp32, the SmolLM2 tokenizer).
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.llm import LLM, GenerationOutput
from scheduler import SamplingParams
from tests.random_checkpoint import TINY_DEEPSEEK, write_random_checkpoint
from tests.workers.greedy import assert_greedy_match, hf_greedy
from workers.draft import DraftModel, ProposerSetup
from workers.features.draft import DraftFeature

pytestmark = pytest.mark.slow

# 16 blocks of 16 tokens: two 110-token prompts evict everything an earlier prompt cached.
POOL = dict(num_gpu_blocks=16, max_model_len=128, max_num_batched_tokens=128)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
# TINY_DEEPSEEK: 3 layers, kv_lora_rank 48 + qk_rope_head_dim 16, 4 heads of qk 32 and v 24, fp32
LATENT_BYTES = 3 * (48 + 16) * 4
EXPANDED_BYTES = 3 * 4 * (32 + 24) * 4


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory, smollm2_tokenizer):
    """family -> checkpoint directory, written once per module."""
    made: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in made:
            path = str(tmp_path_factory.mktemp(f"tiny-{family}"))
            seed = sum(map(ord, family))
            write_random_checkpoint(
                TINY_DEEPSEEK[family], path, seed=seed, tokenizer=smollm2_tokenizer
            )
            made[family] = path
        return made[family]

    return get


def engine(path: str, **kwargs) -> LLM:
    return LLM(path, dtype="float32", device="cpu", load_progress=False, **POOL, **kwargs)


@pytest.fixture(scope="module")
def plain(deepseek):
    """V3 with no tier and no draft: the tokens every feature below must keep."""
    with engine(deepseek("deepseek_v3")) as llm:
        yield llm


def gen(llm: LLM, prompt: list[int]) -> GenerationOutput:
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0]


@pytest.fixture(scope="module")
def turns(deepseek):
    """A 40-token prompt, two 110-token prompts that evict it, and its second turn (the first
    turn's prompt and transformers' tokens, then 20 more), with transformers' tokens for it."""
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(deepseek("deepseek_v3"), dtype=torch.float32)
    rng = random.Random(48)
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in (40, 110, 110)]
    first = hf_greedy(hf_model.eval(), prompts[0], GREEDY.max_tokens)
    second = prompts[0] + first.token_ids + [5] * 20
    return prompts, first, second, hf_greedy(hf_model, second, GREEDY.max_tokens)


@pytest.fixture(scope="module")
def tierless(plain, turns) -> list[int]:
    """The second turn's tokens with nothing cached."""
    out = gen(plain, turns[2])
    assert out.num_cached_tokens == 0
    return out.token_ids


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_latent_blocks_go_to_a_tier_and_come_back_with_the_same_tokens(
    tier, deepseek, turns, tierless, tmp_path
):
    """The CPU tier sized in GiB (its blocks shaped from the latent layout), or a CPU tier of two
    blocks in front of a disk tier sized in GiB: the evicted prefix is loaded back from the tier
    (2 blocks of latent rows) and the tokens are the tier-less engine's and transformers'."""
    prompts, first, second, ref = turns
    sizes: dict = dict(kv_cpu_tier_gb=0.001)
    if tier == "disk":
        sizes = dict(num_cpu_tier_blocks=2, kv_disk_tier_gb=0.001, kv_disk_tier_dir=str(tmp_path))
    with engine(deepseek("deepseek_v3"), **sizes) as llm:
        assert_greedy_match(gen(llm, prompts[0]).token_ids, first, "first turn")
        llm.generate(prompts[1:], GREEDY, use_tqdm=False)
        out = gen(llm, second)
        stats = llm.engine.stats()
        if tier == "disk":
            files = list(tmp_path.rglob("*.kvblock"))
            assert files and stats.num_disk_tier_blocks > 0, "no block reached the disk tier"
        assert out.num_cached_tokens == 32  # the first turn's 2 full blocks, from the tier
        assert stats.num_tier_loaded_blocks >= 2 and stats.num_tier_failed_loads == 0
        assert stats.num_free_blocks == POOL["num_gpu_blocks"], "a block was not given back"
    assert out.token_ids == tierless
    assert_greedy_match(out.token_ids, ref, f"deepseek_v3 {tier} tier hit")


def test_a_latent_draft_proposes_for_a_latent_target_and_keeps_plain_tokens(deepseek, plain):
    """V2 drafts for V3 (both MLA): proposals are verified, the tokens are plain decoding's, and the
    draft attends on the backend the target's rule chose for latent rows."""
    prompts = [list(range(300, 345)), [(7 * i) % 40000 + 100 for i in range(30)]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = dict(method="draft", num_tokens=3, min_acceptance_rate=0.0)
    spec["draft_model"] = deepseek("deepseek_v2")
    with LLM(
        deepseek("deepseek_v3"),
        dtype="float32",
        device="cpu",
        load_progress=False,
        max_model_len=128,
        speculative=spec,
    ) as llm:
        got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        proposed = llm.engine.stats().num_spec_proposed_tokens
        runner = llm.engine.executor.runner  # type: ignore[attr-defined]
        draft_model = runner.feature(DraftFeature).draft
        assert draft_model.kv_spec.kv_parts == 1
        assert draft_model.backend.name == runner.backend.name == "torch"
    assert got == want
    assert proposed > 0


def test_a_latent_draft_refuses_a_backend_latent_rows_cannot_run(deepseek):
    """The draft applies the target's latent rule (workers/layers/mla.py bind_backend), so a
    latent draft on the Triton backend is refused by name, as its target would be."""
    with pytest.raises(ValueError, match="attention_backend: 'triton' .* latent attention"):
        setup = ProposerSetup(torch.float32, torch.device("cpu"), 16, 256, "triton", 3, 4)
        DraftModel(deepseek("deepseek_v2"), None, setup)


@pytest.mark.parametrize("lora", [dict(max_loras=1), dict(lora_modules={"a": "/nonexistent"})])
def test_lora_on_a_latent_model_is_refused_at_start_by_name(deepseek, lora):
    with pytest.raises(ValueError, match=r"max_loras: LoRA is not supported for DeepseekV3ForCa"):
        LLM(deepseek("deepseek_v3"), device="cpu", load_progress=False, **lora)


def test_kv_bytes_per_token_are_the_latent_rows_the_pool_holds(plain):
    """What the engine reports (the log, /metrics' raylm_kv_cache_bytes_per_token) is what its
    allocated pool spends a token: the latent row, several times less than expanded K/V heads."""
    llm = plain
    pool = llm.engine.executor.runner.kv_cache.gpu
    per_block = pool[:, :, 0].numel() * pool.element_size()
    assert llm.engine.kv_bytes_per_token == per_block // llm.engine.config.block_size
    assert llm.engine.kv_bytes_per_token == LATENT_BYTES < EXPANDED_BYTES / 3
