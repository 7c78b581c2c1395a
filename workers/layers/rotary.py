"""Rotary position embedding (neox / rotate-half layout, as Hugging Face checkpoints expect)."""

from __future__ import annotations

import math

import torch
from torch import nn

from workers.layers.fused import fused_ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_inv_freq(head_dim: int, rope_parameters: dict) -> torch.Tensor:
    """Inverse frequencies for rope_type default, linear, llama3, yarn or longrope (its short
    factors; float32, like transformers)."""
    rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_parameters.rope_type: {rope_type!r} is not supported "
            f"(supported: {SUPPORTED_ROPE_TYPES})"
        )
    base = rope_parameters["rope_theta"]
    dim = int(head_dim * rope_parameters.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "linear":
        return inv_freq / rope_parameters["factor"]
    if rope_type == "llama3":
        return _llama3_scaling(inv_freq, rope_parameters)
    if rope_type == "yarn":
        return _yarn_scaling(inv_freq, dim, rope_parameters)
    if rope_type == "longrope":
        return longrope_inv_freqs(dim, rope_parameters)[0]
    return inv_freq


def longrope_inv_freqs(dim: int, p: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """LongRoPE (Phi-3 128k): the default frequencies divided per dimension by `short_factor`
    (sequences within `original_max_position_embeddings`) and by `long_factor` (longer ones)."""
    powers = p["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    out = []
    for name in ("short_factor", "long_factor"):
        try:
            factors = torch.tensor(p[name], dtype=torch.float32)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"rope_parameters.{name}: needs {dim // 2} numbers ({exc})") from exc
        valid = bool((factors > 0).all() & factors.isfinite().all())
        if factors.shape != powers.shape or not valid:
            raise ValueError(
                f"rope_parameters.{name}: needs {dim // 2} positive finite numbers, "
                f"got shape {tuple(factors.shape)}"
            )
        out.append(1.0 / (factors * powers))  # in transformers' order, so bitwise the same
    return out[0], out[1]


def rope_attention_factor(rope_parameters: dict) -> float:
    """What cos and sin are multiplied by: 1, except under yarn (its `attention_factor`, else
    0.1 ln(factor) + 1, or the ratio of two such terms given `mscale` and `mscale_all_dim`)."""
    p = rope_parameters
    rope_type = p.get("rope_type", p.get("type"))
    if rope_type == "longrope":  # sqrt(1 + ln(factor) / ln(original length)) unless given
        if p.get("attention_factor") is not None:
            return float(p["attention_factor"])
        factor, old_len = p["factor"], p["original_max_position_embeddings"]
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    if rope_type != "yarn":
        return 1.0
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if p.get("mscale") and p.get("mscale_all_dim"):
        return mscale(p["factor"], p["mscale"]) / mscale(p["factor"], p["mscale_all_dim"])
    return mscale(p["factor"])


def _yarn_scaling(inv_freq: torch.Tensor, dim: int, p: dict) -> torch.Tensor:
    # YaRN: interpolate (divide by `factor`) the frequencies that turn fewer than beta_slow times
    # over the original context, keep those that turn more than beta_fast times, ramp between.
    base, factor = p["rope_theta"], p["factor"]
    old_len = p["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers does, against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def _llama3_scaling(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between.
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Applies rotary embedding to q and k at given positions from a precomputed cos/sin table.

    Under longrope the table holds the short factors' rows, then (from row `long_offset`) the long
    factors' rows: the model picks a token's rows by adding long_offset to its position."""

    # [rows, head_dim] tables, registered as (non-persistent) buffers
    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_position: int, rope_parameters: dict) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, rope_parameters)
        if inv_freq.numel() * 2 != head_dim:
            raise ValueError(
                "rope_parameters.partial_rotary_factor: partial rotary is not supported"
            )
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        self.long_offset = 0
        if rope_parameters.get("rope_type") == "longrope":
            long_inv_freq = longrope_inv_freqs(inv_freq.numel() * 2, rope_parameters)[1]
            long_freqs = torch.outer(positions, long_inv_freq)
            freqs, self.long_offset = torch.cat([freqs, long_freqs]), max_position
        emb = torch.cat((freqs, freqs), dim=-1)
        mscale = rope_attention_factor(rope_parameters)
        self.register_buffer("cos", emb.cos() * mscale, persistent=False)
        self.register_buffer("sin", emb.sin() * mscale, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D]; returns both rotated, in their dtype (in place on CUDA)."""
        ops = fused_ops(q, "rotary")
        if ops is not None:
            return ops.rotary_(q, k, positions, self.cos, self.sin)
        return rotary_torch(q, k, positions, self.cos, self.sin)


def rotary_torch(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path, and the rounding the fused kernel reproduces: the float32 table's rows cast
    to q's dtype, then each product and the sum rounded to that dtype (one kernel per op)."""
    return apply_rotary(q, k, cos[positions], sin[positions])


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hk, D] rotated by each token's own cos/sin row ([T, D]; M-RoPE and
    the vision towers pick rows per axis), the rows cast to q's dtype as rotary_torch rounds."""
    cos = cos.unsqueeze(1).to(q.dtype)
    sin = sin.unsqueeze(1).to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
