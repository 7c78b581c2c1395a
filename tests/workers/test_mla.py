"""Multi-head latent attention's parts: the cache layout and its bytes, absorbed attention against
the expanded formula, DeepSeek's grouped routing against transformers' routers, and the config
fields checked at the edge."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config

from scheduler.kv_connector import KVTransfers
from workers.kv_cache import KVCache, KVCacheSpec
from workers.kv_fp8 import FP8
from workers.kv_tiers import KVTierConfig, KVTiers
from workers.layers.attention import AttentionMetadata
from workers.layers.backends import cpu_paged
from workers.layers.backends.torch_ref import TorchBackend
from workers.layers.grouped_topk import GroupedTopK, grouped_topk
from workers.layers.mla import (
    KVUpProjection,
    LatentAttention,
    MLADims,
    latent_backend,
    mla_softmax_scale,
)
from workers.models import model_class
from workers.models.deepseek import DeepseekArgs

# DeepSeek-V3's published attention shape (61 layers, 128 heads).
V3_SHAPE = dict(
    num_hidden_layers=61,
    num_attention_heads=128,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=48,
    q_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=24,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    vocab_size=300,
    max_position_embeddings=256,
)


def test_the_cache_holds_one_latent_row_per_token_and_layer():
    """DeepSeek-V3 in bf16: 576 numbers (512 latent + 64 rotary) per token and layer, 70,272
    bytes per token; expanded K and V heads would take 128 x (192 + 128) = 40,960 numbers, 71x
    more."""
    config = DeepseekV3Config(**V3_SHAPE)
    spec = KVCacheSpec.from_hf_config(config, 16, torch.bfloat16, tp_size=8)
    assert (spec.kv_parts, spec.num_kv_heads, spec.head_dim) == (1, 1, 576)
    per_token = spec.block_bytes // 16
    assert per_token == 61 * 576 * 2 == 70_272
    full = 61 * MLADims.from_hf_config(config).full_attention_width() * 2
    assert full == 61 * 128 * (192 + 128) * 2
    assert full / per_token == pytest.approx(71.1, abs=0.05)
    # The latent is replicated: every tensor-parallel rank caches the whole row.
    assert KVCacheSpec.from_hf_config(config, 16, torch.bfloat16, tp_size=1) == spec


def test_the_engine_and_the_model_size_the_cache_alike():
    """The engine sizes pools from the config before a worker reports the model's layers; both
    give the same block."""
    config = DeepseekV3Config(**TINY)
    model = model_class(config)(config)
    from_model = KVCacheSpec.of(model.attention_layers(), 16, torch.float32)
    assert from_model == KVCacheSpec.from_hf_config(config, 16, torch.float32)
    assert from_model.block_bytes == 3 * 16 * (48 + 16) * 4


def test_a_latent_pool_binds_one_tensor_as_keys_and_values_and_swaps_it():
    config = DeepseekV3Config(**TINY)
    layers = model_class(config)(config).attention_layers()
    spec = KVCacheSpec.of(layers, 4, torch.float32)
    cache = KVCache(spec, 6, 3, torch.device("cpu"))
    assert cache.gpu.shape == (3, 1, 6, 4, 1, 64)
    cache.bind(layers)
    assert all(
        layer.k_cache is layer.v_cache or layer.k_cache.equal(layer.v_cache) for layer in layers
    )
    cache.gpu.normal_()
    before = cache.gpu[:, :, 2].clone()
    cache.swap_out([(2, 1)])
    cache.gpu[:, :, 2] = 0
    cache.swap_in([(2, 1)])
    assert torch.equal(cache.gpu[:, :, 2], before)


def test_the_kv_tiers_keep_latent_blocks_whole_on_the_cpu_and_on_disk(tmp_path):
    """A latent block (one part a layer) saved to a CPU slot, demoted to disk, and loaded back
    into other device blocks from each tier is the same block, at the latent layout's bytes."""
    spec = KVCacheSpec(3, 1, 64, 4, torch.float32, kv_parts=1)
    cache = KVCache(spec, 6, 0, torch.device("cpu"))
    cache.gpu.normal_()
    before = cache.gpu[:, :, 2].clone()
    tiers = KVTiers(cache, KVTierConfig(2, 4, str(tmp_path / "engine")))
    assert tiers.block_nbytes == spec.block_bytes
    tiers.save(KVTransfers(save=[(2, 1, 77)]))
    tiers.save(KVTransfers(demote=[(1, 77)]))
    assert tiers.load(KVTransfers(load_cpu=[(1, 4, 77)], load_disk=[(77, 5)])) == []
    assert torch.equal(cache.gpu[:, :, 4], before) and torch.equal(cache.gpu[:, :, 5], before)


