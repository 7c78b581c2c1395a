"""Tensor-parallel linears. Each layer holds its rank's shard and slices checkpoint tensors itself.

Column-parallel layers split the output dimension (no communication); row-parallel layers split
the input dimension and all-reduce the partial sums. At world size 1 they are plain linears.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from workers.layers import invariant
from workers.layers.param_attrs import set_param_attr
from workers.layers.quantized import QUANTIZED, AnyWeight, GGUFWeight, as_float, load_target
from workers.parallel import all_reduce, divide, get_tp_rank, get_tp_world_size

if TYPE_CHECKING:
    from workers.layers.fp8 import FP8Weight
    from workers.layers.int4 import Int4Weight
    from workers.lora.layers import LoraLayer

# Below this many rows a CPU matmul streams weights faster as W @ x^T than as x @ W^T.
_CPU_SMALL_BATCH = 128
# Row counts a packed linear runs at: exact up to this, then rounded up to one of 8 sizes per
# octave (at most 12.5% padding). oneDNN builds a primitive (~280 KiB of JIT code) per row count and
# keeps it twice, in ideep's cache and in its own (1,024 entries each), so with a step's row count
# free to take every value up to the token budget the caches filled over hours of traffic: +535 MiB
# of replica RSS over a 4,000-request soak, then churn. Buckets keep the row counts to about 80 for
# a 2,048-token budget, every primitive built once (bench/results/2026-11-25-soak.md).
_EXACT_ROWS = 16
_BUCKETS_PER_OCTAVE_BITS = 3
# Weight dtypes oneDNN packs, bf16 only where oneDNN reports bf16 support on this CPU.
_PACKABLE = {
    torch.float32: lambda: True,
    torch.bfloat16: lambda: bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
}


def cpu_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """weight reordered once into oneDNN's blocked layout for `linear`, or None where that does not
    apply.

    A packed weight skips the per-call reorder a plain linear does, which makes it faster than MKL
    sgemm (fp32) and than unpacked oneDNN (bf16) for decode batches, and no slower for prefill
    chunks (docs/decisions/0016). Any number of rows may use it (MKL's own packed sgemm
    serves only the row count it was packed for).
    """
    supported = _PACKABLE.get(weight.dtype)
    if weight.device.type != "cpu" or weight.dim() != 2 or supported is None:
        return None
    if not torch.backends.mkldnn.is_available() or not supported():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | GGUFWeight | FP8Weight | Int4Weight | None = None,
) -> torch.Tensor:
    """x @ weight^T + bias, through `packed` (cpu_pack of weight) when given and x is on CPU.

    The weight's format picks the kernel: `packed` may instead be the weight's GGUF blocks
    (workers.layers.quantized) or its FP8 or INT4 form (workers.layers.fp8, .int4), multiplied
    as stored, on any device.

    Unpacked on CPU with few rows (decode steps) it computes (weight @ x^T)^T: BLAS then walks the
    weight matrix, which comes cold from memory, about 1.5-3x faster than x @ weight^T."""
    if isinstance(packed, (GGUFWeight, *QUANTIZED)):
        y = packed.matmul(x)
        return y if bias is None else y + bias
    if x.device.type == "cpu" and invariant.active():  # one row count: one summation order
        return invariant.in_row_tiles(x, lambda t: _cpu_linear(t, weight, bias, packed))
    if x.device.type == "cpu":
        return _cpu_linear(x, weight, bias, packed)
    return F.linear(x, weight, bias)


def _cpu_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | None,
) -> torch.Tensor:
    """`linear` on CPU: oneDNN's packed weight, else (weight @ x^T)^T for a few rows."""
    if packed is not None:
        return _packed_linear(x, packed, bias)
    if x.dim() == 2 and x.shape[0] <= _CPU_SMALL_BATCH:
        y = torch.mm(weight, x.t()).t().contiguous()
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


