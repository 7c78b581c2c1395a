"""INT4 weights with a scale and an integer zero point per group of input columns (GPTQ, AWQ).

An `Int4Weight` holds one logical [rows, cols] matrix (rows = outputs, cols = inputs) in one
layout whatever the checkpoint's: 4-bit codes two per byte along the inputs (the even column in
the low nibble), and float32 scales and uint8 zero points per (row, group). Element (n, k) is
(code - zero[n, g]) * scale[n, g], g = k // group_size, or g = g_idx[k] for GPTQ's act-order.
The checkpoint's int32 packing (workers/quant_weights.py reads it) is undone exactly at load.

It narrows like a tensor, so the tensor-parallel layers shard it with their float code; a split
of the inputs must fall on a group boundary (checked, with an error naming the group size).

Kernels, chosen once by `prepare` after loading:
- CPU: torch's `_weight_int4pack_mm_for_cpu`, in float32 or bf16 (exact codes; each group's
  zero folded into a float offset, (8 - zero) * scale, as that kernel takes it); in float32 only
  up to KERNEL_MAX_ROWS rows, larger batches de-quantize (see there);
- CUDA (compute capability 8.0+): torch's `_weight_int4pack_mm` (tinygemm) in bf16;
- otherwise (an act-order weight whose shard does not hold whole groups, a shape the kernels
  refuse): the reference, which de-quantizes the weight each call and runs one GEMM.
Act-order weights whose groups are whole are reordered once by group; the input's columns are
permuted to match on each call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

GROUP_SIZES = (32, 64, 128)
# On CPU with float32 activations torch's int4pack kernel is slow for many rows (measured 11x the
# float GEMM at 64 rows): batches above this many rows de-quantize the codes, kept for them, into
# one transient float matrix instead (4-bit codes twice: still an eighth of the float32 weight).
KERNEL_MAX_ROWS = 48
# g_idx of a fused weight's target before its first part arrives.
_UNSET = -1


def unpack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, cols / 2] (low nibble first) -> uint8 [rows, cols] of values 0..15."""
    return torch.stack([codes & 15, codes >> 4], dim=-1).view(codes.shape[0], -1)


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, cols] of values 0..15 -> [rows, cols / 2], the even column in the low nibble."""
    v = values.to(torch.uint8)
    return v[:, 0::2] | (v[:, 1::2] << 4)


@dataclass(slots=True)
class Int4Weight:
    """A [rows, cols] weight as 4-bit codes with per-group scales and zero points."""

    codes: torch.Tensor  # uint8 [rows, cols / 2]
    scales: torch.Tensor  # float32 [rows, groups]
    zeros: torch.Tensor  # uint8 [rows, groups]
    group_size: int
    g_idx: torch.Tensor | None = None  # int32 [cols]: act-order group of each input; None: k // gs
    kernel: _Kernel | None = None

    def __post_init__(self) -> None:
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"group_size: must be one of {GROUP_SIZES}, got {self.group_size}")
        rows, half = self.codes.shape
        if self.scales.shape != self.zeros.shape or self.scales.shape[0] != rows:
            raise ValueError(
                f"scales: shape {tuple(self.scales.shape)} and zeros {tuple(self.zeros.shape)} "
                f"must both be [{rows}, groups]"
            )
        if self.g_idx is None and self.scales.shape[1] * self.group_size != 2 * half:
            raise ValueError(
                f"group_size: {2 * half} inputs in groups of {self.group_size} make "
                f"{2 * half // self.group_size} groups, the scales have {self.scales.shape[1]}"
            )

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.codes.shape[0], self.codes.shape[1] * 2))

    def empty(self, rows: int, cols: int, device: torch.device) -> Int4Weight:
        """An all-zero weight of this format (group size, act-order) to load shards into."""
        groups = self.scales.shape[1] if self.g_idx is not None else cols // self.group_size
        if self.g_idx is None and cols % self.group_size:
            raise ValueError(f"group_size: {cols} inputs are not whole groups of {self.group_size}")
        g_idx = None
        if self.g_idx is not None:
            g_idx = torch.full((cols,), _UNSET, dtype=torch.int32, device=device)
        return Int4Weight(
            torch.zeros(rows, cols // 2, dtype=torch.uint8, device=device),
            torch.zeros(rows, groups, dtype=torch.float32, device=device),
            torch.zeros(rows, groups, dtype=torch.uint8, device=device),
            self.group_size,
            g_idx,
        )

    def narrow(self, dim: int, start: int, length: int) -> Int4Weight:
        """Rows (dim 0) or whole groups of input columns (dim 1) as views."""
        if dim == 0:
            return Int4Weight(
                self.codes.narrow(0, start, length),
                self.scales.narrow(0, start, length),
                self.zeros.narrow(0, start, length),
                self.group_size,
                self.g_idx,
            )
        gs = self.group_size
        if start % gs or length % gs:
            raise ValueError(
                f"tensor parallelism: input columns [{start}, {start + length}) cut an INT4 group "
                f"of {gs} (group_size); each rank's share of the input dimension must be a "
                f"multiple of {gs}"
            )
        codes = self.codes.narrow(1, start // 2, length // 2)
        if self.g_idx is not None:  # act-order: the groups are scattered; keep all their scales
            g_idx = self.g_idx.narrow(0, start, length)
            return Int4Weight(codes, self.scales, self.zeros, gs, g_idx)
        scales = self.scales.narrow(1, start // gs, length // gs)
        zeros = self.zeros.narrow(1, start // gs, length // gs)
        return Int4Weight(codes, scales, zeros, gs)

    def index_rows(self, index: torch.Tensor) -> Int4Weight:
        codes, scales, zeros = (
            t.index_select(0, index) for t in (self.codes, self.scales, self.zeros)
        )
        return Int4Weight(codes, scales, zeros, self.group_size, self.g_idx)

    def copy_(self, other: object) -> None:
        if not isinstance(other, Int4Weight) or other.group_size != self.group_size:
            got = getattr(other, "group_size", type(other).__name__)
            raise ValueError(
                f"group_size: the parts of one weight must share group_size {self.group_size}, "
                f"got {got}"
            )
        if (other.g_idx is None) != (self.g_idx is None) or other.scales.shape != self.scales.shape:
            raise ValueError(
                "g_idx: the parts of one fused weight must all be act-order (or none), with the "
                "same number of groups"
            )
        if self.g_idx is not None and other.g_idx is not None:
            if bool((self.g_idx == _UNSET).all()):
                self.g_idx.copy_(other.g_idx)
            elif not torch.equal(self.g_idx, other.g_idx.to(self.g_idx.device)):
                raise ValueError(
                    "g_idx: the parts of one fused weight (q/k/v, gate/up) have different "
                    "act-order g_idx; raylm multiplies them as one matrix"
                )
        self.codes.copy_(other.codes)
        self.scales.copy_(other.scales)
        self.zeros.copy_(other.zeros)

    def groups_of_inputs(self) -> torch.Tensor:
        """The group index of every input column (int64 [cols])."""
        if self.g_idx is not None:
            return self.g_idx.long()
        cols = self.shape[1]
        return torch.arange(cols, device=self.codes.device) // self.group_size

    def dequantize(self) -> torch.Tensor:
        """The float32 [rows, cols] matrix these codes encode."""
        if self.codes.numel() == 0 and self.kernel is not None:
            raise ValueError("weights: an INT4 weight prepared for its kernel keeps no codes")
        g = self.groups_of_inputs()
        q = unpack_nibbles(self.codes).float()
        return (q - self.zeros[:, g].float()) * self.scales[:, g]

    def prepare(self, dtype: torch.dtype) -> None:
        """Pick the kernel for this weight's device and the activations' dtype, converting the
        codes into its layout once (the codes are then dropped: one copy of the weight)."""
        self.kernel = _int4pack(self, dtype)
        cpu_float32 = self.codes.device.type == "cpu" and dtype != torch.bfloat16
        if self.kernel is not None and not cpu_float32:
            self.codes = self.codes.new_empty(0, 0)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T in x's dtype."""
        x2 = x.reshape(-1, x.shape[-1])
        if self.kernel is not None and (x2.shape[0] <= KERNEL_MAX_ROWS or self.codes.numel() == 0):
            y = self.kernel(x2)
        else:
            y = F.linear(x2, self.dequantize().to(x2.dtype))
        return y.view(*x.shape[:-1], y.shape[-1])

    def nbytes(self) -> int:
        parts = [self.codes, self.scales, self.zeros]
        parts += [self.g_idx] if self.g_idx is not None else []
        parts += self.kernel.tensors() if self.kernel is not None else []
        return sum(t.numel() * t.element_size() for t in parts)


