"""Granite-4 hybrid (Mamba-2 layers beside attention, MoE plus a shared MLP, Granite's scalars):
the SSD scan against transformers' torch fallbacks, and greedy output equal to transformers'
greedy generate on the same random checkpoint (fp32), batched under 16-token chunked prefill with
two state slots for three requests and an 8-block pool that preempts.

The checkpoint: four layers (Mamba-2, attention, Mamba-2, attention) without positional rotation
(Granite-4.0-H's), Mamba-2 of 4 heads of 32 in 2 groups with a state of 16 and 16-token scan
chunks (a 45-token prompt spans several), 4 experts top-2 beside a shared MLP, and multipliers
away from 1 (embedding 2, residual 0.5, attention 0.1, logits divided by 1.5). A token may
differ only at a true near-tie (tests/workers/greedy.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.granitemoehybrid import modeling_granitemoehybrid as hf

from scheduler import SamplingParams
from tests.random_checkpoint import ModelSpec, write_random_checkpoint
from tests.workers import hybrid_prefix
from tests.workers.greedy import assert_greedy_match, hf_greedy
from tests.workers.test_hf_parity import TEXTS
from workers.layers.mamba2 import MambaDims, ssd_chunked, ssd_step

MAX_TOKENS = 8
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
TINY_GRANITE_HYBRID = ModelSpec(
    "GraniteMoeHybridConfig",
    dict(
        hidden_size=64,
        intermediate_size=32,
        shared_intermediate_size=48,
        num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        mamba_n_heads=4,
        mamba_n_groups=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=16,
        position_embedding_type=None,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.1,
        logits_scaling=1.5,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    matrix_std=0.15,
    head_std=0.6,
    vector_std=0.3,
)


def test_chunked_scan_across_a_cut_and_the_step_equal_the_reference():
    gen = torch.Generator().manual_seed(0)
    L, H, P, G, N = 37, 4, 8, 2, 6
    x, dt = torch.randn(1, L, H, P, generator=gen), torch.randn(1, L, H, generator=gen)
    a, d, dt_bias = -torch.rand(H, generator=gen) - 0.1, torch.randn(H), torch.randn(H)
    b, c = torch.randn(1, L, G, N, generator=gen), torch.randn(1, L, G, N, generator=gen)
    start = torch.randn(1, H, P, N, generator=gen)
    want, want_state = hf.mamba2_chunk_scan(
        x, dt, a, b, c, chunk_size=16, D=d, dt_bias=dt_bias, initial_states=start,
        dt_softplus=True, return_final_states=True,
    )  # fmt: skip
    step = torch.nn.functional.softplus(dt + dt_bias)[0]
    bh, ch = (t[0].repeat_interleave(H // G, dim=1) for t in (b, c))
    first, state = ssd_chunked(x[0, :20], step[:20], a, bh[:20], ch[:20], d, start[0], 16)
    rest, state = ssd_chunked(x[0, 20:], step[20:], a, bh[20:], ch[20:], d, state, 16)
    torch.testing.assert_close(torch.cat([first, rest]), want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state, want_state[0], rtol=1e-4, atol=1e-5)
    ref_state = start.clone()
    ref = hf.mamba2_selective_state_update(
        ref_state, x[:, 0], dt[:, 0, :, None].expand(-1, -1, P), a[:, None, None].expand(-1, P, N),
        b[:, 0], c[:, 0], d[:, None].expand(-1, P), dt_bias=dt_bias[:, None].expand(-1, P),
        dt_softplus=True,
    )  # fmt: skip
    y, new = ssd_step(x[:, 0], step[None, 0], a, bh[None, 0], ch[None, 0], d, start.clone())
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new, ref_state, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "field", ["num_heads", "head_dim", "num_groups", "state_size", "chunk_size"]
)
@pytest.mark.parametrize("value", [2**64, -1, math.nan, 10**12])
def test_mamba_sizes_out_of_range_are_refused_naming_the_field(field, value):
    dims = dict(num_heads=4, head_dim=8, num_groups=2, state_size=16, chunk_size=16)
    dims[field] = value
    with pytest.raises(ValueError, match=f"mamba_{field}"):
        MambaDims(64, conv_kernel=4, eps=1e-6, conv_bias=True, proj_bias=False, **dims)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, smollm2_tokenizer) -> tuple[str, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    path = str(tmp_path_factory.mktemp("tiny-granite-hybrid"))
    write_random_checkpoint(TINY_GRANITE_HYBRID, path, seed=4, tokenizer=smollm2_tokenizer)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.slow
def test_few_slots_chunked_prefill_and_preemption_give_hf_greedy_tokens(
    checkpoint, llm_factory, smollm2_tokenizer
):
    hf_model = checkpoint[1]
    prompts = [
        [(7 * i) % 40000 + 100 for i in range(70)],
        list(range(300, 345)),
        smollm2_tokenizer.encode(TEXTS[1]),
    ]
    refs = [hf_greedy(hf_model, p, MAX_TOKENS) for p in prompts]
    llm = _engine(checkpoint, llm_factory)
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert_greedy_match(out.token_ids, ref, f"granite hybrid, prompt {i}")
    engine = llm.engine
    assert engine.stats().num_preemptions > 0
    assert engine.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # the 2 attention layers' K and V
    assert engine.expert_load()[0] > 0


def _engine(checkpoint, llm_factory):
    """16-token chunks, 2 state slots, 16 blocks of 8 tokens, prefix caching with 8 state
    checkpoints (tests/workers/hybrid_prefix.py)."""
    return llm_factory(
        model=checkpoint[0],
        dtype="float32",
        max_num_batched_tokens=hybrid_prefix.CHUNK,
        max_num_seqs=hybrid_prefix.SEQS,
        block_size=hybrid_prefix.BLOCK,
        num_gpu_blocks=hybrid_prefix.BLOCKS,
        num_state_checkpoints=hybrid_prefix.CHECKPOINTS,
        max_model_len=128,
    )


@pytest.mark.slow
def test_a_prefix_hit_restores_the_mamba_state_checkpoint_and_gives_hf_tokens(
    checkpoint, llm_factory
):
    """A hit computes only the tokens after its checkpointed block, beside a preemption, and a
    partial hit rounds down to a checkpoint (tests/workers/hybrid_prefix.py)."""
    hybrid_prefix.check_prefix_hits(_engine(checkpoint, llm_factory), checkpoint[1], MAX_TOKENS)


@pytest.mark.parametrize(
    "field",
    ["embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"],
)
@pytest.mark.parametrize("value", [2**64, -1, math.nan, 1e12])
def test_granite_scalars_out_of_range_are_refused_naming_the_field(field, value):
    from transformers import GraniteMoeHybridConfig

    from workers.models.granite_hybrid import GraniteMoeHybridForCausalLM

    config = GraniteMoeHybridConfig(**TINY_GRANITE_HYBRID.fields, vocab_size=64)
    setattr(config, field, value)
    with pytest.raises(ValueError, match=field):
        GraniteMoeHybridForCausalLM(config)