def packed_rows(rows: int) -> int:
    """The row count a packed linear of `rows` rows runs at (see _EXACT_ROWS)."""
    if rows <= _EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 1 - _BUCKETS_PER_OCTAVE_BITS)
    return -(-rows // step) * step


def _packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x through oneDNN's packed weight, its rows padded with zeros to packed_rows (the padding
    rows' outputs are dropped; each row's output depends only on that row)."""
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    padded = packed_rows(rows)
    if padded != rows:
        x2 = torch.cat([x2, x2.new_zeros(padded - rows, x2.shape[1])])
    y = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), packed, bias, "none", [], "")
    return y[:rows].view(*x.shape[:-1], y.shape[-1])


class CpuPackedWeight(nn.Module):
    """A layer whose `weight` may be packed for CPU linears once it is loaded (see
    pack_cpu_weights).

    Once a model is loaded, drop_packed_float_copies frees the float weight beside a packed copy
    (a tied embedding keeps it), so a float CPU model holds each linear weight once. A weight
    loaded from GGUF blocks (`weight.gguf`) is used as stored instead: one copy, no packing."""

    weight: nn.Parameter
    bias: nn.Parameter | None  # registered as None without a bias
    packed: torch.Tensor | GGUFWeight | FP8Weight | Int4Weight | None = None
    # LoRA adapters' slot weights (workers/lora), attached when the engine serves adapters.
    lora: LoraLayer | None = None

    def _make_params(
        self, rows: int, cols: int, bias: bool, bias_loader: Callable[..., None]
    ) -> None:
        """An unloaded [rows, cols] weight and, with `bias`, a [rows] bias, each with the loader
        that copies this rank's shard of a checkpoint tensor into it."""
        self.weight = nn.Parameter(torch.empty(rows, cols), requires_grad=False)
        set_param_attr(self.weight, "weight_loader", self.weight_loader)
        if bias:
            self.bias = nn.Parameter(torch.empty(rows), requires_grad=False)
            set_param_attr(self.bias, "weight_loader", bias_loader)
        else:
            self.register_parameter("bias", None)

    def pack_weight(self) -> bool:
        """Pack this rank's (loaded) weight shard; True if it was packed (or is GGUF blocks, FP8 or
        INT4)."""
        if getattr(self.weight, "packed_only", False):
            return True  # its float values were dropped; the packed copy is the weight
        kept = getattr(self.weight, "gguf", None) or getattr(self.weight, "quant", None)
        self.packed = kept if kept is not None else cpu_pack(self.weight)
        return self.packed is not None


def pack_cpu_weights(model: nn.Module) -> int:
    """Pack the weights of every CpuPackedWeight layer of a loaded model; returns how many were
    packed.

    Call again after changing weights: a packed copy does not follow its weight."""
    return sum(m.pack_weight() for m in model.modules() if isinstance(m, CpuPackedWeight))


def drop_packed_float_copies(model: nn.Module) -> int:
    """Free the float values of every weight that a oneDNN-packed copy serves, and the stored
    blocks of every GGUF weight the int8 kernel has packed, unless a module that reads weights
    directly (a tied embedding) shares the parameter; returns how many.

    A dropped weight keeps its shape, dtype and device as a zero-stride view of one zero, so
    shape-only readers (LoRA slots) still work, and it is marked `packed_only` so that packing
    again keeps the packed copy instead of packing zeros. Its values are gone: call this only on a
    model whose CPU linears all run through `linear` with their packed copy."""
    packed = [m for m in model.modules() if isinstance(m, CpuPackedWeight)]
    shared = {
        id(p)
        for m in model.modules()
        if not isinstance(m, CpuPackedWeight)
        for p in m.parameters(recurse=False)
    }
    count = 0
    for m in packed:
        w = getattr(m, "weight", None)  # FusedMoE packs per expert and keeps its floats
        if not isinstance(w, torch.Tensor) or id(w) in shared:
            continue
        if isinstance(m.packed, GGUFWeight):
            count += m.packed.keep_packed_only()
            continue
        if not isinstance(m.packed, torch.Tensor) or w.numel() == 0:
            continue
        w.data = w.data.new_zeros(()).expand(w.shape)
        set_param_attr(w, "packed_only", True)
        count += 1
    return count