def test_an_fp8_cache_is_refused_for_latent_attention():
    with pytest.raises(ValueError, match="kv_cache_dtype.*MLA"):
        KVCacheSpec(3, 1, 64, 16, FP8, kv_parts=1)


def _expanded(up, latent, k_pe, q_nope, q_pe, scale):
    """softmax(q . k) v per head over expanded k = [W_UK c, k_pe], v = W_UV c (causal)."""
    n, h = latent.shape[0], up.num_heads
    w = up.weight.view(h, up.nope + up.v, -1)
    k_nope = torch.einsum("hdl,tl->thd", w[:, : up.nope], latent)
    k = torch.cat([k_nope, k_pe[:, None].expand(n, h, -1)], -1)
    v = torch.einsum("hdl,tl->thd", w[:, up.nope :], latent)
    scores = torch.einsum("qhd,khd->hqk", torch.cat([q_nope, q_pe], -1), k) * scale
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("paged_kernel", [True, False], ids=["cpu-kernel", "gather-sdpa"])
def test_absorbed_attention_equals_attention_over_expanded_heads(paged_kernel):
    """Attention of [W_UK^T q_nope, q_pe] over cached [c, k_pe] rows, through W_UV, equals
    softmax(q . k) v over each head's expanded k = [W_UK c, k_pe] and v = W_UV c: for a prefill
    chunk (7 tokens) and then a decode row reading them from the cache, through the CPU decode
    kernel and through the gather + SDPA path CUDA takes."""
    torch.manual_seed(0)
    dims = MLADims(
        num_heads=3,
        qk_nope_head_dim=8,
        qk_rope_head_dim=32,
        v_head_dim=6,
        kv_lora_rank=32,  # rows of 64: a size the CPU kernel compiles
        q_lora_rank=None,
    )
    n, h = 8, dims.num_heads
    up = KVUpProjection(dims)
    up.weight.data.normal_(0, 0.3)
    attn = LatentAttention(h, dims, scale=0.2)
    attn.backend = TorchBackend(paged_kernel=paged_kernel)
    if paged_kernel:
        assert attn.backend.kernel is not None  # the kernel built here: this case tests it
    attn.k_cache = attn.v_cache = torch.zeros(3, 4, 1, 64)
    latent, k_pe = torch.randn(n, 32), torch.randn(n, 32)
    q_nope, q_pe = torch.randn(n, h, 8), torch.randn(n, h, 32)
    rows = torch.cat([latent, k_pe], -1)
    q = torch.cat([up.absorb_query(q_nope), q_pe], -1)
    got = []
    for start, length in ((0, n - 1), (n - 1, 1)):  # a prefill chunk, then one decode row
        meta, _ = AttentionMetadata.build([start], [length], [[2, 0]], 4, torch.device("cpu"))
        attn.backend.prepare(meta)
        part = slice(start, start + length)
        got.append(up.expand_output(attn(q[part], rows[part], meta)))
    want = _expanded(up, latent, k_pe, q_nope, q_pe, 0.2).reshape(n, -1)
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(cpu_paged.load() is None, reason="the CPU kernel cannot be built here")
@pytest.mark.parametrize("width,dv", [(256, 224), (64, 40)], ids=["vector", "scalar-tail"])
def test_the_decode_kernel_sums_only_the_latent_columns_of_each_value_row(width, dv):
    """Given v_cache as a view of the rows' first dv columns (the latent), the paged kernel's
    first dv output columns are bit for bit those it computes over whole rows and the rest are
    zero; 224 of 256 runs the vector path in two column passes, 40 the scalar loop."""
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(12, 4, 1, width, generator=gen)
    q = torch.randn(3, 9, width, generator=gen)
    tables = torch.tensor([[0, 5, 7], [2, 3, 11], [9, 1, 4]], dtype=torch.int32)
    seq_lens = torch.tensor([9, 12, 5], dtype=torch.int32)
    whole, narrow = torch.empty_like(q), torch.full_like(q, 7.0)
    args = (tables, seq_lens, 0.1, 0, 0.0, torch.empty(0))
    cpu_paged.paged_decode(whole, q, cache, cache, *args[:3])
    cpu_paged.paged_decode(narrow, q, cache, cache[..., :dv], *args[:3])
    assert torch.equal(narrow[..., :dv], whole[..., :dv])
    assert torch.equal(narrow[..., dv:], torch.zeros_like(narrow[..., dv:]))
    for bad in (torch.randn(12, 4, 1, width + 16), cache.clone()[:, :, :, :dv].contiguous()):
        with pytest.raises(ValueError, match="v_cache"):
            cpu_paged.paged_decode(narrow, q, cache, bad, *args[:3])


