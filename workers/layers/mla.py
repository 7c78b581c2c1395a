"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over a paged cache of latents.

Each token's keys and values are one compressed latent c (kv_lora_rank wide) expanded per head by
kv_b_proj: k_nope = W_UK c, v = W_UV c, plus one rotary key k_pe (qk_rope_head_dim) shared by all
heads. The cache keeps only [c, k_pe] per token and layer, one "KV head" of L + R numbers, instead
of every head's K and V (DeepSeek-V3: 576 numbers instead of 128 x (192 + 128) = 40,960).

The up-projections are absorbed: q_nope . k_nope = (W_UK^T q_nope) . c, so each head's query
becomes [W_UK^T q_nope, q_pe] (L + R wide) and attends over the cached [c, k_pe] rows as one
multi-query attention whose values are those same rows; the first L numbers of a head's output,
times W_UV, are its value output. That is ordinary paged attention with one KV head, run by
the torch backend (`latent_backend`: the CPU decode kernel where L + R is a size it compiles,
gather + SDPA elsewhere, CUDA included; Triton is refused until it is validated on these shapes).
Prefill chunks are absorbed too (one path; they cost L + R per head and token rather than the
expanded qk_head_dim).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn

from workers.layers.attention import (
    Attention,
    AttentionBackend,
    AttentionMetadata,
    LayerKV,
    select_backend,
)
from workers.layers.param_attrs import set_param_attr
from workers.layers.quantized import as_float
from workers.parallel import divide, get_tp_rank, get_tp_world_size

_MAX_WIDTH = 1 << 16  # no published model's rank or head width comes near


@dataclass(frozen=True, slots=True)
class MLADims:
    """The widths of one MLA layer (all heads; TP shards the heads)."""

    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int
    q_lora_rank: int | None  # None: q_proj straight from the hidden state (DeepSeek-V2-Lite)

    def __post_init__(self) -> None:
        for name in ("num_heads", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank"):
            _check_width(name, getattr(self, name))
        _check_width("qk_rope_head_dim", self.qk_rope_head_dim)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim: must be even, got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None:
            _check_width("q_lora_rank", self.q_lora_rank)

    @classmethod
    def from_hf_config(cls, config: object) -> MLADims:
        return cls(
            num_heads=getattr(config, "num_attention_heads", None),  # type: ignore[arg-type]
            qk_nope_head_dim=getattr(config, "qk_nope_head_dim", None),  # type: ignore[arg-type]
            qk_rope_head_dim=getattr(config, "qk_rope_head_dim", None),  # type: ignore[arg-type]
            v_head_dim=getattr(config, "v_head_dim", None),  # type: ignore[arg-type]
            kv_lora_rank=getattr(config, "kv_lora_rank", None),  # type: ignore[arg-type]
            q_lora_rank=getattr(config, "q_lora_rank", None),
        )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Numbers cached per token and layer: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def full_attention_width(self) -> int:
        """Numbers per token and layer a cache of expanded K and V heads would hold."""
        return self.num_heads * (self.qk_head_dim + self.v_head_dim)


def _check_width(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= _MAX_WIDTH:
        raise ValueError(f"{name}: must be an integer in [1, {_MAX_WIDTH}], got {value!r}")


def is_mla_config(config: object) -> bool:
    """Whether an HF config describes latent attention (its cache holds latents)."""
    return getattr(config, "kv_lora_rank", None) is not None


def mla_softmax_scale(dims: MLADims, rope_parameters: dict) -> float:
    """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek's
    long-context configs): the query/key scale their rotary table does not carry."""
    scale = dims.qk_head_dim**-0.5
    mscale_all_dim = rope_parameters.get("mscale_all_dim") or 0
    if rope_parameters.get("rope_type", "default") != "default" and mscale_all_dim:
        factor = rope_parameters["factor"]
        m = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= m * m
    return scale


def latent_backend(name: str) -> str:
    """The attention backend latent layers run for `attention_backend: name`: torch (the paged C++
    decode kernel on CPU where L + R is a compiled size, else gather + SDPA, on CUDA too). The
    Triton and flash-attn kernels are not yet validated on one KV head of L + R (576 for
    DeepSeek-V3) serving a whole rank's query heads, so they are refused by name rather than run
    untested."""
    if name in ("auto", "torch"):
        return "torch"
    raise ValueError(
        f"attention_backend: {name!r} does not run latent attention (MLA) yet; use auto or torch"
    )


def bind_backend(
    layers: list[Attention], device: torch.device, name: str, dtype: torch.dtype, block_size: int
) -> AttentionBackend:
    """Choose the backend for a model's attention layers (latent ones: `latent_backend`) and bind
    it to each. The one place the rule is applied: the target's runner and a draft model both call
    it, so a latent draft cannot run on a backend its target would refuse."""
    if layers[0].kv_parts == 1:
        name = latent_backend(name)
    backend = select_backend(
        device, name, dtype, head_dim=layers[0].head_dim, block_size=block_size
    )
    for layer in layers:
        layer.backend = backend
    return backend


class KVUpProjection(nn.Module):
    """kv_b_proj: [heads * (nope + v), L], this rank's heads, kept as floats and used only
    absorbed (never as a linear over expanded K/V)."""

    def __init__(self, dims: MLADims) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.num_heads = divide(dims.num_heads, get_tp_world_size(), "num_attention_heads")
        self.nope, self.v = dims.qk_nope_head_dim, dims.v_head_dim
        rows = self.num_heads * (self.nope + self.v)
        self.weight = nn.Parameter(torch.empty(rows, dims.kv_lora_rank), requires_grad=False)
        set_param_attr(self.weight, "weight_loader", self.weight_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        rows = param.shape[0]
        mine = as_float(loaded).narrow(0, self.tp_rank * rows, rows)
        if mine.shape != param.shape:
            raise ValueError(
                f"kv_b_proj: checkpoint shard has shape {tuple(mine.shape)}, "
                f"expected {tuple(param.shape)}"
            )
        param.data.copy_(mine)

    def _per_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.weight.view(self.num_heads, self.nope + self.v, -1)
        return w[:, : self.nope], w[:, self.nope :]  # W_UK [H, nope, L], W_UV [H, v, L]

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """[T, H, nope] -> [T, H, L]: each head's query in latent space."""
        w_uk = self._per_head()[0]
        return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)

    def expand_output(self, o_latent: torch.Tensor) -> torch.Tensor:
        """[T, H, L] -> [T, H * v]: each head's attention-weighted latent through W_UV."""
        w_uv = self._per_head()[1]
        o = torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2))
        return o.transpose(0, 1).reshape(o_latent.shape[0], -1)


