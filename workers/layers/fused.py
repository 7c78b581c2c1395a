"""Whether a tensor's layer ops run fused: as Triton kernels on CUDA (the elementwise ops of
workers.layers.triton_ops, the MoE experts of workers.layers.backends.triton_moe and the LoRA
updates of workers.layers.backends.triton_lora), as C++ ops on CPU (the elementwise ops and the
KV-cache write of workers.layers.backends.cpu_fused).

RAYLM_CPU_FUSED picks the CPU ops: unset or `1`, they run wherever their library builds (a
warning and the torch path where it does not); `0` turns them off (for A/B timing). In float32
rotary and the cache write equal the torch path bit for bit, RMSNorm and SiLU-and-mul are within a
few ulps of it (their sum order and exp differ; tests/workers/test_cpu_fused.py).

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
from collections.abc import Iterator
from contextlib import contextmanager
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
TRITON_OPS = EXACT_OPS  # what workers.layers.triton_ops provides
CPU_OPS = frozenset({"rms_norm", "silu_and_mul", "rotary", "write_kv"})
# What the C++ ops take (cpu_fused.cpp); a float16 CPU tensor takes the torch path.
CPU_DTYPES = frozenset({torch.float32, torch.bfloat16})

_cpu_module: ModuleType | None = None
_cpu_checked = False


def _cpu_ops() -> ModuleType | None:
    """workers.layers.backends.cpu_fused unless RAYLM_CPU_FUSED=0 or its library cannot be
    built (decided once per process)."""
    global _cpu_module, _cpu_checked
    if not _cpu_checked:
        _cpu_checked, _cpu_module = True, None
        if os.environ.get("RAYLM_CPU_FUSED", "") != "0":
            from workers.layers.backends import cpu_fused

            _cpu_module = cpu_fused if cpu_fused.load() is not None else None
    return _cpu_module


@contextmanager
def cpu_fused_off() -> Iterator[None]:
    """CPU tensors take the torch path inside the block (same-process A/B timing and tests)."""
    global _cpu_module, _cpu_checked
    saved = _cpu_ops()
    _cpu_module = None
    try:
        yield
    finally:
        _cpu_module, _cpu_checked = saved, True


def fused_ops(x: torch.Tensor, op: str) -> ModuleType | None:
    """The module whose function runs `op` fused for this tensor, else None: for a CPU tensor
    workers.layers.backends.cpu_fused (an op of CPU_OPS on a CPU_DTYPES tensor, unless
    RAYLM_CPU_FUSED=0); for a CUDA
    tensor workers.layers.triton_ops (an op of EXACT_OPS, or of TRITON_OPS under
    RAYLM_TRITON_OPS=1)."""
    if x.is_cpu:
        return _cpu_ops() if op in CPU_OPS and x.dtype in CPU_DTYPES else None
    if not x.is_cuda or op not in TRITON_OPS:
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
