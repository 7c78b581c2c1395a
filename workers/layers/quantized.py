"""Weights kept in GGUF blocks (Q4_0, Q4_1, Q8_0) and multiplied as stored, on CPU.

A `GGUFWeight` holds one logical [rows, cols] matrix as its codes and per-32-element block scales
(and Q4_1's block minimums), exactly the bits of the file with fp16 scales widened to float32.
It narrows, copies and permutes rows like a tensor, so the tensor-parallel layers shard it with the
code they shard float weights with; a split inside a 32-element block is refused. Its `matmul`
is the C++ kernel for small batches (decode steps, the LM head) and a de-quantised float GEMM for
large ones (prefill chunks), where the multiply, not the weight's bytes, is the cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.layers.backends import gguf_cpu
from workers.layers.fp8 import FP8Weight
from workers.layers.int4 import Int4Weight

BLOCK = 32
QTYPES = ("Q4_0", "Q4_1", "Q8_0")
# At most this many rows go through the block kernel; larger batches de-quantise the weight once
# per call into a transient float matrix and run one GEMM. Measured on SmolLM2's shapes (one
# thread): the two cross between 32 and 64 rows for the layers, near 128 for the LM head.
KERNEL_MAX_ROWS = 48


def _bytes_per_block(qtype: str) -> int:
    return BLOCK if qtype == "Q8_0" else BLOCK // 2


@dataclass(slots=True)
class GGUFWeight:
    """A [rows, cols] weight in GGUF blocks along cols."""

    qtype: str
    codes: torch.Tensor  # uint8 [rows, cols / 2] (4-bit) or [rows, cols] (Q8_0, int8 bits)
    scales: torch.Tensor  # float32 [rows, cols / 32]
    mins: torch.Tensor | None  # float32 [rows, cols / 32], Q4_1 only

    def __post_init__(self) -> None:
        if self.qtype not in QTYPES:
            raise ValueError(f"qtype: must be one of {QTYPES}, got {self.qtype!r}")
        if (self.mins is not None) != (self.qtype == "Q4_1"):
            need = "needs" if self.mins is None else "has no"
            raise ValueError(f"mins: {self.qtype} {need} mins")

    @classmethod
    def zeros(cls, qtype: str, rows: int, cols: int) -> GGUFWeight:
        """An all-zero weight to load shards into (zero codes and scales: every element 0)."""
        if cols % BLOCK:
            raise ValueError(f"cols: {qtype} needs a multiple of {BLOCK}, got {cols}")
        groups = cols // BLOCK
        return cls(
            qtype,
            torch.zeros(rows, groups * _bytes_per_block(qtype), dtype=torch.uint8),
            torch.zeros(rows, groups),
            torch.zeros(rows, groups) if qtype == "Q4_1" else None,
        )

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.scales.shape[0], self.scales.shape[1] * BLOCK))

    def _parts(self) -> list[tuple[torch.Tensor, int]]:
        """Each stored tensor with how many logical columns one of its columns spans."""
        per_code = BLOCK // _bytes_per_block(self.qtype)
        parts = [(self.codes, per_code), (self.scales, BLOCK)]
        return parts + ([(self.mins, BLOCK)] if self.mins is not None else [])

    def _apply(self, fn) -> GGUFWeight:
        codes, scales, *mins = (fn(t, span) for t, span in self._parts())
        return GGUFWeight(self.qtype, codes, scales, mins[0] if mins else None)

    def narrow(self, dim: int, start: int, length: int) -> GGUFWeight:
        """Rows (dim 0) or whole blocks of columns (dim 1) as views; a cut inside a block raises."""
        if dim == 1 and (start % BLOCK or length % BLOCK):
            raise ValueError(
                f"tensor parallelism: columns [{start}, {start + length}) cut a {self.qtype} "
                f"block of {BLOCK}; each rank's share of the input dimension must be a multiple "
                f"of {BLOCK}"
            )
        if dim == 0:
            return self._apply(lambda t, span: t.narrow(0, start, length))
        return self._apply(lambda t, span: t.narrow(1, start // span, length // span))

    def index_rows(self, index: torch.Tensor) -> GGUFWeight:
        return self._apply(lambda t, span: t.index_select(0, index))

    def copy_(self, other: GGUFWeight) -> None:
        if other.qtype != self.qtype:
            raise ValueError(f"qtype: cannot copy {other.qtype} blocks into {self.qtype} blocks")
        for (dst, _), (src, _) in zip(self._parts(), other._parts(), strict=True):
            dst.copy_(src)

    def dequantize(self) -> torch.Tensor:
        """The float32 [rows, cols] matrix these blocks encode."""
        ops = gguf_cpu.load()
        if ops is None:
            return gguf_cpu.dequantize_reference(self.qtype, self.codes, self.scales, self.mins)
        return ops.dequantize(*self._kernel_args())

    def _kernel_args(self) -> tuple:
        mins = self.mins if self.mins is not None else self.scales.new_empty(0)
        return (
            self.codes.contiguous(),
            self.scales.contiguous(),
            mins.contiguous(),
            gguf_cpu.QTYPE_IDS[self.qtype],
        )

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The de-quantised rows `ids` (an embedding lookup)."""
        return self.index_rows(ids.reshape(-1)).dequantize().to(dtype).view(*ids.shape, -1)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T in x's dtype (computed in float32)."""
        x2 = x.reshape(-1, x.shape[-1]).float()
        ops = gguf_cpu.load()
        if ops is not None and x2.shape[0] <= KERNEL_MAX_ROWS:
            y = ops.linear(x2.contiguous(), *self._kernel_args())
        else:
            y = torch.mm(x2, self.dequantize().t())
        return y.to(x.dtype).view(*x.shape[:-1], y.shape[-1])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t, _ in self._parts())


