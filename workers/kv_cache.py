"""The paged KV cache: per-layer K and V tensors, their sizing, and swap copies to a CPU pool.

Layout per layer: [num_blocks, block_size, num_kv_heads, head_dim] for K and for V; a latent
attention layer (workers/layers/mla.py) keeps one such tensor, its rows serving as both
(`kv_parts` 1). A CPU pool of the same layout holds swapped-out blocks (pinned on CUDA so copies
can overlap).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from workers.kv_fp8 import DEFAULT_SCALE, FP8, storage_dtype
from workers.layers.attention import Attention
from workers.layers.mla import MLADims, is_mla_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

GiB = 1 << 30


@dataclass(slots=True, frozen=True)
class KVCacheSpec:
    """Shape of one rank's cache, enough to size it."""

    num_layers: int
    num_kv_heads: int  # per rank
    head_dim: int
    block_size: int
    dtype: torch.dtype  # of the elements: the model's, or float8_e4m3fn (workers/kv_fp8.py)
    kv_parts: int = 2  # tensors per layer: K and V, or 1 for MLA's latent rows (both in one)

    def __post_init__(self) -> None:
        if self.kv_parts not in (1, 2):
            raise ValueError(f"kv_parts: must be 1 (latent) or 2 (K and V), got {self.kv_parts}")
        if self.kv_parts == 1 and self.dtype == FP8:
            raise ValueError("kv_cache_dtype: fp8 is not supported for latent attention (MLA)")

    @property
    def storage_dtype(self) -> torch.dtype:
        """What the pools are allocated as (FP8 codes are kept as uint8 bytes)."""
        return storage_dtype(self.dtype)

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes across all layers, K and V (or MLA's latent rows)."""
        elem = torch.empty(0, dtype=self.dtype).element_size()
        per_token = self.kv_parts * self.num_kv_heads * self.head_dim * elem
        return self.num_layers * self.block_size * per_token

    def blocks_in(self, num_bytes: float) -> int:
        return max(int(num_bytes // self.block_bytes), 0)

    @classmethod
    def of(cls, layers: list[Attention], block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        first = layers[0]
        return cls(
            len(layers), first.num_kv_heads, first.head_dim, block_size, dtype, first.kv_parts
        )

    @classmethod
    def from_hf_config(
        cls, config: PretrainedConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1
    ) -> KVCacheSpec:
        """One rank's spec, from the model config (KV heads are replicated when tp_size > their
        count). An MLA model caches one latent row per token and layer, on every rank."""
        if is_mla_config(config):
            width = MLADims.from_hf_config(config).cache_width
            return cls(config.num_hidden_layers, 1, width, block_size, dtype, kv_parts=1)
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        # A hybrid model (Qwen3-Next, Granite-4 hybrid) has paged KV on its attention layers only.
        types = list(getattr(config, "layer_types", None) or ())
        linear = types.count("linear_attention")
        layers = len(types) - linear if linear else None
        return cls(
            layers or config.num_hidden_layers,
            max(kv_heads // tp_size, 1),
            head_dim,
            block_size,
            dtype,
        )


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed pool. On CPU its memory comes from calloc, whose large blocks are fresh pages the
    kernel zeroes when each is first touched: a pool of gigabytes is ready at once, instead of
    after a memset of all of it (about a second per 2 GiB on a small machine), and holds memory
    only as blocks are used."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class KVCache:
    """Owns the device and CPU pools and binds the device pool to the model's attention layers."""

    def __init__(
        self, spec: KVCacheSpec, num_gpu_blocks: int, num_cpu_blocks: int, device: torch.device
    ) -> None:
        if num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks: must be >= 1, got {num_gpu_blocks}")
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks: must be >= 0, got {num_cpu_blocks}")
        self.spec = spec
        shape = (
            spec.num_layers,
            spec.kv_parts,
            num_gpu_blocks,
            spec.block_size,
            spec.num_kv_heads,
            spec.head_dim,
        )
        # One allocation; zeros so padded block-table entries read finite values.
        self.gpu = zeros(shape, spec.storage_dtype, device)
        cpu_shape = (spec.num_layers, spec.kv_parts, num_cpu_blocks, *shape[3:])
        if device.type == "cuda":
            self.cpu = torch.zeros(cpu_shape, dtype=spec.storage_dtype, pin_memory=True)
        else:
            self.cpu = zeros(cpu_shape, spec.storage_dtype, device)
        # FP8 codes: each layer's K and V scales (fixed, see workers/kv_fp8.py); None: floats.
        self.scales: torch.Tensor | None = None
        if spec.dtype == FP8:
            self.scales = torch.full(
                (spec.num_layers, 2), DEFAULT_SCALE, dtype=torch.float32, device=device
            )
        logger.info(
            "KV cache: %d device blocks (%.2f GiB), %d CPU blocks (%.2f GiB)",
            num_gpu_blocks,
            num_gpu_blocks * spec.block_bytes / GiB,
            num_cpu_blocks,
            num_cpu_blocks * spec.block_bytes / GiB,
        )

    @property
    def num_gpu_blocks(self) -> int:
        return self.gpu.shape[2]

    @property
    def num_cpu_blocks(self) -> int:
        return self.cpu.shape[2]

    def bind(self, layers: list[Attention]) -> None:
        """Point every attention layer at its K and V slices of the pool (one slice serves as
        both for a latent layer)."""
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = self.gpu[i, 0], self.gpu[i, self.spec.kv_parts - 1]
            layer.kv_scale = None if self.scales is None else self.scales[i]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy (gpu_block, cpu_block) pairs device -> CPU."""
        if pairs:
            gpu_ids, cpu_ids = self._ids(pairs)
            self.cpu[:, :, cpu_ids] = self.gpu[:, :, gpu_ids.to(self.gpu.device)].to("cpu")

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy (gpu_block, cpu_block) pairs CPU -> device."""
        if pairs:
            gpu_ids, cpu_ids = self._ids(pairs)
            blocks = self.cpu[:, :, cpu_ids].to(self.gpu.device, non_blocking=True)
            self.gpu[:, :, gpu_ids.to(self.gpu.device)] = blocks

    def _ids(self, pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        for g, c in pairs:
            if not (0 <= g < self.num_gpu_blocks and 0 <= c < self.num_cpu_blocks):
                raise ValueError(
                    f"blocks_to_swap: pair ({g}, {c}) is outside the pools "
                    f"({self.num_gpu_blocks} device, {self.num_cpu_blocks} CPU blocks)"
                )
        ids = torch.tensor(pairs, dtype=torch.long)
        return ids[:, 0], ids[:, 1]


def cpu_num_blocks(spec: KVCacheSpec, kv_cache_memory_gb: float) -> int:
    """Device blocks that fit kv_cache_memory_gb GiB (the CPU device's budget)."""
    return spec.blocks_in(kv_cache_memory_gb * GiB)


def cuda_num_blocks(spec: KVCacheSpec, device: torch.device, gpu_memory_utilization: float) -> int:
    """Blocks that fit the memory left under gpu_memory_utilization after a profiling forward.

    Call after the profiling run: its peak (weights + activations) is what the cache must leave.
    """
    free, total = torch.cuda.mem_get_info(device)
    peak = torch.cuda.max_memory_allocated(device)
    # Memory used by other processes on the same GPU is not ours to take.
    used_by_others = total - free - torch.cuda.memory_reserved(device)
    budget = total * gpu_memory_utilization - peak - max(used_by_others, 0)
    logger.info(
        "CUDA memory: total %.2f GiB, peak of profiling run %.2f GiB, KV budget %.2f GiB",
        total / GiB,
        peak / GiB,
        budget / GiB,
    )
    blocks = spec.blocks_in(max(budget, 0))
    if blocks < 1:
        # The peak counts every tensor this process holds: another engine alive in the same
        # process (or one whose memory is still referenced) takes its share out of this budget.
        raise ValueError(
            f"gpu_memory_utilization: {gpu_memory_utilization} of {total / GiB:.1f} GiB leaves no "
            f"room for one KV block: this process already peaks at {peak / GiB:.1f} GiB (weights, "
            f"activations and any other engine it holds) and other processes use "
            f"{max(used_by_others, 0) / GiB:.1f} GiB; raise gpu_memory_utilization or set "
            "num_gpu_blocks"
        )
    return blocks