def _shard(loaded: torch.Tensor, dim: int, size: int, index: int) -> torch.Tensor:
    return loaded.narrow(dim, index * size, size)


def _copy(param: AnyWeight, loaded: AnyWeight, name: str) -> None:
    """Copy a checkpoint shard (a tensor, GGUF blocks, FP8 or INT4) into param (the same, or a
    float tensor)."""
    if param.shape != loaded.shape:
        raise ValueError(
            f"{name}: checkpoint shard has shape {tuple(loaded.shape)}, "
            f"expected {tuple(param.shape)}"
        )
    if isinstance(param, (GGUFWeight, *QUANTIZED)):
        param.copy_(loaded)
    else:
        param.data.copy_(as_float(loaded))


class ColumnParallelLinear(CpuPackedWeight):
    """y = x W^T + b with W split by output rows across ranks; each rank returns its slice of y."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_world_size()
        self.input_size = input_size
        self.output_size_per_rank = divide(output_size, self.tp_size, "output_size")
        self._make_params(self.output_size_per_rank, input_size, bias, self.weight_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        _copy(
            load_target(param, loaded),
            _shard(loaded, 0, param.shape[0], self.tp_rank),
            "ColumnParallelLinear",
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias, self.packed)
        return y if self.lora is None else self.lora(x, y)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matrix (gate and up); shard_id picks the part."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = [divide(s, self.tp_size, "output_sizes") for s in output_sizes]

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(
                f"shard_id: must be an index below {len(self.output_sizes)}, got {shard_id!r}"
            )
        size = self.output_sizes[shard_id]
        offset = sum(self.output_sizes[:shard_id])
        _copy(
            load_target(param, loaded).narrow(0, offset, size),
            _shard(loaded, 0, size, self.tp_rank),
            "MergedColumnParallelLinear",
        )


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix, split by heads.

    With more ranks than KV heads, each KV head is replicated on tp_size / num_kv_heads ranks.
    """

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        tp_size = get_tp_world_size()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp_size, "num_attention_heads")
        if tp_size >= num_kv_heads:
            divide(tp_size, num_kv_heads, "num_key_value_heads (replication)")
            self.num_kv_heads, self.kv_replicas = 1, tp_size // num_kv_heads
        else:
            self.num_kv_heads, self.kv_replicas = (
                divide(num_kv_heads, tp_size, "num_key_value_heads"),
                1,
            )
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output_size, bias)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        if shard_id == "q":
            offset, size, index = 0, self.q_size, self.tp_rank
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, index = self.kv_size, self.tp_rank // self.kv_replicas
        else:
            raise ValueError(f"shard_id: must be 'q', 'k' or 'v', got {shard_id!r}")
        _copy(
            load_target(param, loaded).narrow(0, offset, size),
            _shard(loaded, 0, size, index),
            "QKVParallelLinear",
        )


class RowParallelLinear(CpuPackedWeight):
    """y = x W^T + b with W split by input columns; partial sums are all-reduced, bias added
    once."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_world_size()
        self.input_size_per_rank = divide(input_size, self.tp_size, "input_size")
        self._make_params(output_size, self.input_size_per_rank, bias, self.bias_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        _copy(
            load_target(param, loaded),
            _shard(loaded, 1, param.shape[1], self.tp_rank),
            "RowParallelLinear",
        )

    def bias_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        _copy(param, as_float(loaded.narrow(0, 0, loaded.shape[0])), "RowParallelLinear.bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, packed=self.packed)
        if self.lora is not None:  # each rank's partial update, summed by the all-reduce
            y = self.lora(x, y)
        y = all_reduce(y)
        return y + self.bias if self.bias is not None else y
