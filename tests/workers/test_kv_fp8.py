"""The FP8 KV cache (`kv_cache_dtype: fp8`) on the CPU: E4M3 codes and their scales, the torch
backend reading them (decodes and prefix-cached prefill chunks), twice the blocks per byte,
byte-exact swap/tier/transfer copies, and the settings that refuse it where nothing reads it.
(The Triton kernel's checks are in test_triton_fp8_kv.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from engine.config import EngineConfig
from scheduler.kv_connector import KVTransfers
from tests.workers.test_attention import BLOCK, HK, HQ, REQUESTS, D
from workers.kv_cache import KVCache, KVCacheSpec
from workers.kv_fp8 import FP8, FP8_MAX, cache_dtype, dequantize, quantize, storage_dtype
from workers.kv_tiers import KVTierConfig, KVTiers
from workers.kv_transfer import InProcessTransport, KVReceiver, read_blocks
from workers.layers.attention import Attention, AttentionMetadata
from workers.layers.backends.torch_ref import TorchBackend

CPU = torch.device("cpu")
# Powers of two: a value that is code * scale quantizes back to exactly its code.
SCALES = (0.5, 2.0)


def fp8_mixed_batch(backend, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention output of test_attention's REQUESTS batch (decodes, a whole-prompt prefill,
    chunks continuing a cached prefix) through a layer with an FP8 cache, and through a layer
    with a float cache of the same values. K/V are E4M3 values times the scales, so the codes the
    FP8 layer writes hold them exactly and the two differ by float rounding only."""
    gen = torch.Generator().manual_seed(1)
    num_blocks = 64
    dev = torch.device(device)
    kv_scale = torch.tensor(SCALES, dtype=torch.float32, device=dev)
    fp8 = Attention(HQ, D, HK, scale=D**-0.5)
    ref = Attention(HQ, D, HK, scale=D**-0.5)
    fp8.backend, ref.backend = backend, TorchBackend()
    fp8.k_cache = torch.zeros(num_blocks, BLOCK, HK, D, dtype=torch.uint8, device=dev)
    fp8.v_cache = torch.zeros_like(fp8.k_cache)
    fp8.kv_scale = kv_scale
    ref.k_cache = torch.zeros(num_blocks, BLOCK, HK, D, device=dev)
    ref.v_cache = torch.zeros_like(ref.k_cache)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, qs, ks, vs = [], [], [], []
    for cached, new in REQUESTS:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // BLOCK))]
        k = (torch.randn(total, HK, D, generator=gen) * 4).to(FP8).float() * SCALES[0]
        v = (torch.randn(total, HK, D, generator=gen) * 4).to(FP8).float() * SCALES[1]
        for pos in range(cached):  # earlier steps already wrote these
            block, off = table[pos // BLOCK], pos % BLOCK
            fp8.k_cache[block, off] = quantize(k[pos], kv_scale[0].cpu())
            fp8.v_cache[block, off] = quantize(v[pos], kv_scale[1].cpu())
            ref.k_cache[block, off], ref.v_cache[block, off] = k[pos], v[pos]
        tables.append(table)
        qs.append(torch.randn(new, HQ, D, generator=gen))
        ks.append(k[cached:]), vs.append(v[cached:])
    cat = lambda xs: torch.cat(xs).to(dev).flatten(1)  # noqa: E731
    outs = []
    for layer in (fp8, ref):
        meta, _ = AttentionMetadata.build(
            [c for c, _ in REQUESTS], [n for _, n in REQUESTS], tables, BLOCK, dev
        )
        layer.backend.prepare(meta)
        outs.append(layer(cat(qs), cat(ks), cat(vs), meta).view(-1, HQ, D).float().cpu())
    # The FP8 layer's own writes hold the exact codes of the new tokens too.
    assert torch.equal(dequantize(fp8.k_cache, kv_scale[0], torch.float32), ref.k_cache)
    assert torch.equal(dequantize(fp8.v_cache, kv_scale[1], torch.float32), ref.v_cache)
    return outs[0], outs[1]


@pytest.mark.parametrize("paged_kernel", [True, False])
def test_torch_backend_reads_an_fp8_cache_as_its_float_values(paged_kernel):
    """Gathered decodes and prefix-cached chunks de-quantize (the C++ kernel is passed over)."""
    out, ref = fp8_mixed_batch(TorchBackend(paged_kernel=paged_kernel), "cpu")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_codes_round_to_nearest_and_saturate_without_nan():
    scale = torch.tensor(0.25)
    x = torch.tensor([0.0, 0.1, -3.3, 111.9, 112.1, 1e30, -1e30, float("inf"), -float("inf")])
    codes = quantize(x, scale)
    assert codes.dtype == torch.uint8
    back = dequantize(codes, scale, torch.float32)
    assert not back.isnan().any()
    assert back[-4:].tolist() == [FP8_MAX * 0.25, -FP8_MAX * 0.25] * 2
    # Within E4M3's rounding (3 mantissa bits: half an ulp is 1/16 of the value) below the range.
    assert torch.all((back[:5] - x[:5]).abs() <= x[:5].abs() / 16 + 1e-12)


def test_an_fp8_cache_holds_twice_the_blocks_of_bf16():
    bf16 = KVCacheSpec(16, 8, 64, 16, torch.bfloat16)
    fp8 = KVCacheSpec(16, 8, 64, 16, cache_dtype("fp8", torch.bfloat16))
    assert fp8.dtype == FP8 and fp8.storage_dtype == torch.uint8
    assert fp8.block_bytes * 2 == bf16.block_bytes
    budget = 10.3 * (1 << 30)
    assert fp8.blocks_in(budget) in (2 * bf16.blocks_in(budget), 2 * bf16.blocks_in(budget) + 1)
    assert cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert storage_dtype(torch.float16) == torch.float16


def _filled_fp8_cache(num_gpu: int, num_cpu: int) -> KVCache:
    spec = KVCacheSpec(2, 2, 8, 4, FP8)
    cache = KVCache(spec, num_gpu, num_cpu, CPU)
    assert cache.gpu.dtype == torch.uint8 and cache.scales is not None
    cache.gpu.copy_(torch.randint(0, 256, cache.gpu.shape, dtype=torch.uint8))
    layers = [Attention(4, 8, 2, 1.0) for _ in range(2)]
    cache.bind(layers)
    assert layers[1].kv_scale is not None and layers[1].kv_scale.tolist() == [1.0, 1.0]
    return cache


def test_fp8_blocks_swap_tier_and_transfer_byte_for_byte(tmp_path):
    """Swap, the CPU and disk tiers and the prefill-to-decode transfer copy the codes as bytes."""
    cache = _filled_fp8_cache(6, 2)
    saved = cache.gpu[:, :, 4].clone()
    cache.swap_out([(4, 1)])
    cache.swap_in([(0, 1)])
    assert torch.equal(cache.gpu[:, :, 0], saved)

    tiers = KVTiers(cache, KVTierConfig(2, 2, str(tmp_path)))
    blocks = cache.gpu[:, :, 2].clone(), cache.gpu[:, :, 3].clone()
    tiers.save(KVTransfers(save=[(2, 0, 11)], save_disk=[(3, 12)]))
    failed = tiers.load(KVTransfers(load_cpu=[(0, 5, 11)], load_disk=[(12, 1)]))
    assert failed == []
    assert torch.equal(cache.gpu[:, :, 5], blocks[0]) and torch.equal(cache.gpu[:, :, 1], blocks[1])

    decode_side = _filled_fp8_cache(4, 0)
    transport = InProcessTransport()
    handle = transport.send(read_blocks(cache, [21, 22], [2, 3]))
    receiver = KVReceiver(transport, timeout_s=1.0)
    receiver.expect(handle)
    assert receiver.load(decode_side, [(handle.key, 21, 0), (handle.key, 22, 3)]) == []
    assert torch.equal(decode_side.gpu[:, :, 0], blocks[0])
    assert torch.equal(decode_side.gpu[:, :, 3], blocks[1])


def test_a_float_engine_does_not_take_fp8_blocks():
    """A decode engine whose cache holds floats rejects an FP8 payload (it recomputes)."""
    fp8 = _filled_fp8_cache(4, 0)
    floats = KVCache(KVCacheSpec(2, 2, 8, 4, torch.float16), 4, 0, CPU)
    transport = InProcessTransport()
    handle = transport.send(read_blocks(fp8, [7], [1]))
    receiver = KVReceiver(transport, timeout_s=1.0)
    receiver.expect(handle)
    assert receiver.load(floats, [(handle.key, 7, 0)]) == [0]


@pytest.mark.parametrize(
    "bad", [2**64, -1, math.nan, 1.0, True, None, "fp16", "FP8", "", "fp8" * 100_000]
)
def test_kv_cache_dtype_rejects_anything_but_its_names(bad):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype=bad)


def test_fp8_kv_is_refused_where_nothing_reads_it():
    assert EngineConfig(kv_cache_dtype="fp8", device="cuda").kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match="kv_cache_dtype.*CUDA"):
        EngineConfig(kv_cache_dtype="fp8", device="cpu")
    with pytest.raises(ValueError, match="kv_cache_dtype.*flash_attn"):
        EngineConfig(kv_cache_dtype="fp8", device="cuda", attention_backend="flash_attn")
    # device: auto that resolves to a CPU fails when the workers' config is derived.
    config = EngineConfig(kv_cache_dtype="fp8", device="auto")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="kv_cache_dtype.*CUDA"):
            config.runner_config("/nonexistent", 128)
