"""The FP8 KV cache (`kv_cache_dtype: fp8`): K and V stored as float8 E4M3 codes, half the bytes
of bf16, so `gpu_memory_utilization` gives twice the blocks.

Storage. The pools hold the codes as uint8 (one byte each): every byte copy of the cache (swap,
the prefix cache's CPU and disk tiers, the prefill-to-decode transfer) moves them unchanged, and
none of torch's indexing kernels has to support a float8 dtype. Readers reinterpret the bytes as
`torch.float8_e4m3fn` (Triton: `tl.float8e4nv`) and multiply by the layer's scale.

Scales. Each layer has one float32 scale for K and one for V (`KVCache.scales`, [layers, 2]);
an element is stored as `clamp(x / scale, -448, 448)` in E4M3 and read back as `code * scale`.
The scales are fixed at 1.0 (vLLM's default too), not calibrated: a block outlives the request
that wrote it (prefix cache hits, the disk tier's files, KV sent to another engine), so its
scale must be known before the first block is written and be the same on every engine that
shares blocks. Activations of K/V are O(1)-O(10) in the models served, inside E4M3's range (448);
larger values saturate at +-448 rather than overflowing to NaN, and E4M3's relative precision
(3 mantissa bits) is the same from 2^-6 up. Importing this module needs torch only.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite E4M3 value
DEFAULT_SCALE = 1.0


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element dtype of the KV cache for `kv_cache_dtype` (auto: the model's)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8":
        return FP8
    raise ValueError(f"kv_cache_dtype: must be one of ['auto', 'fp8'], got {kv_cache_dtype!r}")


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the pools are allocated as: FP8 codes live in uint8 bytes."""
    return torch.uint8 if dtype == FP8 else dtype


def check_device(device: torch.device, backend_name: str) -> None:
    """Raise ValueError where an FP8 KV cache cannot run: off CUDA (the CPU decode kernel reads
    floats only), on a GPU without FP8 conversions (compute capability below 8.9), or with a
    backend that cannot read the codes (flash-attn)."""
    if device.type != "cuda":
        raise ValueError(
            f"kv_cache_dtype: 'fp8' needs a CUDA GPU, this engine runs on {device.type} "
            "(the CPU paged-decode kernel reads float caches only); use 'auto'"
        )
    if backend_name == "flash_attn":
        raise ValueError(
            "kv_cache_dtype: 'fp8' is read by the triton and torch attention backends, not "
            "flash_attn; use attention_backend auto, triton or torch"
        )
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        raise ValueError(
            f"kv_cache_dtype: 'fp8' needs compute capability 8.9+ (Ada, Hopper), "
            f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}; use 'auto'"
        )


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale as E4M3 codes in uint8, saturating at +-448 (scale: a 0-d or 1-element float32
    tensor)."""
    q = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX)
    return q.to(FP8).view(torch.uint8)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 E4M3 codes -> code * scale in `dtype`."""
    return (codes.view(FP8).float() * scale).to(dtype)


def write_kv_fp8(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor,
) -> None:
    """Quantize the step's keys and values with the layer's scales (kv_scale: float32 [2], K's
    then V's) and scatter the codes into their slots of the uint8 caches."""
    hk, d = k.shape[1], k.shape[2]
    k_cache.view(-1, hk, d).index_copy_(0, slot_mapping, quantize(k, kv_scale[0]))
    v_cache.view(-1, hk, d).index_copy_(0, slot_mapping, quantize(v, kv_scale[1]))
