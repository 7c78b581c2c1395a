"""Mixture-of-experts families (gpt-oss too), a sliding-window Mistral, Phi-3 and Gemma 2/3:
greedy output equals Hugging Face transformers' greedy generate on the same random checkpoint
(fp32), batched, under chunked prefill and under preemption (recompute and swap).

The checkpoints come from tests/random_checkpoint.py (TINY_MOE_FAMILIES: 8 experts, top-2 and
top-4, Qwen2-MoE's shared expert; TINY_SLIDING_MISTRAL: a 24-token window on every layer;
TINY_GEMMA: a 24-token window on one of two layers, Gemma 2's attention soft-cap; TINY_GPT_OSS:
the same window, sinks, biased router and experts, a clamped SwiGLU). Half of the
prompts run well past the window. A token may differ only at a true near-tie
(tests/workers/greedy.py).
"""

from __future__ import annotations

import pytest
import torch

from scheduler import SamplingParams
from tests.workers.greedy import Greedy, assert_greedy_match, hf_greedy
from tests.workers.test_hf_parity import CHATS, TEXTS, chat_ids

pytestmark = pytest.mark.slow

MAX_TOKENS = 20
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[list[int]]:
    """Short texts and a chat, and two prompts of 45 and 70 tokens (past a 24-token window)."""
    return [
        smollm2_tokenizer.encode(TEXTS[1]),
        chat_ids(smollm2_tokenizer, CHATS[0]),
        list(range(300, 345)),
        [(7 * i) % 40000 + 100 for i in range(70)],
    ]


@pytest.fixture(scope="module")
def references(tiny_checkpoint, prompts):
    """family -> Hugging Face's greedy continuation of every prompt (computed once)."""
    made: dict[str, list[Greedy]] = {}

    def get(family: str) -> list[Greedy]:
        if family not in made:
            _, hf_model = tiny_checkpoint(family)
            made[family] = [hf_greedy(hf_model, p, MAX_TOKENS) for p in prompts]
        return made[family]

    return get


def assert_matches(outs, refs, what: str) -> None:
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert_greedy_match(out.token_ids, ref, f"{what}, prompt {i}")


@pytest.mark.parametrize(
    "family",
    ["mixtral", "qwen2_moe", "qwen3_moe", "mistral_window", "phi3", "gemma2", "gemma3", "gpt_oss"],
)
def test_batched_greedy_matches_hf_generate(
    family, tiny_checkpoint, llm_factory, prompts, references
):
    path, _ = tiny_checkpoint(family)
    llm = llm_factory(model=path, dtype="float32")
    assert_matches(llm.generate(prompts, PARAMS, use_tqdm=False), references(family), family)
    rows = llm.engine.expert_load()  # every token's k experts in every layer
    moe = family in ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss")
    assert (rows[0] > 0) if moe else rows == []


@pytest.mark.parametrize(
    "family,mode",
    [
        *((f, m) for f in ("qwen2_moe", "mistral_window") for m in ("recompute", "swap")),
        # windowed and global layers, sinks in the eager prefill over gathered blocks, swapped
        ("gpt_oss", "swap"),
    ],
)
def test_chunked_prefill_and_preemption_keep_hf_tokens(
    family, mode, tiny_checkpoint, llm_factory, prompts, references
):
    """A 16-token budget splits every long prompt (and the window's edge) across steps, and 8
    blocks of 16 tokens hold about one request at a time, so the others are evicted and resumed."""
    path, _ = tiny_checkpoint(family)
    kwargs: dict = dict(num_gpu_blocks=8, max_model_len=8 * 16, preemption_mode=mode)
    if mode == "swap":
        kwargs["num_cpu_blocks"] = 64
    llm = llm_factory(model=path, dtype="float32", max_num_batched_tokens=16, **kwargs)
    before = llm.engine.stats().num_preemptions
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert_matches(outs, references(family), f"{family} {mode}")
    assert llm.engine.stats().num_preemptions > before


def test_the_window_changes_what_a_long_prompt_generates(tiny_checkpoint, prompts, references):
    """Without its window the same weights continue the 70-token prompt differently, so the
    parity above is a test of the window."""
    _, hf_model = tiny_checkpoint("mistral_window")
    hf_model.config.sliding_window = None
    try:
        full = hf_greedy(hf_model, prompts[3], MAX_TOKENS)
    finally:
        hf_model.config.sliding_window = 24
    assert full.token_ids != references("mistral_window")[3].token_ids


def test_the_soft_cap_changes_what_gemma2_generates(tiny_checkpoint, prompts, references):
    """Without its attention soft-cap the same Gemma 2 weights continue some prompt differently,
    so its parity above is a test of the cap."""
    _, hf_model = tiny_checkpoint("gemma2")
    layers = [layer.self_attn for layer in hf_model.model.layers]
    try:
        for attn in layers:
            attn.attn_logit_softcapping = None
        uncapped = [hf_greedy(hf_model, p, MAX_TOKENS).token_ids for p in prompts[2:]]
    finally:
        for attn in layers:
            attn.attn_logit_softcapping = hf_model.config.attn_logit_softcapping
    assert uncapped != [r.token_ids for r in references("gemma2")[2:]]


def test_the_sinks_change_what_gpt_oss_generates(tiny_checkpoint, prompts, references):
    """Without its sinks (a sink of -inf weighs nothing) the same gpt-oss weights continue some
    prompt differently, so its parity above is a test of the sinks."""
    _, hf_model = tiny_checkpoint("gpt_oss")
    sinks = [layer.self_attn.sinks for layer in hf_model.model.layers]
    saved = [s.detach().clone() for s in sinks]
    try:
        with torch.no_grad():
            for s in sinks:
                s.fill_(float("-inf"))
        plain = [hf_greedy(hf_model, p, MAX_TOKENS).token_ids for p in prompts[2:]]
    finally:
        with torch.no_grad():
            for s, old in zip(sinks, saved):
                s.copy_(old)
    assert plain != [r.token_ids for r in references("gpt_oss")[2:]]


def test_phi3_longrope_matches_hf_short_and_long(tiny_checkpoint, llm_factory):
    """LongRoPE stretched from 32 positions: a prompt that stays within 32 tokens with its output
    (short factors), and prompts of 45 and 70 tokens (long factors from the start). A request that
    crosses 32 while decoding is left out: transformers then recomputes its whole cache with the
    long factors, which a paged cache does not (workers/models/phi3.py)."""
    path, hf_model = tiny_checkpoint("phi3_longrope")
    prompts = [
        [5, 17, 300, 42, 9],
        list(range(300, 345)),
        [(7 * i) % 40000 + 100 for i in range(70)],
    ]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm_factory(model=path, dtype="float32").generate(prompts, params, use_tqdm=False)
    assert_matches(outs, [hf_greedy(hf_model, p, 12) for p in prompts], "phi3_longrope")
