"""DeepSeek-V2 and DeepSeek-V3 (multi-head latent attention, grouped expert routing) and GLM-4-MoE
(DeepSeek-V3's MoE block under partial-rotary Llama attention): greedy output equals Hugging Face
transformers' greedy generate on the same random checkpoint (fp32), batched, under chunked
prefill, after a prefix-cache hit, and under preemption (recompute and swap).

The checkpoints are tests/random_checkpoint.py's TINY_DEEPSEEK: V2-Lite-shaped (no query
compression, softmax group-limited routing, two shared experts) and V3-shaped (q_lora_rank,
sigmoid routing with a random correction bias, renormalised and scaled top-k), both with a dense
first layer, YaRN with DeepSeek's mscale and interleaved rotary pairs. A token may differ only at
a true near-tie (tests/workers/greedy.py). GLM-4-MoE's is TINY_GLM4_MOE: rotary on half of each
head, q/k/v bias, q/k norms.
"""

from __future__ import annotations

import pytest
import torch

from scheduler import SamplingParams
from tests.random_checkpoint import TINY_DEEPSEEK, TINY_GLM4_MOE, write_random_checkpoint
from tests.workers.greedy import Greedy, assert_greedy_match, hf_greedy
from tests.workers.test_hf_parity import TEXTS

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
FAMILIES = ("deepseek_v2", "deepseek_v3", "glm4_moe")
SPECS = {**TINY_DEEPSEEK, "glm4_moe": TINY_GLM4_MOE}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, smollm2_tokenizer):
    """family -> (checkpoint directory, the Hugging Face model), written once per module."""
    from transformers import AutoModelForCausalLM

    made: dict[str, tuple[str, torch.nn.Module]] = {}

    def get(family: str) -> tuple[str, torch.nn.Module]:
        if family not in made:
            path = str(tmp_path_factory.mktemp(f"tiny-{family}"))
            seed = sum(map(ord, family))
            spec = SPECS[family]
            write_random_checkpoint(spec, path, seed=seed, tokenizer=smollm2_tokenizer)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            made[family] = (path, model)
        return made[family]

    return get


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[list[int]]:
    """A short text and prompts of 45 and 70 tokens (several blocks of 16)."""
    return [
        smollm2_tokenizer.encode(TEXTS[1]),
        list(range(300, 345)),
        [(7 * i) % 40000 + 100 for i in range(70)],
    ]


@pytest.fixture(scope="module")
def references(checkpoint, prompts):
    """family -> Hugging Face's greedy continuation of every prompt (computed once)."""
    made: dict[str, list[Greedy]] = {}

    def get(family: str) -> list[Greedy]:
        if family not in made:
            _, hf_model = checkpoint(family)
            made[family] = [hf_greedy(hf_model, p, MAX_TOKENS) for p in prompts]
        return made[family]

    return get


def assert_matches(outs, refs, what: str) -> None:
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert_greedy_match(out.token_ids, ref, f"{what}, prompt {i}")


def chunked_llm(llm_factory, path: str):
    """An engine that prefills in chunks of at most 16 tokens, with room for every request."""
    return llm_factory(model=path, dtype="float32", max_num_batched_tokens=16, max_model_len=256)


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_chunked_greedy_matches_hf_generate_and_again_from_the_prefix_cache(
    family, checkpoint, llm_factory, prompts, references
):
    """The prompts batched in 16-token chunks, then the 70- and 45-token ones again: they start
    from their cached full blocks (64 and 32 tokens; latent rows for MLA), compute the rest, and
    still give HF's tokens (one engine and one set of references for both halves)."""
    path, _ = checkpoint(family)
    llm = chunked_llm(llm_factory, path)
    assert_matches(llm.generate(prompts, PARAMS, use_tqdm=False), references(family), family)
    assert llm.engine.expert_load()[0] > 0  # the MoE layers routed every token
    again = llm.generate([prompts[2], prompts[1]], PARAMS, use_tqdm=False)
    assert [out.num_cached_tokens for out in again] == [64, 32]
    refs = references(family)
    assert_matches(again, [refs[2], refs[1]], f"{family} prefix hit")


@pytest.mark.parametrize("family,mode", [("deepseek_v2", "recompute"), ("deepseek_v3", "swap")])
def test_chunked_prefill_and_preemption_keep_hf_tokens(
    family, mode, checkpoint, llm_factory, prompts, references
):
    """A 16-token budget splits every long prompt across steps, and 8 blocks of 16 tokens cannot
    hold the 70- and 45-token requests as both grow (longest first, they are admitted together),
    so one is evicted and resumed: its latent rows swapped out and back in, or recomputed.
    (GLM-4-MoE caches plain K and V, whose preemption the Llama families prove; its routing is
    V3's, proven above.)"""
    path, _ = checkpoint(family)
    kwargs: dict = dict(num_gpu_blocks=8, max_model_len=8 * 16, preemption_mode=mode)
    if mode == "swap":
        kwargs["num_cpu_blocks"] = 64
    llm = llm_factory(model=path, dtype="float32", max_num_batched_tokens=16, **kwargs)
    before = llm.engine.stats().num_preemptions
    outs = llm.generate(prompts[::-1], PARAMS, use_tqdm=False)
    assert_matches(outs, references(family)[::-1], f"{family} {mode}")
    assert llm.engine.stats().num_preemptions > before


def test_the_correction_bias_changes_what_v3_generates(checkpoint, prompts, references):
    """With its e_score_correction_bias zeroed the same V3 weights route differently and continue
    some prompt differently, so V3's parity above is a test of noaux_tc's bias."""
    _, hf_model = checkpoint("deepseek_v3")
    gates = [layer.mlp.gate for layer in hf_model.model.layers[1:]]
    saved = [g.e_score_correction_bias.clone() for g in gates]
    try:
        for g in gates:
            g.e_score_correction_bias.zero_()
        plain = [hf_greedy(hf_model, p, MAX_TOKENS).token_ids for p in prompts[1:]]
    finally:
        for g, old in zip(gates, saved, strict=True):
            g.e_score_correction_bias.copy_(old)
    assert plain != [r.token_ids for r in references("deepseek_v3")[1:]]


def test_group_limits_change_what_v2_generates(checkpoint, prompts, references):
    """With every group allowed (topk_group = n_group) the same V2 weights pick other experts and
    continue some prompt differently, so V2's parity above is a test of the group limit."""
    _, hf_model = checkpoint("deepseek_v2")
    gates = [layer.mlp.gate for layer in hf_model.model.layers[1:]]
    try:
        for g in gates:
            g.topk_group = g.num_group
        free = [hf_greedy(hf_model, p, MAX_TOKENS).token_ids for p in prompts[1:]]
    finally:
        for g in gates:
            g.topk_group = hf_model.config.topk_group
    assert free != [r.token_ids for r in references("deepseek_v2")[1:]]