@dataclass(slots=True)
class _Kernel:
    """torch's int4pack matmul: codes in its layout, [groups, rows, 2] scales and offsets."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    group_size: int
    perm: torch.Tensor | None  # act-order: input columns in group order

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        dtype = self.scales_and_zeros.dtype
        xc = x.to(dtype).contiguous()
        if x.device.type == "cuda":
            y = torch._weight_int4pack_mm(xc, self.packed, self.group_size, self.scales_and_zeros)
        else:
            y = torch._weight_int4pack_mm_for_cpu(
                xc, self.packed, self.group_size, self.scales_and_zeros
            )
        return y.to(x.dtype)

    def tensors(self) -> list[torch.Tensor]:
        extra = [self.perm] if self.perm is not None else []
        return [self.packed, self.scales_and_zeros, *extra]


def _group_order(w: Int4Weight) -> tuple[torch.Tensor | None, bool]:
    """(permutation of the inputs into group order or None, whether groups are then whole and in
    order: every group exactly group_size inputs, as GPTQ's act-order writes them)."""
    if w.g_idx is None:
        return None, True
    g = w.g_idx.long()
    perm = torch.argsort(g, stable=True)
    cols = g.numel()
    whole = cols == w.scales.shape[1] * w.group_size and torch.equal(
        g[perm], torch.arange(cols, device=g.device) // w.group_size
    )
    return perm, whole


def _int4pack(w: Int4Weight, dtype: torch.dtype) -> _Kernel | None:
    """torch's int4pack kernel for w, or None where it does not apply (the reference runs)."""
    rows, cols = w.shape
    perm, whole = _group_order(w)
    if not whole or rows == 0 or cols % w.group_size:
        return None
    device = w.codes.device
    q = unpack_nibbles(w.codes)
    q = q.index_select(1, perm) if perm is not None else q
    scales = w.scales.t()  # [groups, rows]
    offsets = (8.0 - w.zeros.t().float()) * scales  # (q - z) s == (q - 8) s + (8 - z) s
    if device.type == "cuda":
        if torch.cuda.get_device_capability(device) < (8, 0):
            raise ValueError(
                f"quantization: INT4 weights need a GPU of compute capability 8.0 or later; "
                f"{torch.cuda.get_device_name(device)} has "
                f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}"
            )
        if rows % 8:
            return None
        # tinygemm takes uint8 [rows, cols / 2] with the even column in the high nibble.
        hi_first = (q[:, 0::2] << 4) | q[:, 1::2]
        tiles = 8 if cols % 128 == 0 else 4 if cols % 64 == 0 else 2
        try:
            packed = torch.ops.aten._convert_weight_to_int4pack(hi_first.contiguous(), tiles)
        except RuntimeError as e:  # a torch build without tinygemm: correct, if slow
            logger.warning(
                "INT4: torch's int4pack kernel refused %s (%s); de-quantizing", w.shape, e
            )
            return None
        sz_dtype = torch.bfloat16
    elif device.type == "cpu":
        if rows % 16:  # the CPU kernel's row blocks
            return None
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int().contiguous(), 2)
        sz_dtype = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
    else:
        return None
    sz = torch.stack([scales, offsets], dim=-1).to(sz_dtype).contiguous()
    return _Kernel(packed, sz, w.group_size, perm)
