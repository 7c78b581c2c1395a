"""KV cache pools: sizing arithmetic, binding to attention layers, swap copies."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from workers.kv_cache import GiB, KVCache, KVCacheSpec, cpu_num_blocks
from workers.layers.attention import Attention

SPEC = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)


def test_block_bytes_cover_k_and_v_of_every_layer():
    assert SPEC.block_bytes == 2 * 3 * 4 * 2 * 8 * 4
    assert cpu_num_blocks(SPEC, 1.0) == GiB // SPEC.block_bytes
    bf16 = KVCacheSpec(3, 2, 8, 4, torch.bfloat16)
    assert bf16.block_bytes == SPEC.block_bytes // 2


def test_spec_from_config_replicates_kv_heads_beyond_their_count():
    config = LlamaConfig(
        hidden_size=64, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=5
    )
    assert KVCacheSpec.from_hf_config(config, 16, torch.float32, tp_size=1).num_kv_heads == 2
    assert KVCacheSpec.from_hf_config(config, 16, torch.float32, tp_size=2).num_kv_heads == 1
    assert KVCacheSpec.from_hf_config(config, 16, torch.float32, tp_size=4).num_kv_heads == 1
    assert KVCacheSpec.from_hf_config(config, 16, torch.float32).head_dim == 8


def test_bind_gives_each_layer_its_own_slices():
    cache = KVCache(SPEC, num_gpu_blocks=6, num_cpu_blocks=2, device=torch.device("cpu"))
    layers = [Attention(4, 8, 2, 1.0) for _ in range(3)]
    cache.bind(layers)
    layers[1].v_cache.fill_(7.0)
    assert (
        cache.gpu[1, 1].eq(7.0).all()
        and cache.gpu[1, 0].eq(0.0).all()
        and cache.gpu[2].eq(0.0).all()
    )
    assert layers[0].k_cache.shape == (6, 4, 2, 8)


def test_swap_out_then_in_moves_block_contents():
    cache = KVCache(SPEC, num_gpu_blocks=6, num_cpu_blocks=3, device=torch.device("cpu"))
    cache.gpu[:, :, 4] = torch.randn(3, 2, 4, 2, 8)
    cache.gpu[:, :, 1] = torch.randn(3, 2, 4, 2, 8)
    saved4, saved1 = cache.gpu[:, :, 4].clone(), cache.gpu[:, :, 1].clone()
    cache.swap_out([(4, 2), (1, 0)])
    cache.gpu.zero_()
    cache.swap_in([(5, 2), (0, 0)])
    assert torch.equal(cache.gpu[:, :, 5], saved4) and torch.equal(cache.gpu[:, :, 0], saved1)


def test_swap_pairs_outside_the_pools_are_rejected():
    cache = KVCache(SPEC, num_gpu_blocks=2, num_cpu_blocks=1, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="blocks_to_swap"):
        cache.swap_out([(0, 1)])
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        KVCache(SPEC, num_gpu_blocks=0, num_cpu_blocks=0, device=torch.device("cpu"))


def test_a_cpu_pool_is_zeroed_and_writable_without_being_touched_first():
    from workers.kv_cache import zeros

    pool = zeros((2, 2, 64, 16, 2, 8), torch.bfloat16, torch.device("cpu"))
    assert pool.dtype == torch.bfloat16 and pool.shape == (2, 2, 64, 16, 2, 8)
    assert pool.is_contiguous() and not pool.any()
    pool[1, 0, 5] = 1.0
    assert pool.sum().item() == 16 * 2 * 8
    assert zeros((2, 0, 4), torch.float32, torch.device("cpu")).shape == (2, 0, 4)
