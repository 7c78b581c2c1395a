"""GLM-4-MoE's own parts: the partial rotary (checked at load, and the same on the fused and torch
paths) and its MoE layers built from DeepSeek's block. Its greedy parity with transformers is in
test_deepseek.py, its TP=2 run in tests/cluster/test_deepseek_tp.py."""

from __future__ import annotations

import pytest
import torch
from transformers import Glm4MoeConfig

from workers.layers.rotary import RotaryEmbedding, rotary_torch
from workers.models import model_class
from workers.models.deepseek import DeepseekMoE
from workers.models.glm4_moe import Glm4MoeForCausalLM, PartialRotary

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    vocab_size=300,
    max_position_embeddings=128,
)


def test_glm4_moe_rotates_half_of_each_head_and_keeps_a_dense_first_layer():
    config = Glm4MoeConfig(**TINY)
    model = model_class(config)(config)
    assert isinstance(model, Glm4MoeForCausalLM)
    rotary = model.attention_blocks()[0].rotary
    assert isinstance(rotary, PartialRotary) and rotary.width == 8  # 0.5 of 16
    assert [isinstance(layer.mlp, DeepseekMoE) for layer in model.model.layers] == [
        False,
        True,
        True,
    ]
    assert model.attention_blocks()[0].o_proj.bias is None  # attention_bias is q/k/v's only


@pytest.mark.parametrize("value", [2**64, -1, float("nan"), 10**12])
def test_a_bad_partial_rotary_factor_is_refused_by_name(value):
    config = Glm4MoeConfig(**TINY)
    config.rope_parameters["partial_rotary_factor"] = value
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        model_class(config)(config)


def test_an_odd_partial_rotary_width_is_refused():
    config = Glm4MoeConfig(**TINY)
    config.rope_parameters["partial_rotary_factor"] = 0.2  # int(16 * 0.2) = 3
    with pytest.raises(ValueError, match="partial_rotary_factor.*odd"):
        model_class(config)(config)


def test_the_torch_path_rotates_the_table_width_and_passes_the_rest():
    """float16 on CPU takes the torch path (the fused kernel takes float32 and bfloat16): it
    rotates the first 8 numbers of each head as the full-table torch rotation does and leaves
    the other 8 alone."""
    gen = torch.Generator().manual_seed(3)
    table = RotaryEmbedding(8, 64, {"rope_type": "default", "rope_theta": 10000.0})
    q = torch.randn(5, 4, 16, generator=gen).half()
    k = torch.randn(5, 2, 16, generator=gen).half()
    positions = torch.tensor([0, 3, 9, 17, 63])
    got_q, got_k = PartialRotary(table)(positions, q.clone(), k.clone())
    want_q, want_k = rotary_torch(q[..., :8], k[..., :8], positions, table.cos, table.sin)
    assert torch.equal(got_q[..., :8], want_q) and torch.equal(got_k[..., :8], want_k)
    assert torch.equal(got_q[..., 8:], q[..., 8:]) and torch.equal(got_k[..., 8:], k[..., 8:])
