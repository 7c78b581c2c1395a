"""Whether a tensor's layer ops run as Triton kernels on CUDA: the fused elementwise ops of
workers.layers.triton_ops, the MoE experts of workers.layers.backends.triton_moe and the LoRA
updates of workers.layers.backends.triton_lora. CPU tensors always take the plain torch path.

RAYLM_TRITON_OPS picks them where Triton is installed: unset, the MoE and LoRA kernels run and the
elementwise ops take the torch path; `1` adds the elementwise ops; `0` turns every one off (for
A/B timing). The elementwise ops are opt-in because an H200 run (2026-11-26) found bf16
Llama-3-1B greedy tokens leaving HF's with them on (top-2 gaps of 0.375) and matching with them
off; see docs/model-execution.md.
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


def fused_ops(x: torch.Tensor) -> ModuleType | None:
    """workers.layers.triton_ops for a CUDA tensor when RAYLM_TRITON_OPS=1, else None."""
    if not x.is_cuda or _triton_mode() != "all":
        return None
    from workers.layers import triton_ops

    return triton_ops


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
