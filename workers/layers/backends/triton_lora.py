"""CUDA: a LoRA layer's batched update (workers/lora/layers.py) as Triton shrink and expand
kernels in the style of Punica's segmented GEMMs, over the step's `LoraBatch` groups.

Shrink: one program per (slot, block of the slot's rows) gathers its token rows of x and multiplies
them by the slot's stacked A, giving xa [slots, group, segments * rank] (padding rows zero).
Expand: one program per (slot, block of rows, tile of one segment's output) multiplies its rows'
xa by the slot's B of that segment and adds the result into y at the token rows, in place. A token
row belongs to one slot, so no two programs write one element; padding rows are not written.
Every op rounds to the activation dtype where the torch path (bmm, bmm, index_add_) rounds.

Verified under Triton's CPU interpreter and compiled on an H200 in bfloat16
(tests/workers/test_triton_lora.py); not timed on a GPU and not yet captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.layers.backends.triton_tiles import rows_times_weight


@triton.jit
def _slot_rows(index_ptr, group, BLOCK_M: tl.constexpr):
    """This program's slot, its block of the slot's group (offsets and which are in the group) and
    their token rows (padding: row 0)."""
    slot = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_group = offs_m < group
    rows = tl.load(index_ptr + slot * group + offs_m, mask=in_group, other=0).to(tl.int64)
    return slot, offs_m, in_group, rows


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    xa_ptr,
    index_ptr,
    valid_ptr,
    group,
    in_features,
    width,
    stride_xt,
    stride_as,
    stride_ar,
    stride_xas,
    stride_xag,
    HAS_VALID: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    slot, offs_m, in_group, rows = _slot_rows(index_ptr, group, BLOCK_M)
    offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < width
    a = a_ptr + slot.to(tl.int64) * stride_as
    acc = rows_times_weight(
        x_ptr, rows, stride_xt, in_group, a, offs_r, stride_ar, mask_r, in_features,
        BLOCK_M, BLOCK_R, BLOCK_K, PRECISION,
    )  # fmt: skip
    dt = xa_ptr.dtype.element_ty
    out = acc.to(dt)
    if HAS_VALID:  # padding rows' updates are zero, as the torch path's mul by `valid`
        keep = tl.load(valid_ptr + slot * group + offs_m, mask=in_group, other=0.0)
        out = (out.to(tl.float32) * keep.to(tl.float32)[:, None]).to(dt)
    tl.store(
        xa_ptr + slot * stride_xas + offs_m[:, None] * stride_xag + offs_r[None, :],
        out,
        mask=in_group[:, None] & mask_r[None, :],
    )


@triton.jit
def _expand_kernel(
    xa_ptr,
    b_ptr,
    y_ptr,
    index_ptr,
    valid_ptr,
    group,
    rank,
    size,
    xa_offset,
    y_offset,
    stride_xas,
    stride_xag,
    stride_bs,
    stride_br,
    stride_yt,
    HAS_VALID: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):
    slot, offs_m, in_group, rows = _slot_rows(index_ptr, group, BLOCK_M)
    write = in_group
    if HAS_VALID:  # padding rows point at row 0: never write there for them
        keep = tl.load(valid_ptr + slot * group + offs_m, mask=in_group, other=0.0)
        write = write & (keep != 0)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < size
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    xa = tl.load(
        xa_ptr + slot * stride_xas + offs_m[:, None] * stride_xag + xa_offset + offs_r[None, :],
        mask=in_group[:, None] & mask_r[None, :],
        other=0.0,
    )
    b = tl.load(
        b_ptr + slot.to(tl.int64) * stride_bs + offs_r[:, None] * stride_br + offs_n[None, :],
        mask=mask_r[:, None] & mask_n[None, :],
        other=0.0,
    )
    dt = y_ptr.dtype.element_ty
    delta = tl.dot(xa, b, input_precision=PRECISION).to(dt).to(tl.float32)
    ptrs = y_ptr + rows[:, None] * stride_yt + y_offset + offs_n[None, :]
    mask = write[:, None] & mask_n[None, :]
    y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (y + delta).to(dt), mask=mask)


def lora_update(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    bs: list[torch.Tensor],
    index: torch.Tensor,
    valid: torch.Tensor | None,
    num_slots: int,
    group: int,
) -> torch.Tensor:
    """y [T, out] += each grouped row's x [T, in] @ A_slot^T @ B_slot, in place; returns y.

    a: [slots, segments * rank, in]; bs: per segment [slots, rank, size], the segments tiling y's
    columns in order; index: [num_slots * group] token rows; valid: [num_slots, group, 1] or None
    (no padding)."""
    m, g = num_slots, group
    width, in_features = a.shape[1], a.shape[2]
    rank = width // len(bs)
    if x.stride(-1) != 1 or y.stride(-1) != 1 or a.stride(-1) != 1:
        raise ValueError("x, y, a: need unit stride in their last dimension")
    if any(b.stride(-1) != 1 for b in bs):
        raise ValueError("bs: need unit stride in their last dimension")
    if m == 0 or g == 0:
        return y
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    block_m = 16 if g <= 16 else 32 if g <= 32 else 64
    block_r = max(16, triton.next_power_of_2(rank))
    xa = torch.empty((m, g, width), dtype=x.dtype, device=x.device)
    has_valid = valid is not None
    valid_arg = valid.contiguous() if valid is not None else index  # read only with HAS_VALID
    _shrink_kernel[(m, triton.cdiv(g, block_m), triton.cdiv(width, block_r))](
        x,
        a,
        xa,
        index,
        valid_arg,
        g,
        in_features,
        width,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        xa.stride(0),
        xa.stride(1),
        HAS_VALID=has_valid,
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        BLOCK_K=32,
        PRECISION=precision,
    )
    offset, block_n = 0, 64
    for k, b in enumerate(bs):
        size = b.shape[2]
        _expand_kernel[(m, triton.cdiv(g, block_m), triton.cdiv(size, block_n))](
            xa,
            b,
            y,
            index,
            valid_arg,
            g,
            rank,
            size,
            k * rank,
            offset,
            xa.stride(0),
            xa.stride(1),
            b.stride(0),
            b.stride(1),
            y.stride(0),
            HAS_VALID=has_valid,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_R=block_r,
            PRECISION=precision,
        )
        offset += size
    return y
