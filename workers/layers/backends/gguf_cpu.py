"""The C++ kernels over GGUF blocks kept quantized (gguf_linear.cpp beside this file).

Built once per machine and CPU capability into torch's extensions cache, as the paged-decode
kernel is (cpu_paged.py). `load()` returns None where the build fails; callers then de-quantise
with `dequantize_reference` and multiply in float (correct, slower).
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch

from workers.layers.backends.cpu_paged import _ISA_FLAGS, _put_ninja_on_path

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gguf_linear.cpp")
QTYPE_IDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}


@functools.cache
def load():
    """torch.ops.raylm_gguf (its `linear` and `dequantize`), or None when it cannot be built."""
    try:
        from torch.utils.cpp_extension import load as build

        _put_ninja_on_path()
        isa = torch.backends.cpu.get_cpu_capability().lower()
        # contract=off: the de-quantised weight is d * q + m rounded twice, as gguf-py computes it.
        flags = ["-O3", "-fopenmp", "-ffp-contract=off", *_ISA_FLAGS.get(isa, [])]
        t0 = time.perf_counter()
        build(
            name=f"raylm_gguf_linear_{isa}",
            sources=[_SOURCE],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
        ops = torch.ops.raylm_gguf
    except Exception as exc:
        logger.warning("GGUF CPU kernel unavailable, quantized linears de-quantise: %r", exc)
        return None
    logger.info("GGUF CPU kernel ready (%s, %.1fs)", isa, time.perf_counter() - t0)
    return ops


def dequantize_reference(
    qtype: str, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None
) -> torch.Tensor:
    """The float32 weight [N, K] of GGUF blocks, in torch ops (the kernels' reference)."""
    rows, blocks = scales.shape
    if qtype == "Q8_0":
        q = codes.view(torch.int8).reshape(rows, blocks, 32).float()
    else:
        b = codes.reshape(rows, blocks, 16)
        q = torch.cat([b & 0xF, b >> 4], dim=-1).float()
        if qtype == "Q4_0":
            q = q - 8
    w = scales.unsqueeze(-1) * q
    if mins is not None:
        w = w + mins.unsqueeze(-1)
    return w.reshape(rows, blocks * 32)
