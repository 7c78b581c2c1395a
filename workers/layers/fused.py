"""Whether a tensor's layer ops run as the fused Triton kernels of workers.layers.triton_ops (and
its MoE experts as workers.layers.backends.triton_moe, its LoRA updates as
workers.layers.backends.triton_lora).

They do for CUDA tensors when Triton is installed, unless RAYLM_TRITON_OPS=0 (for A/B timing).
CPU tensors always take the plain torch path.
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

import torch

_ops: ModuleType | None = None
_resolved = False


def fused_ops(x: torch.Tensor) -> ModuleType | None:
    """workers.layers.triton_ops for a CUDA tensor when available and enabled, else None."""
    global _ops, _resolved
    if not x.is_cuda:
        return None
    if not _resolved:
        enabled = os.environ.get("RAYLM_TRITON_OPS", "1") != "0"
        if enabled and importlib.util.find_spec("triton") is not None:
            from workers.layers import triton_ops

            _ops = triton_ops
        _resolved = True
    return _ops


def triton_moe(x: torch.Tensor) -> ModuleType | None:
    """workers.layers.backends.triton_moe where the fused ops run (the same switch), else None."""
    if fused_ops(x) is None:
        return None
    from workers.layers.backends import triton_moe as module

    return module


def triton_lora(x: torch.Tensor) -> ModuleType | None:
    """workers.layers.backends.triton_lora where the fused ops run (the same switch), else None."""
    if fused_ops(x) is None:
        return None
    from workers.layers.backends import triton_lora as module

    return module
