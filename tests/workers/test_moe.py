"""The MoE layer: routing rules, the grouped expert computation against a per-token loop, its
tensor- and expert-parallel shards (summed over ranks they give the whole layer), and config
errors that name their field. No processes here: ranks are simulated by setting the rank the
layer is built for (tests/workers/test_moe_parallel.py runs real gloo groups)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import workers.layers.moe as moe
from workers.layers import invariant
from workers.layers.backends import cpu_gemm
from workers.layers.linear import pack_cpu_weights
from workers.layers.moe import FusedMoE, MoEConfig, expert_range, route
from workers.models import model_class
from workers.models.llama import sliding_windows_of

CFG = MoEConfig(num_experts=8, top_k=2, hidden_size=32, intermediate_size=24, renormalize=True)


def random_experts(cfg: MoEConfig, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    e, i, h = cfg.num_experts, cfg.intermediate_size, cfg.hidden_size
    gate, up = torch.randn(e, i, h, generator=gen) / 4, torch.randn(e, i, h, generator=gen) / 4
    down = torch.randn(e, h, i, generator=gen) / 4
    return gate, up, down


def build(cfg, weights, monkeypatch, rank=0, world=1, expert_parallel=False) -> FusedMoE:
    monkeypatch.setattr(moe, "get_tp_rank", lambda: rank)
    monkeypatch.setattr(moe, "get_tp_world_size", lambda: world)
    monkeypatch.setattr(moe, "get_expert_parallel", lambda: expert_parallel)
    layer = FusedMoE(cfg)
    gate, up, down = weights
    for e in range(cfg.num_experts):
        layer.load_expert(e, "gate", gate[e])
        layer.load_expert(e, "up", up[e])
        layer.load_expert(e, "down", down[e])
    return layer


def per_token_reference(x, weights, ids, gate, up, down):
    """The definition, one token and one slot at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            h = F.silu(x[t] @ gate[e].T) * (x[t] @ up[e].T)
            out[t] += w * (h @ down[e].T)
    return out


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("packed", [False, True])
def test_grouped_experts_equal_a_per_token_loop(rows, packed, monkeypatch):
    weights3 = random_experts(CFG)
    layer = build(CFG, weights3, monkeypatch)
    if packed:
        assert pack_cpu_weights(layer) == 1
    x = torch.randn(rows, CFG.hidden_size, generator=torch.Generator().manual_seed(1))
    w, ids = route(torch.randn(rows, CFG.num_experts, generator=torch.Generator()), CFG)
    expected = per_token_reference(x, w, ids, *weights3)
    torch.testing.assert_close(layer.experts(x, w, ids), expected, atol=1e-5, rtol=1e-5)


def test_a_token_does_not_depend_on_its_neighbours(monkeypatch):
    """Alone or among 33 tokens (other experts, other row counts): the same up to GEMM rounding,
    as for the dense layers."""
    layer = build(CFG, random_experts(CFG), monkeypatch)
    gen = torch.Generator().manual_seed(2)
    x, logits = torch.randn(33, 32, generator=gen), torch.randn(33, 8, generator=gen)
    batched = layer(x, logits)
    for t in (0, 17, 32):
        alone = layer(x[t : t + 1], logits[t : t + 1])[0]
        torch.testing.assert_close(alone, batched[t], atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(not cpu_gemm.available(), reason="no C++ compiler to build the kernel")
def test_experts_with_few_rows_run_the_small_row_kernel_as_onednn_would(monkeypatch):
    """Experts of at most SMALL_ROWS rows go through the small-row kernel (counted), larger ones
    and every expert under batch invariance through oneDNN; the layer's output is the oneDNN
    path's within float32 rounding."""
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=40, intermediate_size=36, renormalize=True)
    layer = build(cfg, random_experts(cfg), monkeypatch)
    assert pack_cpu_weights(layer) == 1
    monkeypatch.setattr(moe, "SMALL_ROWS", 16)  # whatever the default: expert 0 above, others under
    calls: list[int] = []
    real = cpu_gemm.small_linear
    monkeypatch.setattr(cpu_gemm, "small_linear", lambda x, *a: calls.append(len(x)) or real(x, *a))
    gen = torch.Generator().manual_seed(5)
    x, logits = torch.randn(30, 40, generator=gen), torch.randn(30, 4, generator=gen)
    logits[:20, 0] += 100  # expert 0 gets 20 rows (oneDNN), the others fewer than 16
    w, ids = route(logits, cfg)
    mixed = layer.experts(x, w, ids)
    assert calls and max(calls) <= 16 and len(calls) == 2 * 3  # w13 and w2 of three experts
    monkeypatch.setattr(moe, "SMALL_ROWS", 0)
    torch.testing.assert_close(mixed, layer.experts(x, w, ids), atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(moe, "SMALL_ROWS", 16)
    calls.clear()
    with invariant.batch_invariant(True):
        torch.testing.assert_close(mixed, layer.experts(x, w, ids), atol=1e-5, rtol=1e-5)
    assert not calls


@pytest.mark.parametrize("world,expert_parallel", [(2, False), (3, False), (2, True), (3, True)])
def test_rank_shares_sum_to_the_whole_layer(world, expert_parallel, monkeypatch):
    """Tensor parallel (each rank a slice of every expert) and expert parallel (whole experts;
    8 over 3 ranks is uneven): the all-reduce of the ranks' shares is the single-rank output."""
    cfg = MoEConfig(8, 2, 32, 24, renormalize=True)
    weights3 = random_experts(cfg)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(20, 32, generator=gen)
    w, ids = route(torch.randn(20, 8, generator=gen), cfg)
    whole = build(cfg, weights3, monkeypatch).experts(x, w, ids)
    shares = []
    for rank in range(world):
        layer = build(cfg, weights3, monkeypatch, rank, world, expert_parallel)
        shares.append(layer.experts(x, w, ids))
    torch.testing.assert_close(sum(shares), whole, atol=1e-5, rtol=1e-5)
    rows = layer.rows_per_rank
    assert sum(rows) == (20 * 2 if expert_parallel else 20 * 2 * world)


def test_expert_ranges_cover_every_expert_once():
    for experts, world in [(8, 2), (8, 3), (8, 4), (60, 7)]:
        ranges = [expert_range(experts, r, world) for r in range(world)]
        assert ranges[0][0] == 0 and ranges[-1][1] == experts
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
        assert max(e - s for s, e in ranges) - min(e - s for s, e in ranges) <= 1


def test_routing_rules():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 3.5, 1.0]])
    plain = route(logits, MoEConfig(4, 2, 8, 8, renormalize=False))
    renorm = route(logits, MoEConfig(4, 2, 8, 8, renormalize=True))
    after = route(logits, MoEConfig(4, 2, 8, 8, renormalize=False, scoring="topk_softmax"))
    assert plain[1].tolist() == [[0, 1], [2, 1]] == renorm[1].tolist() == after[1].tolist()
    torch.testing.assert_close(plain[0], logits.softmax(-1).topk(2).values)
    torch.testing.assert_close(renorm[0].sum(-1), torch.ones(2))
    torch.testing.assert_close(after[0], renorm[0])  # softmax after top-k = renormalised


