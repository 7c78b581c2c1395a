"""Whether a tensor's layer ops run as Triton kernels on CUDA: the fused elementwise ops of
workers.layers.triton_ops, the MoE experts of workers.layers.backends.triton_moe and the LoRA
updates of workers.layers.backends.triton_lora. CPU tensors always take the plain torch path.

RAYLM_TRITON_OPS picks them where Triton is installed: unset, the MoE and LoRA kernels and the
fused RMSNorm (with its residual add) and SiLU-and-mul run, and rotary takes the torch path; `1`
adds the rotary kernel; `0` turns every one off (for A/B timing). Rotary is opt-in because on an
H200 (2026-11-26, bench/triton_rounding.py at Llama-3.2-1B's shapes) RMSNorm and SiLU-and-mul
matched the torch path bit for bit while the rotary kernel differed in 14% of its bf16 outputs
(up to 15,228 ulps), which is what moved bf16 greedy tokens off HF's; see
docs/model-execution.md.
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


# The elementwise ops on by default: each equals the torch path bit for bit on an H200.
EXACT_OPS = frozenset({"rms_norm", "silu_and_mul"})


def fused_ops(x: torch.Tensor, op: str) -> ModuleType | None:
    """workers.layers.triton_ops when `op` runs fused for this tensor (CUDA; rotary only under
    RAYLM_TRITON_OPS=1), else None."""
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
