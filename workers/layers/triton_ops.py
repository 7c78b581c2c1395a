"""Fused elementwise kernels for CUDA: residual add + RMSNorm, rotary embedding, SiLU-and-mul.

Eager torch runs each of these as 3 to 10 small kernels. At decode batch sizes a step is bound
by those launches and their passes over memory rather than by the matrix products. Each kernel
rounds where the torch path rounds (to the activation dtype after every op that torch runs in
it), so the fused path gives the tokens of the unfused one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_xt,
    stride_xh,
    stride_rt,
    heads,
    n,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    t = row // heads
    h = row % heads
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + t * stride_rt + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * n + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
    y = (xf * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + offs, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x), or (norm(x + residual), x + residual); x is [T, N] or [T, H, N] with unit last
    stride."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    n = x.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else 1
    stride_h = x.stride(1) if x.dim() == 3 else 0
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(x.shape[0] * heads,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        res_out,
        x.stride(0),
        stride_h,
        residual.stride(0) if residual is not None else 0,
        heads,
        n,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(max(block // 256, 1), 8),
    )
    return out if residual is None else (out, res_out)


@triton.jit
def _rotate_heads(
    base_ptr,
    stride_h,
    num_heads,
    c,
    s,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """x * cos + rotate_half(x) * sin for the heads of one token, rounded as torch rounds each
    op."""
    heads = tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_HALF)
    dt = base_ptr.dtype.element_ty
    mask = (heads[:, None] < num_heads) & (offs[None, :] < HALF)
    ptrs = base_ptr + heads[:, None] * stride_h + offs[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = ((x1 * c[None, :]).to(dt).to(tl.float32) - (x2 * s[None, :]).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * c[None, :]).to(dt).to(tl.float32) + (x1 * s[None, :]).to(dt).to(tl.float32)).to(dt)
    tl.store(ptrs, o1, mask=mask)
    tl.store(ptrs + HALF, o2, mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_c,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    offs = tl.arange(0, BLOCK_HALF)
    dt = q_ptr.dtype.element_ty
    # The table is float32; torch casts it to the activation dtype before multiplying.
    c = tl.load(cos_ptr + pos * stride_c + offs, mask=offs < HALF, other=0.0).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_c + offs, mask=offs < HALF, other=0.0).to(dt).to(tl.float32)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, num_q_heads, c, s, HALF, BLOCK_H, BLOCK_HALF)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, num_k_heads, c, s, HALF, BLOCK_H, BLOCK_HALF)


def rotary_(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place at positions (cos/sin: [max_pos, D]
    float32), bit for bit as workers.layers.rotary.rotary_torch does."""
    launch_rotary(q, k, positions, cos, sin)
    return q, k


def launch_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    fp_fusion: bool = False,
) -> object:
    """rotary_'s launch; returns what Triton returns (on a GPU the compiled kernel, whose
    .asm["ptx"] bench/triton_rounding.py reads).

    fp_fusion stays off: with it on (Triton's default) the compiler narrows each product and sum
    to the 16-bit type, where each is exact after double rounding, and then contracts
    `x1 * c - x2 * s` into one fused multiply-add, which skips the rounding of one product that
    torch's separate kernels do. That moved 14% of an H200's bf16 outputs (up to 15,228 ulps where
    the difference cancels to about zero); bench/triton_rounding.py shows both launches.
    """
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q, k: need unit stride in the head dimension")
    half = q.shape[-1] // 2
    return _rotary_kernel[(q.shape[0],)](
        q,
        k,
        cos,
        sin,
        positions,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        q.shape[1],
        k.shape[1],
        HALF=half,
        BLOCK_H=triton.next_power_of_2(max(q.shape[1], k.shape[1])),
        BLOCK_HALF=triton.next_power_of_2(half),
        enable_fp_fusion=fp_fusion,
    )


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_xt, n, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(x_ptr + t * stride_xt + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_xt + n + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * n + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :n]) * x[:, n:] for x [T, 2n]."""
    n = x.shape[-1] // 2
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    block = 1024
    _silu_and_mul_kernel[(x.shape[0], triton.cdiv(n, block))](x, out, x.stride(0), n, BLOCK=block)
    return out