class LatentAttention(Attention):
    """Paged attention whose cache holds one row of [latent, rotary key] per token: one KV head of
    L + R, the same tensor serving as keys and values (kv_parts = 1 in workers/kv_cache.py)."""

    kv_parts = 1

    def __init__(self, num_heads: int, dims: MLADims, scale: float) -> None:
        super().__init__(num_heads, dims.cache_width, 1, scale)
        self.kv_lora_rank = dims.kv_lora_rank

    def layer_kv(self, sinks: torch.Tensor | None = None) -> LayerKV:
        """The cache as Attention binds it, with the value width set to the latent's: the paged
        decode kernel then never sums the rotary columns it would drop."""
        kv = super().layer_kv(sinks)
        if kv.value_width != self.kv_lora_rank:
            kv = self._kv = replace(kv, value_width=self.kv_lora_rank)
        return kv

    def forward(  # type: ignore[override]
        self, q: torch.Tensor, latent: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, H, L + R] absorbed queries, latent: [T, L + R] this step's cache rows ->
        [T, H, L], each head's attention-weighted latent."""
        if self.backend is None or self.k_cache.numel() == 0:
            raise RuntimeError("Attention: KV cache and backend must be bound before the forward")
        if self.kv_scale is not None:
            raise ValueError("kv_cache_dtype: fp8 is not supported for latent attention (MLA)")
        rows = latent.view(latent.shape[0], 1, -1)
        self.k_cache.view(-1, 1, rows.shape[-1]).index_copy_(0, meta.slot_mapping, rows)
        out = self.backend.forward(q, rows, rows, meta, self.layer_kv())
        return out[..., : self.kv_lora_rank]
