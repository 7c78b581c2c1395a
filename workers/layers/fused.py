"""Whether a tensor's layer ops run as Triton kernels on CUDA: the fused elementwise ops of
workers.layers.triton_ops, the MoE experts of workers.layers.backends.triton_moe and the LoRA
updates of workers.layers.backends.triton_lora. CPU tensors always take the plain torch path.

RAYLM_TRITON_OPS picks them where Triton is installed: unset or `1`, every one runs (the MoE and
LoRA kernels, the fused RMSNorm with its residual add, SiLU-and-mul and rotary); `0` turns every
one off (for A/B timing). Each elementwise kernel must equal the torch path bit for bit to be on
by default (EXACT_OPS). On an H200 (2026-11-26, bench/triton_rounding.py at Llama-3.2-1B's shapes)
RMSNorm and SiLU-and-mul did; the rotary kernel differed in 14% of its bf16 outputs (up to 15,228
ulps) because Triton contracted a product and the sum into one fused multiply-add, skipping a
rounding torch does. Its launch now turns contraction off; it is bit-exact in Triton's
interpreter (float16, tests/workers/test_triton_rotary.py), and a GPU run of
bench/triton_rounding.py is what confirms bf16. See docs/model-execution.md.
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

import torch

_mode: str | None = None


def _triton_mode() -> str:
    """ "off", "kernels" (MoE and LoRA) or "all", from RAYLM_TRITON_OPS and Triton's presence."""
    global _mode
    if _mode is None:
        setting = os.environ.get("RAYLM_TRITON_OPS", "")
        if setting == "0" or importlib.util.find_spec("triton") is None:
            _mode = "off"
        else:
            _mode = "all" if setting == "1" else "kernels"
    return _mode


# The elementwise ops on by default: each equals the torch path bit for bit (rms_norm and
# silu_and_mul measured on an H200; rotary since its launch stopped FMA contraction).
EXACT_OPS = frozenset({"rms_norm", "silu_and_mul", "rotary"})


def fused_ops(x: torch.Tensor, op: str) -> ModuleType | None:
    """workers.layers.triton_ops when `op` runs fused for this tensor (CUDA, an op of EXACT_OPS
    or any op under RAYLM_TRITON_OPS=1), else None."""
    if not x.is_cuda:
        return None
    mode = _triton_mode()
    if mode == "off" or (mode == "kernels" and op not in EXACT_OPS):
        return None
    from workers.layers import triton_ops

    return triton_ops


def triton_kernels_on() -> bool:
    """Whether the Triton GEMM kernels (MoE, LoRA, FP8 weight-only) may run: Triton is installed
    and RAYLM_TRITON_OPS is not 0."""
    return _triton_mode() != "off"


def triton_moe(x: torch.Tensor) -> ModuleType | None:
    """workers.layers.backends.triton_moe for a CUDA tensor unless Triton is off, else None."""
    if not x.is_cuda or _triton_mode() == "off":
        return None
    from workers.layers.backends import triton_moe as module

    return module


def triton_lora(x: torch.Tensor) -> ModuleType | None:
    """workers.layers.backends.triton_lora for a CUDA tensor unless Triton is off, else None."""
    if not x.is_cuda or _triton_mode() == "off":
        return None
    from workers.layers.backends import triton_lora as module

    return module
