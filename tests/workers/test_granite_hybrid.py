"""Granite-4 hybrid (Mamba-2 layers beside attention, MoE plus a shared MLP, Granite's scalars):
the SSD scan against transformers' torch fallbacks, and greedy output equal to transformers'
greedy generate on the same random checkpoint (fp32), batched under 16-token chunked prefill with
two state slots for three requests and an 8-block pool that preempts, with prefix hits, on one
process and on two gloo rank processes (experts split across them). A Mamba-2 layer split over two
ranks (whole heads each; two groups split, or one group replicated with its gated norm summed
across the ranks) gives one rank's output.

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
from workers.layers.gated_delta import DeltaStateView
from workers.layers.mamba2 import Mamba2Mixer, MambaDims, ssd_chunked, ssd_step

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
    new = start.clone()
    y = ssd_step(x[:, 0], step[None, 0], a, b[:, 0], c[:, 0], d, new)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new, ref_state, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("slots", [[1, 2, 3], [4, 0, 2]])
def test_decode_rows_update_their_own_slots_consecutive_in_place_or_scattered(slots):
    """Three decode rows on consecutive slots (views of the store, updated in place) or scattered
    ones (gathered once, scattered back) give each row's output and leave each slot's conv and
    SSM state as that row decoded alone would; the other slots are untouched."""
    full = MambaDims(32, 4, 8, 2, 8, 4, 8, 1e-6, conv_bias=True, proj_bias=True)
    mixer = Mamba2Mixer(full)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    conv_shape, ssm_shape = mixer.state_shapes()
    conv, ssm = (
        torch.randn(5, *conv_shape, generator=gen),
        torch.randn(5, *ssm_shape, generator=gen),
    )
    xbc, dt = torch.randn(3, full.conv_dim, generator=gen), torch.rand(3, 4, generator=gen)
    mixer.state = view = DeltaStateView(conv.clone(), ssm.clone(), slots)
    assert (view.decode_rows(3).index is None) == (slots == [1, 2, 3])
    y = mixer._decode(xbc, dt, slots)
    for row, slot in enumerate(slots):
        mixer.state = alone = DeltaStateView(conv[[slot]], ssm[[slot]], [0])
        torch.testing.assert_close(y[row], mixer._decode(xbc[[row]], dt[[row]], [0])[0])
        torch.testing.assert_close(view.recurrent[slot], alone.recurrent[0])
        torch.testing.assert_close(view.conv[slot], alone.conv[0])
        assert not torch.equal(view.recurrent[slot], ssm[slot])
    others = [s for s in range(5) if s not in slots]
    assert torch.equal(view.recurrent[others], ssm[others])
    assert torch.equal(view.conv[others], conv[others])


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


@pytest.fixture(scope="module")
def engines(checkpoint, llm_factory):
    """tp -> the engine of tests/workers/hybrid_prefix.py's sizes on tp ranks."""
    yield from hybrid_prefix.engines(llm_factory, hybrid_prefix.engine_kwargs(checkpoint[0]))