def test_a_latent_layer_hands_the_kernel_its_latent_width_as_the_value_width():
    dims = MLADims(3, 8, 32, 6, 32, None)
    attn = LatentAttention(3, dims, scale=0.2)
    attn.k_cache = attn.v_cache = torch.zeros(3, 4, 1, 64)
    kv = attn.layer_kv()
    assert kv.value_width == 32 and kv.k_cache is kv.v_cache
    assert attn.layer_kv() is kv  # built once, not per step


def test_latent_layers_run_the_torch_backend_and_refuse_unvalidated_kernels():
    assert latent_backend("auto") == latent_backend("torch") == "torch"
    for name in ("triton", "flash_attn"):
        with pytest.raises(ValueError, match=f"attention_backend: '{name}'.*MLA"):
            latent_backend(name)


def test_yarn_mscale_scales_the_scores_as_deepseek_does():
    dims = MLADims.from_hf_config(DeepseekV3Config(**V3_SHAPE))
    rope = {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    m = 0.1 * math.log(40.0) + 1.0
    assert mla_softmax_scale(dims, rope) == pytest.approx(192**-0.5 * m * m)
    assert mla_softmax_scale(dims, {"rope_type": "default"}) == pytest.approx(192**-0.5)


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_grouped_routing_picks_what_transformers_picks(version):
    """Same experts, same weights as transformers' DeepseekV2/V3 routers on random logits."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(1)
    if version == "v2":
        config = DeepseekV2Config(
            **{**TINY, "num_experts_per_tok": 3},
            topk_method="group_limited_greedy",
            routed_scaling_factor=1.5,
        )
        hf, bias = DeepseekV2TopkRouter(config), None
    else:
        config = DeepseekV3Config(**TINY, routed_scaling_factor=2.5)
        hf = DeepseekV3TopkRouter(config)
        hf.e_score_correction_bias.normal_(0, 0.5)
        bias = hf.e_score_correction_bias
    hf.weight.data.normal_(0, 0.3)
    x = torch.randn(50, 64)
    _, want_w, want_ids = hf(x)
    routing = DeepseekArgs.from_hf_config(config, family=f"deepseek_{version}").moe.routing
    got_w, got_ids = grouped_topk(x @ hf.weight.t(), routing, bias)
    order_got, order_want = got_ids.sort(-1), want_ids.sort(-1)
    assert torch.equal(order_got.values, order_want.values)
    torch.testing.assert_close(
        got_w.gather(1, order_got.indices), want_w.gather(1, order_want.indices)
    )
    # The group limit is in force: without it some token picks other experts.
    free = GroupedTopK(**{**_fields(routing), "topk_group": routing.n_group})
    assert not torch.equal(
        grouped_topk(x @ hf.weight.t(), free, bias)[1].sort(-1).values, got_ids.sort(-1).values
    )


def _fields(routing: GroupedTopK) -> dict:
    return {name: getattr(routing, name) for name in GroupedTopK.__dataclass_fields__}


BAD = [2**64, -1, float("nan"), 10**12]


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize(
    "field",
    [
        "kv_lora_rank",
        "q_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "n_routed_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "n_group",
        "topk_group",
        "first_k_dense_replace",
        "n_shared_experts",
        "routed_scaling_factor",
    ],
)
def test_out_of_range_config_fields_are_refused_by_name(field, value):
    """Past transformers' own type checks (a config.json read another way, an older transformers):
    raylm's bounds still hold."""
    config = DeepseekV3Config(**TINY)
    object.__setattr__(config, field, value)  # around transformers' validating __setattr__
    with pytest.raises(ValueError, match=field):
        DeepseekArgs.from_hf_config(config, family="deepseek_v3")


@pytest.mark.parametrize("field", ["topk_method", "scoring_func"])
def test_unknown_routing_methods_are_refused_by_name(field):
    config = DeepseekV3Config(**TINY)
    object.__setattr__(config, field, "softmax_plus")
    with pytest.raises(ValueError, match=field):
        DeepseekArgs.from_hf_config(config, family="deepseek_v3")


def test_kimi_k2_config_loads_as_deepseek_v3():
    """Kimi-K2 is DeepSeek-V3's architecture (its config says so, model_type kimi_k2)."""
    from transformers import PretrainedConfig

    from workers.models.deepseek import DeepseekV3ForCausalLM

    assert (
        model_class(PretrainedConfig(architectures=["DeepseekV3ForCausalLM"]))
        is DeepseekV3ForCausalLM
    )
    kimi = PretrainedConfig()
    kimi.model_type = "kimi_k2"
    assert model_class(kimi) is DeepseekV3ForCausalLM