@pytest.mark.parametrize(
    "changes,field",
    [
        (dict(top_k=9), "num_experts_per_tok"),
        (dict(top_k=0), "num_experts_per_tok"),
        (dict(num_experts=0, top_k=1), "num_experts"),
        (dict(activation="relu2"), "hidden_act"),
        (dict(intermediate_size=0), "moe_intermediate_size"),
        (dict(scoring="sigmoid"), "scoring"),
    ],
)
def test_bad_moe_configs_name_the_field(changes, field):
    fields = (
        dict(num_experts=8, top_k=2, hidden_size=8, intermediate_size=8, renormalize=True) | changes
    )
    with pytest.raises(ValueError, match=field):
        MoEConfig(**fields)


def test_bad_hf_configs_fail_at_build_naming_the_field():
    from transformers import MixtralConfig, Qwen3MoeConfig

    tiny = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, vocab_size=32)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        model_class(cfg := Qwen3MoeConfig(num_experts=4, num_experts_per_tok=6, **tiny))(cfg)
    with pytest.raises(ValueError, match="hidden_act"):
        model_class(cfg := MixtralConfig(hidden_act="gelu_new", **tiny))(cfg)


def test_expert_parallel_with_more_ranks_than_experts_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="num_experts"):
        build(
            MoEConfig(2, 1, 8, 8, True),
            random_experts(MoEConfig(2, 1, 8, 8, True)),
            monkeypatch,
            rank=0,
            world=4,
            expert_parallel=True,
        )


def test_an_unknown_architecture_names_itself_and_what_is_supported():
    from transformers import PretrainedConfig

    with pytest.raises(ValueError, match="NoSuchModelForCausalLM.*MixtralForCausalLM"):
        model_class(PretrainedConfig(architectures=["NoSuchModelForCausalLM"]))


def test_sliding_windows_per_layer():
    from transformers import MistralConfig, Qwen2Config

    assert sliding_windows_of(MistralConfig(num_hidden_layers=3, sliding_window=24)) == [24] * 3
    assert sliding_windows_of(MistralConfig(num_hidden_layers=2, sliding_window=None)) == [None] * 2
    qwen = Qwen2Config(
        num_hidden_layers=3,
        use_sliding_window=True,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )
    assert sliding_windows_of(qwen) == [16, None, 16]
    assert sliding_windows_of(Qwen2Config(num_hidden_layers=2, use_sliding_window=False)) == [
        None,
        None,
    ]


def test_fused_checkpoint_layout_loads_like_per_expert_tensors(monkeypatch):
    """transformers' in-memory layout (experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I]) gives the same shards as experts.N.{gate,up,down}_proj, at every rank of a split."""
    weights3 = random_experts(CFG)
    gate, up, down = weights3
    for rank, world, ep in [(0, 1, False), (1, 3, True), (1, 2, False)]:
        per_expert = build(CFG, weights3, monkeypatch, rank, world, ep)
        fused = FusedMoE(CFG)  # built for the same rank (the monkeypatches still hold)
        fused.load_fused("gate_up_proj", torch.cat([gate, up], dim=1))
        fused.load_fused("down_proj", down)
        assert torch.equal(fused.w13, per_expert.w13) and torch.equal(fused.w2, per_expert.w2)


def test_phi3_refuses_a_partial_rotary_factor():
    from transformers import Phi3Config

    tiny = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, vocab_size=32)
    config = Phi3Config(partial_rotary_factor=0.5, pad_token_id=0, **tiny)
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        model_class(config)(config)