@pytest.fixture(scope="module")
def three_prompts(checkpoint, smollm2_tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts of 70 and 45 tokens and a short text, with transformers' greedy tokens."""
    prompts = [
        [(7 * i) % 40000 + 100 for i in range(70)],
        list(range(300, 345)),
        smollm2_tokenizer.encode(TEXTS[1]),
    ]
    return prompts, [hf_greedy(checkpoint[1], p, MAX_TOKENS) for p in prompts]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_few_slots_chunked_prefill_and_preemption_give_hf_greedy_tokens(tp, engines, three_prompts):
    prompts, refs = three_prompts
    llm = engines(tp)
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert_greedy_match(out.token_ids, ref, f"granite hybrid TP={tp}, prompt {i}")
    engine = llm.engine
    assert engine.stats().num_preemptions > 0
    # Per rank: the 2 attention layers' K and V of 2 KV heads of 16 (one head each at TP=2).
    assert engine.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4 // tp
    load = engine.expert_load()
    assert len(load) == tp and min(load) > 0  # at TP=2 each rank ran its own experts' rows
    # Per rank, each Mamba layer's conv state (x, B, C channels: 4 heads of 32 and 2 groups of
    # 16, twice; 3 taps) and SSM state (4 heads x 32 x 16), in every slot: split by the ranks.
    slots = hybrid_prefix.SEQS + hybrid_prefix.CHECKPOINTS
    per_slot = 2 * ((4 * 32 + 2 * 2 * 16) * 3 + 4 * 32 * 16) * 4
    assert engine.executor.call_ranks(state_bytes) == [slots * per_slot // tp] * tp


def state_bytes(runner) -> int:
    """A rank's recurrent-state bytes (a call_ranks job)."""
    from workers.linear_state import LinearStateFeature

    return runner.feature(LinearStateFeature).store.nbytes


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_a_prefix_hit_restores_the_mamba_state_checkpoint_and_gives_hf_tokens(
    tp, checkpoint, engines
):
    """A hit computes only the tokens after its checkpointed block, beside a preemption, and a
    partial hit rounds down to a checkpoint (tests/workers/hybrid_prefix.py), on every rank's
    slice of the state."""
    hybrid_prefix.check_prefix_hits(engines(tp), checkpoint[1], MAX_TOKENS)


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


# A Mamba-2 layer's steps for the two-rank check: a 10-token prompt in chunks of 6 and 4 (the
# second crosses a scan chunk of 8), then its decode beside a new 5-token prompt (request ids,
# starts, query lengths).
LAYER_STEPS = [(["a"], [0], [6]), (["a"], [6], [4]), (["a", "b"], [10, 0], [1, 5])]


def mamba_layer_rows(rank: int, world: int, groups: int) -> torch.Tensor:
    """A gloo_ranks job (and the single-rank reference): LAYER_STEPS through this rank's share of
    one Mamba-2 layer (4 heads of 8, `groups` groups, biases everywhere) loaded from the same
    random full tensors on every rank, with its own state slots; the layer's output rows."""
    import torch.distributed as dist

    from workers.layers.attention import AttentionMetadata
    from workers.linear_state import LinearStateStore
    from workers.parallel import init_tensor_parallel

    if world > 1:
        init_tensor_parallel(rank, world, dist.group.WORLD)
    full = MambaDims(32, 4, 8, groups, 8, 4, 8, 1e-6, conv_bias=True, proj_bias=True)
    mixer = Mamba2Mixer(full)
    proj = full.intermediate + full.conv_dim + full.num_heads  # z, x, B, C, dt
    checkpoint = {  # the full tensors, in the mixer's parameter order
        "in_proj.weight": (proj, 32),
        "in_proj.bias": (proj,),
        "conv1d.weight": (full.conv_dim, 1, 4),
        "conv1d.bias": (full.conv_dim,),
        "dt_bias": (4,),
        "A_log": (4,),
        "D": (4,),
        "norm.weight": (full.intermediate,),
        "out_proj.weight": (32, full.intermediate),
        "out_proj.bias": (32,),
    }
    gen = torch.Generator().manual_seed(5)
    params = dict(mixer.named_parameters())
    assert set(params) == set(checkpoint)
    for name, shape in checkpoint.items():
        params[name].weight_loader(params[name], torch.randn(shape, generator=gen) * 0.5)
    cpu = torch.device("cpu")
    store = LinearStateStore([mixer], 2, torch.float32, cpu)
    rows = []
    with torch.inference_mode():
        for req_ids, starts, lens in LAYER_STEPS:
            meta, positions = AttentionMetadata.build(starts, lens, [[0]] * len(lens), 16, cpu)
            store.begin_step(req_ids, starts, req_ids)
            x = torch.randn(sum(lens), 32, generator=gen)
            rows.append(mixer(positions, x, meta))
    return torch.cat(rows)


@pytest.mark.slow  # as every gloo-group test: the quick run spawns no ranks
@pytest.mark.parametrize("groups", [1, 2])
def test_two_ranks_split_a_mamba_layer_by_head_and_match_one(gloo_ranks, groups):
    """Each rank holds 2 of the 4 heads: with 2 groups one group each, with 1 group that group's
    B and C on both and the gated norm's sum of squares added across them."""
    from workers.parallel import reset_tensor_parallel

    reset_tensor_parallel()
    expected = mamba_layer_rows(0, 1, groups)
    assert expected.shape == (6 + 4 + 6, 32) and expected.abs().sum() > 0
    got = gloo_ranks(2).run(mamba_layer_rows, groups)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("heads", "groups", "tp", "match"),
    [
        (6, 2, 4, "mamba_n_heads: 6 is not divisible by tensor_parallel_size=4"),
        (6, 3, 2, "tensor_parallel_size: 2 ranks cannot split mamba_n_groups 3"),
        (8, 4, 16, "mamba_n_heads: 8 is not divisible by tensor_parallel_size=16"),
    ],
)
def test_splits_that_cannot_work_are_refused_naming_tensor_parallel_size(heads, groups, tp, match):
    dims = MambaDims(64, heads, 8, groups, 16, 4, 16, 1e-6, conv_bias=True, proj_bias=False)
    with pytest.raises(ValueError, match=match):
        dims.per_rank(tp, 0)


def test_each_rank_keeps_whole_heads_and_the_groups_they_read():
    dims = MambaDims(64, 8, 8, 2, 16, 4, 16, 1e-6, conv_bias=True, proj_bias=False)
    split = [dims.per_rank(4, rank) for rank in range(4)]  # two ranks per group
    assert [(d.num_heads, d.num_groups, first) for d, first in split] == [
        (2, 1, 0), (2, 1, 0), (2, 1, 1), (2, 1, 1),
    ]  # fmt: skip
    assert [first for _, first in (dims.per_rank(2, r) for r in range(2))] == [0, 1]
    assert dims.per_rank(2, 1)[0].num_groups == 1 and dims.per_rank(1, 0) == (dims, 0)
