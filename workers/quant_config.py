"""Which quantized format a model's linear weights load in: the checkpoint's own
(`quantization_config` in config.json: GPTQ, AWQ, compressed-tensors FP8) or FP8 applied on the
fly to a float checkpoint (`quantization: fp8`). Everything we cannot load exactly is refused here,
naming the field, before a weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workers.layers.int4 import GROUP_SIZES

# quant_method values we load, and the ones we know but refuse (with why).
METHODS = ("gptq", "awq", "compressed-tensors")
_FP8_STRATEGIES = ("channel", "tensor")


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """One model's weight format beyond plain floats."""

    method: str  # "fp8" (on the fly), "gptq", "awq", "compressed-tensors" (FP8 E4M3)
    group_size: int = 0  # INT4 formats
    # GPTQ v1 checkpoints (AutoGPTQ's "gptq" format) store each zero point minus 1.
    zero_offset: int = 0
    desc_act: bool = False  # GPTQ act-order: g_idx is read as stored, not assumed k // group_size
    per_tensor: bool = False  # FP8 on the fly: one scale per weight instead of one per row

    @property
    def is_int4(self) -> bool:
        return self.method in ("gptq", "awq")


def quant_config_of(hf_config: Any, quantization: str = "none") -> QuantConfig | None:
    """The format of hf_config's checkpoint under the `quantization` setting; None: floats."""
    stored = getattr(hf_config, "quantization_config", None)
    if stored is not None and not isinstance(stored, dict):
        stored = stored.to_dict()
    if not stored:
        return QuantConfig("fp8") if quantization == "fp8" else None
    if quantization == "fp8":
        raise ValueError(
            f"quantization: 'fp8' quantizes a float checkpoint; this one is already "
            f"{stored.get('quant_method')!r} (leave quantization at auto or none)"
        )
    method = str(stored.get("quant_method", "")).lower()
    if method in ("gptq", "awq"):
        return _int4_config(method, stored)
    if method == "compressed-tensors":
        return _compressed_tensors_config(stored)
    raise ValueError(
        f"quantization_config.quant_method: {method!r} is not supported (supported: "
        f"{', '.join(METHODS)}; FP8 checkpoints in the compressed-tensors layout)"
    )


def _int4_config(method: str, q: dict) -> QuantConfig:
    bits = q.get("bits", q.get("w_bit"))
    if bits != 4:
        raise ValueError(
            f"quantization_config.bits: only 4-bit {method} is supported, got {bits!r}"
        )
    group_size = q.get("group_size", q.get("q_group_size"))
    if group_size not in GROUP_SIZES:
        raise ValueError(
            f"quantization_config.group_size: must be one of {GROUP_SIZES}, got {group_size!r}"
        )
    if q.get("lm_head"):
        raise ValueError("quantization_config.lm_head: a quantized LM head is not supported")
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization_config.version: AWQ 'gemm' only, got {version!r}")
        if q.get("zero_point", True) is not True:
            raise ValueError(
                "quantization_config.zero_point: AWQ without zero points is not supported"
            )
        return QuantConfig("awq", group_size)
    fmt = str(q.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"quantization_config.checkpoint_format: 'gptq' or 'gptq_v2', got {fmt!r}")
    offset = 1 if fmt == "gptq" else 0
    return QuantConfig("gptq", group_size, offset, bool(q.get("desc_act", False)))


def _compressed_tensors_config(q: dict) -> QuantConfig:
    groups = q.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ValueError("quantization_config.config_groups: compressed-tensors needs one group")
    for name, group in groups.items():
        w = (group or {}).get("weights") or {}
        field = f"quantization_config.config_groups.{name}.weights"
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise ValueError(
                f"{field}: only 8-bit float (FP8 E4M3) weights are supported, got "
                f"{w.get('num_bits')!r}-bit {w.get('type')!r}"
            )
        if w.get("strategy") not in _FP8_STRATEGIES or w.get("symmetric") is False:
            raise ValueError(
                f"{field}.strategy: symmetric 'channel' or 'tensor' scales only, got "
                f"{w.get('strategy')!r}"
            )
        act = (group or {}).get("input_activations") or {}
        if act and (act.get("type") != "float" or act.get("num_bits") != 8):
            raise ValueError(
                f"quantization_config.config_groups.{name}.input_activations: FP8 or none only"
            )
    return QuantConfig("compressed-tensors")
