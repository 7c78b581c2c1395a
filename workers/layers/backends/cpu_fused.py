"""Fused elementwise layer ops on CPU: residual add + RMSNorm, SiLU-and-mul, rotary, KV-cache write.

The CPU counterpart of workers/layers/triton_ops.py, with the same functions, picked by
workers/layers/fused.py for CPU tensors. Eager torch runs a decoder layer's norms, activation and
rotary as about 50 small ops (pow, mean, rsqrt, mul, add, chunk, cat, neg, index, index_copy_),
each paying a few microseconds of dispatch and allocation: at batch 1 on SmolLM2-135M that was
about half of a decode step. Here each is one call into cpu_fused.cpp (built by cpu_build.py),
which reads the cos/sin table by position itself (no per-layer `cos[positions]` lookup).

Numerics: each op rounds where the torch path rounds (to the activation dtype after every op torch
runs in it). In float32 rotary and the cache write equal the torch path bit for bit; RMSNorm sums
its squares in float64 (torch in float32, in another order) and SiLU uses its own exp (within about
2 ulp), so those two are within a few float32 ulps of a float64 reference
(tests/workers/test_cpu_fused.py states the bounds).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from workers.layers.backends.cpu_build import build_ops

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCE = os.path.join(_HERE, "cpu_fused.cpp")
_HEADER = os.path.join(_HERE, "cpu_math.h")
# The small-row float32 linear (cpu_gemm.py) shares this library: one build, one load.
_SMALL_GEMM = os.path.join(_HERE, "small_gemm.cpp")


@functools.cache
def load() -> Any | None:
    """torch.ops.raylm_fused (rms_norm, add_rms_norm, silu_and_mul, rotary_, write_kv,
    small_linear), or None when it cannot be built here."""
    return build_ops(
        "cpu_fused",
        [_SOURCE, _SMALL_GEMM],
        "raylm_fused",
        probe="write_kv",
        what="CPU fused layer ops",
        fallback="norms, activation, rotary and cache writes run as torch ops",
        headers=[_HEADER],
        # No fused multiply-add: each product and sum rounds as torch's separate ops round.
        flags=["-ffp-contract=off"],
    )


def _ops() -> Any:
    ops = load()
    if ops is None:
        raise RuntimeError("CPU fused ops: the C++ library could not be built (see the warning)")
    return ops


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x), or (norm(x + residual), x + residual); x is [N], [T, N] or [T, H, N] (a per-head
    norm) with unit last stride; weight is x's dtype or float32 (then the norm is float32)."""
    if residual is None:
        return _ops().rms_norm(x, weight, eps)
    return _ops().add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :n]) * x[..., n:] for x [..., 2n]."""
    if x.dim() == 2:
        return _ops().silu_and_mul(x)
    if x.dim() == 0:
        raise ValueError("x: needs a last dimension of 2n elements, got a scalar")
    out = _ops().silu_and_mul(x.reshape(-1, x.shape[-1]))
    return out.view(*x.shape[:-1], -1)


def rotary_(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place at positions (int64 [T]; cos/sin: float32
    [max_pos, R], R <= D: the first R of each head's D rotate, the rest pass through), bit for
    bit as workers.layers.rotary.rotary_torch does in float32."""
    if positions.dtype == torch.int32:  # torch's indexing takes either
        positions = positions.long()
    _ops().rotary_(q, k, positions, cos, sin)
    return q, k


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k_cache[slot] = k[t] and v_cache[slot] = v[t] for slot = slot_mapping[t] (int64 [T]); the
    caches are contiguous, of k's dtype, in whole [Hk, D] slots."""
    _ops().write_kv(k, v, k_cache, v_cache, slot_mapping)