# Weights kept in a checkpoint's quantized format on any device (workers/quant_weights.py).
QUANTIZED = (FP8Weight, Int4Weight)


def load_target(param: torch.Tensor, loaded: object):
    """Where a layer's weight_loader writes `loaded`: the parameter's GGUF blocks when `loaded` is
    a GGUFWeight (allocated on the first shard, kept as `param.gguf`), its FP8 or INT4 weight when
    `loaded` is one (likewise, as `param.quant`), its float data otherwise.

    A parameter whose shards arrive in different block types (a fused q/k/v from a mixed file)
    falls back to float: what has arrived is de-quantised into its data."""
    if isinstance(loaded, QUANTIZED):
        return _quant_target(param, loaded)
    current = getattr(param, "gguf", None)
    if isinstance(loaded, GGUFWeight) and param.device.type == "cpu":
        if current is None and not getattr(param, "gguf_float", False):
            current = param.gguf = GGUFWeight.zeros(loaded.qtype, *param.shape)
        if current is not None and current.qtype == loaded.qtype:
            return current
    if current is not None:
        param.data.copy_(current.dequantize())
        del param.gguf
        param.gguf_float = True
    return param.data


def _quant_target(param: torch.Tensor, loaded: FP8Weight | Int4Weight) -> FP8Weight | Int4Weight:
    current = getattr(param, "quant", None)
    if current is None:
        current = param.quant = loaded.empty(*param.shape, device=param.device)
    if type(current) is not type(loaded):
        raise ValueError(
            f"weights: one fused weight mixes {type(current).__name__} and "
            f"{type(loaded).__name__} parts"
        )
    return current


def as_float(loaded: object) -> object:
    """A GGUF, FP8 or INT4 weight de-quantised (for float destinations); anything else
    unchanged."""
    return loaded.dequantize() if isinstance(loaded, (GGUFWeight, *QUANTIZED)) else loaded


def drop_float_copies(model: torch.nn.Module) -> int:
    """Free the (never written) float storage of every parameter held in GGUF blocks; how many."""
    count = 0
    for p in model.parameters():
        if isinstance(getattr(p, "gguf", None), GGUFWeight):
            p.data = p.data.new_empty(0)
            count += 1
    return count
