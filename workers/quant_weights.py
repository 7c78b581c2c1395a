"""Quantized checkpoints read into FP8Weight / Int4Weight, and FP8 applied on the fly.

`quantized_tensors` wraps the loader's (name, tensor) stream: the parts of each quantized linear
(GPTQ and AWQ `qweight`, `qzeros`, `scales`, `g_idx`; compressed-tensors' FP8 `weight` and
`weight_scale`) are gathered, checked and yielded as one `<prefix>.weight`, which the
tensor-parallel layers shard like a float weight. Every other tensor passes through.

Published layouts, undone exactly here (no float detour):
- GPTQ: qweight int32 [in / 8, out], input k in nibble k % 8 of row k // 8; qzeros int32
  [groups, out / 8], output n in nibble n % 8 of column n // 8, stored minus 1 in the v1 format;
  scales [groups, out]; g_idx int32 [in] (act-order; else k // group_size).
- AWQ: qweight int32 [in, out / 8] and qzeros [groups, out / 8], nibble i of column c holding
  output 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]; scales [groups, out]; zero points stored as they are.
- compressed-tensors FP8: weight float8_e4m3fn [out, in], weight_scale [out, 1] (channel) or one
  value (tensor); a static input_scale is not used (activations are scaled per token).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from workers.layers.fp8 import FP8, FP8Weight, check_device, quantize_weight
from workers.layers.int4 import Int4Weight, pack_nibbles
from workers.layers.param_attrs import set_param_attr
from workers.layers.quantized import AnyWeight
from workers.quant_config import QuantConfig

logger = logging.getLogger(__name__)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output of each nibble, within a packed column
_INT4_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_FP8_PARTS = ("weight", "weight_scale", "input_scale")
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def quantized_tensors(
    weights: Iterable[tuple[str, torch.Tensor]], qc: QuantConfig | None
) -> Iterator[tuple[str, AnyWeight]]:
    """The stream with each quantized linear's parts assembled into one weight (see module)."""
    if qc is None or qc.method == "fp8":
        yield from weights
        return
    parts_of = _INT4_PARTS if qc.is_int4 else _FP8_PARTS
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part not in parts_of or (part == "weight" and tensor.dtype != FP8):
            yield name, tensor
            continue
        pending.setdefault(prefix, {})[part] = tensor
    for prefix, parts in pending.items():
        yield f"{prefix}.weight", _assemble(prefix, parts, qc)


def _assemble(
    prefix: str, parts: dict[str, torch.Tensor], qc: QuantConfig
) -> FP8Weight | Int4Weight:
    need = ("qweight", "qzeros", "scales") if qc.is_int4 else ("weight", "weight_scale")
    missing = [p for p in need if p not in parts]
    if missing:
        raise ValueError(f"weights: {prefix} lacks {', '.join(missing)} ({qc.method} checkpoint)")
    if qc.method == "gptq":
        return gptq_weight(prefix, parts, qc)
    if qc.method == "awq":
        return awq_weight(prefix, parts, qc)
    return fp8_weight(prefix, parts)


