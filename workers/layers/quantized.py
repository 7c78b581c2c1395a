"""Weights kept in GGUF blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K), multiplied as stored on CPU.

A `GGUFWeight` holds one logical [rows, cols] matrix in the file's blocks, exactly its bits:
- the legacy types as codes and per-32-element block scales (and Q4_1's block minimums), fp16
  scales widened to float32;
- the K-quants as the file's 256-element super-blocks unchanged (fp16 d and dmin, 6-bit or 8-bit
  sub-block scales and mins, the quants), which the kernel reads directly.
It narrows, copies and permutes rows like a tensor, so the tensor-parallel layers shard it with the
code they shard float weights with; a split inside a block (32) or super-block (256) is refused,
naming the tensor.

Its `matmul`, where the kernel was built with AVX512-VNNI, quantizes the activations to int8 per
32-element block and multiplies integer codes (gguf_int8.cpp) at every row count, over the blocks
packed once into 16-row tiles: once the model is loaded, a linear's tiles are its only copy
(`keep_packed_only`); a tied embedding keeps its stored blocks to look rows up in. Elsewhere it
is the float kernel for small batches (decode steps, the LM head) and a de-quantised float GEMM
for large ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from workers.layers.backends import gguf_cpu
from workers.layers.fp8 import FP8Weight
from workers.layers.int4 import Int4Weight
from workers.layers.param_attrs import set_param_attr

BLOCK = 32
SUPER_BLOCK = 256
K_QTYPES = ("Q4_K", "Q5_K", "Q6_K")
QTYPES = ("Q4_0", "Q4_1", "Q8_0", *K_QTYPES)
# Without the int8 kernel, at most this many rows go through the float block kernel; larger
# batches de-quantise the weight once per call into a transient float matrix and run one GEMM.
# Measured on SmolLM2's shapes (one thread): the two cross between 32 and 64 rows for the layers,
# near 128 for the LM head. (The int8 kernel beats both at every row count: no limit.)
KERNEL_MAX_ROWS = 48


def block_layout(qtype: str) -> tuple[int, int]:
    """(elements, bytes of codes) of one block: 32 elements for the legacy types (their scales
    apart), a whole 256-element super-block for the K-quants."""
    if qtype in K_QTYPES:
        return SUPER_BLOCK, gguf_cpu.K_BYTES[qtype]
    return BLOCK, BLOCK if qtype == "Q8_0" else BLOCK // 2


def _block_word(qtype: str) -> str:
    return "super-block" if qtype in K_QTYPES else "block"


@dataclass(slots=True)
class GGUFWeight:
    """A [rows, cols] weight in GGUF blocks along cols."""

    qtype: str
    # legacy: uint8 [rows, cols / 2] (4-bit) or [rows, cols] (Q8_0, int8 bits);
    # K-quants: uint8 [rows, cols / 256 * bytes per super-block], the file's super-blocks
    codes: torch.Tensor
    scales: torch.Tensor | None  # float32 [rows, cols / 32]; None for K-quants (in the codes)
    mins: torch.Tensor | None  # float32 [rows, cols / 32], Q4_1 only
    name: str = ""  # the checkpoint tensor's name, for errors
    # The int8 kernel's 16-row tiles of these blocks (gguf_cpu `pack`), made on first use; any
    # change to the blocks (copy_) drops them.
    packed: tuple[torch.Tensor, ...] | None = field(default=None, repr=False, compare=False)
    # Set once keep_packed_only freed the stored blocks: the shape they had.
    freed_shape: torch.Size | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.qtype not in QTYPES:
            raise ValueError(f"qtype: must be one of {QTYPES}, got {self.qtype!r}")
        if (self.scales is None) != (self.qtype in K_QTYPES):
            need = "has no" if self.scales is None else "keeps no separate"
            raise ValueError(f"scales: {self.qtype} {need} scales")
        if (self.mins is not None) != (self.qtype == "Q4_1"):
            need = "needs" if self.mins is None else "has no"
            raise ValueError(f"mins: {self.qtype} {need} mins")

    @classmethod
    def zeros(cls, qtype: str, rows: int, cols: int, name: str = "") -> GGUFWeight:
        """An all-zero weight to load shards of `name` into (zero codes and scales: every
        element 0); `cols` (a rank's share of the inputs) must be whole blocks."""
        elements, nbytes = block_layout(qtype)
        if cols % elements:
            raise ValueError(
                f"tensor parallelism: {name or 'a weight'}'s share of {cols} input columns cuts "
                f"a {qtype} {_block_word(qtype)} of {elements}; each rank's share of the input "
                f"dimension must be a multiple of {elements}"
            )
        blocks = cols // elements
        codes = torch.zeros(rows, blocks * nbytes, dtype=torch.uint8)
        if qtype in K_QTYPES:
            return cls(qtype, codes, None, None, name)
        mins = torch.zeros(rows, blocks) if qtype == "Q4_1" else None
        return cls(qtype, codes, torch.zeros(rows, blocks), mins, name)

    @property
    def shape(self) -> torch.Size:
        if self.freed_shape is not None:
            return self.freed_shape
        elements, nbytes = block_layout(self.qtype)
        return torch.Size((self.codes.shape[0], self.codes.shape[1] // nbytes * elements))

    def _parts(self) -> list[tuple[torch.Tensor, int]]:
        """Each stored tensor with how many of its columns one block takes."""
        self._check_blocks()
        parts = [(self.codes, block_layout(self.qtype)[1])]
        return parts + [(t, 1) for t in (self.scales, self.mins) if t is not None]

    def _apply(self, fn: Callable[[torch.Tensor, int], torch.Tensor]) -> GGUFWeight:
        codes, *rest = (fn(t, width) for t, width in self._parts())
        scales = rest[0] if rest else None
        mins = rest[1] if len(rest) > 1 else None
        return GGUFWeight(self.qtype, codes, scales, mins, self.name)

    def narrow(self, dim: int, start: int, length: int) -> GGUFWeight:
        """Rows (dim 0) or whole blocks of columns (dim 1) as views; a cut inside a block raises."""
        elements = block_layout(self.qtype)[0]
        if dim == 1 and (start % elements or length % elements):
            raise ValueError(
                f"tensor parallelism: {self.name or 'a weight'}'s columns [{start}, "
                f"{start + length}) cut a {self.qtype} {_block_word(self.qtype)} of {elements}; "
                f"each rank's share of the input dimension must be a multiple of {elements}"
            )
        if dim == 0:
            return self._apply(lambda t, width: t.narrow(0, start, length))
        first, count = start // elements, length // elements
        return self._apply(lambda t, width: t.narrow(1, first * width, count * width))

    def index_rows(self, index: torch.Tensor) -> GGUFWeight:
        return self._apply(lambda t, width: t.index_select(0, index))

    def copy_(self, other: object) -> None:
        if not isinstance(other, GGUFWeight):
            raise ValueError(
                f"{self.name or 'a weight'}: cannot copy {type(other).__name__} into GGUF blocks"
            )
        if other.qtype != self.qtype:
            raise ValueError(f"qtype: cannot copy {other.qtype} blocks into {self.qtype} blocks")
        for (dst, _), (src, _) in zip(self._parts(), other._parts(), strict=True):
            dst.copy_(src)
        self.packed = None

    def dequantize(self) -> torch.Tensor:
        """The float32 [rows, cols] matrix these blocks encode."""
        ops = gguf_cpu.load()
        if ops is None:
            return gguf_cpu.dequantize_reference(self.qtype, self.codes, self.scales, self.mins)
        return ops.dequantize(*self._kernel_args())

    def _check_blocks(self) -> None:
        if self.freed_shape is not None:
            raise RuntimeError(
                f"{self.name or 'a GGUF weight'}: its blocks were freed once packed for the int8 "
                "kernel; only matmul can use it"
            )

    def _kernel_args(self) -> tuple:
        self._check_blocks()
        empty = torch.empty(0)
        return (
            self.codes.contiguous(),
            (self.scales if self.scales is not None else empty).contiguous(),
            (self.mins if self.mins is not None else empty).contiguous(),
            gguf_cpu.QTYPE_IDS[self.qtype],
        )

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The de-quantised rows `ids` (an embedding lookup)."""
        return self.index_rows(ids.reshape(-1)).dequantize().to(dtype).view(*ids.shape, -1)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T in x's dtype (computed in float32)."""
        # Called ~120 times a decode step: no-op casts and views are skipped in Python, where
        # they cost less than a dispatch each.
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        ops = gguf_cpu.load()
        if ops is not None and gguf_cpu.int8_kernel():  # int8_kernel implies a loaded library
            if self.packed is None:
                self.packed = tuple(ops.pack(*self._kernel_args()))
            rows, qtype = self.shape[0], gguf_cpu.QTYPE_IDS[self.qtype]
            y = ops.linear_packed(x2, *self.packed, rows, qtype)
        elif ops is not None and x2.shape[0] <= KERNEL_MAX_ROWS:
            y = ops.linear(x2, *self._kernel_args())
        else:
            y = torch.mm(x2, self.dequantize().t())
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])

    def keep_packed_only(self) -> bool:
        """Pack the blocks for the int8 kernel now and free the stored ones, so the tiles are the
        weight's only copy (de-quantising, sharding and copying into it then raise); False, with
        nothing freed, where the kernel is not the int8 one."""
        ops = gguf_cpu.load()
        if ops is None or not gguf_cpu.int8_kernel():
            return False
        if self.packed is None:
            self.packed = tuple(ops.pack(*self._kernel_args()))
        self.freed_shape = self.shape
        self.codes = self.codes.new_empty(0, 0)
        self.scales = None if self.scales is None else self.scales.new_empty(0, 0)
        self.mins = None if self.mins is None else self.mins.new_empty(0, 0)
        return True

    def nbytes(self) -> int:
        if self.freed_shape is not None:
            return sum(t.numel() * t.element_size() for t in self.packed or ())
        return sum(t.numel() * t.element_size() for t, _ in self._parts())


# Weights kept in a checkpoint's quantized format on any device (workers/quant_weights.py).
QUANTIZED = (FP8Weight, Int4Weight)
# What a checkpoint tensor may arrive as, and what a parameter's weight may be held as.
AnyWeight = torch.Tensor | GGUFWeight | FP8Weight | Int4Weight


def load_target(param: torch.Tensor, loaded: object) -> AnyWeight:
    """Where a layer's weight_loader writes `loaded`: the parameter's GGUF blocks when `loaded` is
    a GGUFWeight (allocated on the first shard, kept as `param.gguf`), its FP8 or INT4 weight when
    `loaded` is one (likewise, as `param.quant`), its float data otherwise.

    A parameter whose shards arrive in different block types, or as blocks and floats (a fused
    q/k/v from a mixed file), falls back to float: what has arrived is de-quantised into its data,
    and so is every later shard."""
    if isinstance(loaded, QUANTIZED):
        return _quant_target(param, loaded)
    current = getattr(param, "gguf", None)
    if isinstance(loaded, GGUFWeight) and param.device.type == "cpu":
        if current is None and not getattr(param, "gguf_float", False):
            rows, cols = param.shape
            current = GGUFWeight.zeros(loaded.qtype, rows, cols, loaded.name)
            set_param_attr(param, "gguf", current)
        if current is not None and current.qtype == loaded.qtype:
            return current
    if current is not None:
        param.data.copy_(current.dequantize())
        delattr(param, "gguf")
    # Float from here on, whichever shard came first: a later block shard is de-quantised into it.
    set_param_attr(param, "gguf_float", True)
    return param.data


def _quant_target(param: torch.Tensor, loaded: FP8Weight | Int4Weight) -> FP8Weight | Int4Weight:
    current = getattr(param, "quant", None)
    if current is None:
        rows, cols = param.shape
        current = loaded.empty(rows, cols, device=param.device)
        set_param_attr(param, "quant", current)
    if type(current) is not type(loaded):
        raise ValueError(
            f"weights: one fused weight mixes {type(current).__name__} and "
            f"{type(loaded).__name__} parts"
        )
    return current


def float_only(loaded: AnyWeight, name: str) -> torch.Tensor:
    """`loaded` where only a float tensor can go (plain parameters, experts); a GGUF, FP8 or INT4
    weight raises, naming the tensor."""
    if not isinstance(loaded, torch.Tensor):
        raise ValueError(f"{name}: {type(loaded).__name__} weights are not supported here")
    return loaded


def load_param(
    param: torch.Tensor, loaded: AnyWeight, shard_id: int | str | None, name: str
) -> None:
    """One checkpoint tensor into its parameter: through the parameter's own `weight_loader`
    (sharded, fused or quantized layers), else a float copy of the same shape (ValueError naming
    the tensor otherwise)."""
    loader = getattr(param, "weight_loader", None)
    if loader is not None:
        loader(param, loaded, shard_id)
        return
    whole = float_only(loaded, name)
    if whole.shape != param.shape:
        raise ValueError(
            f"{name}: checkpoint has shape {tuple(whole.shape)}, expected {tuple(param.shape)}"
        )
    param.data.copy_(whole)


def as_float(loaded: AnyWeight) -> torch.Tensor:
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
