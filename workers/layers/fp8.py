"""FP8 E4M3 weights with one float32 scale per output row, multiplied with dynamic per-token
activation scales (W8A8).

An `FP8Weight` holds one logical [rows, cols] matrix as float8_e4m3fn codes and a scale per row:
per-channel scales are that; a per-tensor scale (one number) is repeated on every row, which
keeps its value exactly and lets the q, k and v parts of one fused matrix keep scales of their
own. It narrows rows and columns like a tensor, so the tensor-parallel layers shard it with the
code they shard float weights with (a column split keeps every row's scale).

The product quantizes each row (token) of x to E4M3 with its own scale (max |x| / 448), then
computes x_q W_q^T scaled by both. On CUDA (compute capability 8.9 or later) that is
`torch._scaled_mm`; elsewhere a de-quantize reference computes the same values in float32
(correct, not fast). Exception: up to 16 rows of bf16/float16 activations on CUDA (decode steps)
are not quantized: a Triton kernel reads the codes and multiplies them weight-only (W8A16),
one launch instead of five (workers/layers/backends/triton_fp8_gemv.py says why).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite E4M3 value
# A scale never below this: an all-zero row (or token) quantizes to zeros instead of 0/0.
_MIN_SCALE = 1e-12
# _scaled_mm needs these multiples of K and N.
_MM_ALIGN = 16


@dataclass(slots=True)
class FP8Weight:
    """A [rows, cols] weight as E4M3 codes and a float32 scale per row."""

    codes: torch.Tensor  # float8_e4m3fn [rows, cols]
    scales: torch.Tensor  # float32 [rows]

    def __post_init__(self) -> None:
        if self.codes.dtype != FP8 or self.codes.dim() != 2:
            raise ValueError(
                f"codes: must be 2-D {FP8}, got {self.codes.dtype} {self.codes.dim()}-D"
            )
        if self.scales.shape != (self.codes.shape[0],):
            raise ValueError(
                f"scales: need one per row ({self.codes.shape[0]}), got {tuple(self.scales.shape)}"
            )

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def empty(self, rows: int, cols: int, device: torch.device) -> FP8Weight:
        """An all-zero weight of this format to load shards into."""
        return FP8Weight(
            torch.zeros(rows, cols, dtype=FP8, device=device),
            torch.zeros(rows, dtype=torch.float32, device=device),
        )

    def narrow(self, dim: int, start: int, length: int) -> FP8Weight:
        if dim == 0:
            return FP8Weight(
                self.codes.narrow(0, start, length), self.scales.narrow(0, start, length)
            )
        return FP8Weight(self.codes.narrow(1, start, length), self.scales)

    def index_rows(self, index: torch.Tensor) -> FP8Weight:
        return FP8Weight(self.codes.index_select(0, index), self.scales.index_select(0, index))

    def copy_(self, other: object) -> None:
        if not isinstance(other, FP8Weight):
            raise ValueError(f"weights: cannot copy {type(other).__name__} into FP8 weights")
        self.codes.copy_(other.codes)
        self.scales.copy_(other.scales)

    def to(self, device: torch.device) -> FP8Weight:
        return FP8Weight(self.codes.to(device), self.scales.to(device))

    def dequantize(self) -> torch.Tensor:
        """The float32 [rows, cols] matrix these codes encode."""
        return self.codes.float() * self.scales[:, None]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T in x's dtype, x quantized per token (W8A8)."""
        x2 = x.reshape(-1, x.shape[-1])
        gemv = _small_batch_kernel(x2)
        if gemv is not None:
            y = gemv(x2, self.codes, self.scales)
            return y.view(*x.shape[:-1], y.shape[-1])
        xq, xs = quantize_rows(x2)
        if x.device.type == "cuda":
            y = _scaled_mm(xq, xs, self, x.dtype)
        else:
            y = ((xq.float() @ self.codes.float().t()) * xs * self.scales).to(x.dtype)
        return y.view(*x.shape[:-1], y.shape[-1])

    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * 4


def _small_batch_kernel(
    x: torch.Tensor,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """The weight-only Triton kernel for a few 16-bit rows on CUDA (x @ W^T without quantizing x),
    or None: more rows, CPU, float32 activations, or Triton off or missing."""
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return None
    from workers.layers.fused import triton_kernels_on

    if not triton_kernels_on():
        return None
    from workers.layers.backends.triton_fp8_gemv import MAX_ROWS, fp8_gemv

    return fp8_gemv if x.shape[0] <= MAX_ROWS else None


def quantize_rows(x: torch.Tensor, per_tensor: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] as E4M3 codes and float32 scales [rows, 1] (one per row, or one value
    repeated with per_tensor), each row's largest magnitude mapped to 448."""
    amax = x.abs().amax() if per_tensor else x.abs().amax(dim=-1, keepdim=True)
    scales = (amax.float() / FP8_MAX).clamp(min=_MIN_SCALE)
    scales = scales.expand(x.shape[0], 1) if per_tensor else scales
    codes = (x.float() / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scales.contiguous()


def quantize_weight(w: torch.Tensor, per_tensor: bool = False) -> FP8Weight:
    """A float weight quantized on the fly: a scale per output row (or one for the tensor)."""
    if not bool(torch.isfinite(w).all()):
        raise ValueError("weights: cannot quantize a weight with NaN or infinite values to FP8")
    codes, scales = quantize_rows(w, per_tensor)
    return FP8Weight(codes, scales.view(-1))


def check_device(device: torch.device) -> None:
    """Raise unless FP8 weights can be multiplied on device (CUDA needs compute capability 8.9)."""
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(
            f"quantization: FP8 weights need a GPU of compute capability 8.9 or later (Ada, "
            f"Hopper); {torch.cuda.get_device_name(device)} is {major}.{minor}. Use a bf16 "
            "checkpoint with quantization: none, or an INT4 (GPTQ/AWQ) checkpoint"
        )


def _scaled_mm(
    xq: torch.Tensor, xs: torch.Tensor, w: FP8Weight, dtype: torch.dtype
) -> torch.Tensor:
    k, n = xq.shape[1], w.codes.shape[0]
    if k % _MM_ALIGN or n % _MM_ALIGN:  # shapes _scaled_mm refuses: the reference, on the GPU
        return ((xq.float() @ w.codes.float().t()) * xs * w.scales).to(dtype)
    # Row-wise scales need bf16 output; the codes' transpose is the column-major operand.
    y = torch._scaled_mm(
        xq, w.codes.t(), scale_a=xs, scale_b=w.scales.view(1, -1), out_dtype=torch.bfloat16
    )
    return y if dtype == torch.bfloat16 else y.to(dtype)