def _unpack_int32(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., c] -> uint8 [..., 8c]: nibble j of element i becomes element 8i + j."""
    nibbles = (packed.to(torch.int32).unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 15
    return nibbles.to(torch.uint8).flatten(-2)


def _finite_scales(prefix: str, scales: torch.Tensor) -> torch.Tensor:
    s = scales.float()
    if not bool(torch.isfinite(s).all()):
        raise ValueError(f"weights: {prefix}.scales has NaN or infinite values")
    return s


def _check_int4(prefix: str, qc: QuantConfig, n: int, k: int, parts: dict) -> int:
    """The number of groups, after checking every part's shape against (n, k) and group_size."""
    groups = -(-k // qc.group_size)
    for part, shape in (("scales", (groups, n)), ("qzeros", (groups, n // 8))):
        got = tuple(parts[part].shape)
        if got != shape:
            raise ValueError(
                f"weights: {prefix}.{part} has shape {got}, expected {shape} for {k} inputs in "
                f"groups of {qc.group_size} (quantization_config.group_size) and {n} outputs"
            )
    if k % qc.group_size or n % 8:
        raise ValueError(
            f"weights: {prefix} has {k} inputs and {n} outputs; INT4 needs whole groups of "
            f"{qc.group_size} inputs and outputs in eights"
        )
    return groups


def gptq_weight(prefix: str, parts: dict[str, torch.Tensor], qc: QuantConfig) -> Int4Weight:
    qweight = parts["qweight"]
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"weights: {prefix}.qweight must be 2-D int32, got {qweight.dtype}")
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    groups = _check_int4(prefix, qc, n, k, parts)
    codes = _unpack_int32(qweight.t()).view(n, k)  # [n, k/8] -> [n, k]
    zeros = _unpack_int32(parts["qzeros"]).view(groups, n) + qc.zero_offset
    scales = _finite_scales(prefix, parts["scales"])
    g_idx = _g_idx(prefix, parts.get("g_idx"), k, groups, qc.group_size)
    return Int4Weight(
        pack_nibbles(codes), scales.t().contiguous(), zeros.t().contiguous(), qc.group_size, g_idx
    )


def _g_idx(
    prefix: str, g_idx: torch.Tensor | None, k: int, groups: int, group_size: int
) -> torch.Tensor | None:
    """The act-order group of each input, or None where it is k // group_size."""
    if g_idx is None:
        return None
    g = g_idx.to(torch.int64)
    if tuple(g.shape) != (k,):
        raise ValueError(f"weights: {prefix}.g_idx has shape {tuple(g.shape)}, expected ({k},)")
    if bool(((g < 0) | (g >= groups)).any()):
        raise ValueError(f"weights: {prefix}.g_idx has group indices outside [0, {groups})")
    if torch.equal(g, torch.arange(k) // group_size):
        return None
    return g.to(torch.int32)


def awq_weight(prefix: str, parts: dict[str, torch.Tensor], qc: QuantConfig) -> Int4Weight:
    qweight = parts["qweight"]
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"weights: {prefix}.qweight must be 2-D int32, got {qweight.dtype}")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    groups = _check_int4(prefix, qc, n, k, parts)
    codes = _awq_columns(_unpack_int32(qweight))  # [k, n]
    zeros = _awq_columns(_unpack_int32(parts["qzeros"]))  # [groups, n]
    scales = _finite_scales(prefix, parts["scales"])
    assert zeros.shape == (groups, n)
    return Int4Weight(
        pack_nibbles(codes.t()), scales.t().contiguous(), zeros.t().contiguous(), qc.group_size
    )


def _awq_columns(unpacked: torch.Tensor) -> torch.Tensor:
    """Nibble-order columns [..., 8c] into output order: nibble i of c is output 8c + ORDER[i]."""
    rows, cols = unpacked.shape
    inverse = torch.argsort(torch.tensor(AWQ_ORDER))
    return unpacked.view(rows, cols // 8, 8)[:, :, inverse].reshape(rows, cols)


def fp8_weight(prefix: str, parts: dict[str, torch.Tensor]) -> FP8Weight:
    weight, scale = parts["weight"], parts["weight_scale"].float()
    n = weight.shape[0]
    if scale.numel() == 1:
        scale = scale.reshape(1).expand(n)
    elif scale.numel() == n:
        scale = scale.reshape(n)
    else:
        raise ValueError(
            f"weights: {prefix}.weight_scale has shape {tuple(parts['weight_scale'].shape)}; "
            f"expected one scale per output ({n}) or one for the tensor"
        )
    if not bool(torch.isfinite(scale).all()):
        raise ValueError(f"weights: {prefix}.weight_scale has NaN or infinite values")
    if bool(((weight.view(torch.uint8) & 0x7F) == 0x7F).any()):  # E4M3's only NaN pattern
        raise ValueError(f"weights: {prefix}.weight has NaN values")
    if "input_scale" in parts:
        logger.debug("%s: static input_scale ignored; activations are scaled per token", prefix)
    return FP8Weight(weight, scale.contiguous())


def quantize_model_fp8(model: nn.Module, per_tensor: bool = False) -> int:
    """Quantize every tensor-parallel linear's float weight to FP8 (each rank its own shard);
    the LM head and embeddings stay in float. Returns how many."""
    from workers.layers.linear import ColumnParallelLinear, RowParallelLinear

    count = 0
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            param = module.weight
            if getattr(param, "quant", None) is None and getattr(param, "gguf", None) is None:
                set_param_attr(param, "quant", quantize_weight(param.data, per_tensor))
                count += 1
    return count


def attach_quantized(model: nn.Module, dtype: torch.dtype) -> int:
    """Hand each layer its FP8 / INT4 weight for its forward (INT4 prepared for its kernel) and
    free the float storage it was built with. Returns how many."""
    from workers.layers.linear import CpuPackedWeight

    count = 0
    for module in model.modules():
        quant = getattr(getattr(module, "weight", None), "quant", None)
        if not isinstance(module, CpuPackedWeight) or quant is None:
            continue
        if isinstance(quant, FP8Weight):
            check_device(quant.codes.device)
        else:
            quant.prepare(dtype)
        module.packed = quant
        module.weight.data = module.weight.data.new_empty(0)
        count += 1
    return count
