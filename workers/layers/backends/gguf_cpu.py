"""The C++ kernels over GGUF blocks kept quantized (gguf_linear.cpp, gguf_int8.cpp and
gguf_blocks.h beside this file).

Built once per machine and instruction-set variant into torch's extensions cache, as the
paged-decode kernel is (cpu_paged.py). On a CPU with AVX512-VNNI the build adds `-mavx512vnni`
and the int8 kernel (`pack`, `linear_packed`: activations quantized to int8 per 32-element block,
integer dot products); elsewhere only the float kernel (`linear`). The variant is part of the
library's name, so a machine without VNNI never loads a VNNI build from a shared cache. `load()`
returns None where the build fails; callers then de-quantise with `dequantize_reference` and
multiply in float (correct, slower).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from workers.layers.backends.cpu_build import build_ops

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCES = [os.path.join(_HERE, f) for f in ("gguf_linear.cpp", "gguf_int8.cpp")]
_HEADER = os.path.join(_HERE, "gguf_blocks.h")
QTYPE_IDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "Q4_K": 3, "Q5_K": 4, "Q6_K": 5}


def _has_vnni() -> bool:
    """Whether this CPU runs AVX512-VNNI (torch's own check where it has one, else the kernel's
    flags in /proc/cpuinfo)."""
    check = getattr(torch._C._cpu, "_is_avx512_vnni_supported", None)
    if check is not None:
        return bool(check())
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512_vnni" in line for line in f)
    except OSError:
        return False


def variant() -> str:
    """The instruction-set variant this machine builds: avx512_vnni, avx512, avx2 or default."""
    isa = torch.backends.cpu.get_cpu_capability().lower()
    return "avx512_vnni" if isa == "avx512" and _has_vnni() else isa


@functools.cache
@functools.cache
def int8_kernel() -> bool:
    """Whether the loaded kernel multiplies with int8 activations (a VNNI build)."""
    ops = load()
    return ops is not None and ops.isa() == "avx512_vnni"


@functools.cache
def load() -> Any | None:
    """torch.ops.raylm_gguf (`linear`, `dequantize`, `isa`; in VNNI builds `pack` and
    `linear_packed`), or None when it cannot be built."""
    isa = variant()
    vnni = ["-mavx512vnni"] if isa == "avx512_vnni" else []
    return build_ops(
        "gguf_linear",
        _SOURCES,
        "raylm_gguf",
        probe="linear",
        what="GGUF CPU kernel",
        fallback="quantized linears de-quantise",
        headers=[_HEADER],
        # contract=off: the de-quantised weight is d * q + m rounded twice, as gguf-py does.
        flags=["-ffp-contract=off", *vnni],
        variant=isa,
    )


def dequantize_reference(
    qtype: str, codes: torch.Tensor, scales: torch.Tensor | None, mins: torch.Tensor | None
) -> torch.Tensor:
    """The float32 weight [N, K] of GGUF blocks, in torch ops (the kernels' reference)."""
    if qtype in K_BYTES:
        return _dequantize_k(qtype, codes)
    assert scales is not None
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


# Bytes of one 256-element K-quant super-block.
K_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _half(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte `at` of each super-block, as float32 [rows, blocks, 1]."""
    return b[..., at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """Bytes [..., n, 32] as [..., 2n, 32] of 4-bit values: each 32 bytes' low nibbles, then
    their high nibbles."""
    return torch.stack([b & 0xF, b >> 4], dim=-2).flatten(-3, -2)


def k_scales_and_mins(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins of Q4_K / Q5_K super-blocks from their 12 bytes
    [..., 12]: bytes 0-3 and 4-7 hold scales and mins 0-3 in their low six bits; bytes 8-11
    hold the low four bits of scales 4-7 (low nibble) and mins 4-7 (high nibble), whose top two
    bits are the top two bits of bytes 0-3 (scales) and 4-7 (mins)."""
    a, m, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([a & 63, (hi & 0xF) | ((a >> 6) << 4)], dim=-1)
    mn = torch.cat([m & 63, (hi >> 4) | ((m >> 6) << 4)], dim=-1)
    return sc, mn


def _dequantize_k(qtype: str, codes: torch.Tensor) -> torch.Tensor:
    rows = codes.shape[0]
    b = codes.reshape(rows, -1, K_BYTES[qtype])
    if qtype == "Q6_K":
        low = _nibbles(b[..., 0:128].reshape(rows, -1, 2, 64)).reshape(rows, -1, 2, 128)
        bits = b[..., 128:192].reshape(rows, -1, 2, 1, 32)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
        high = ((bits >> shifts) & 3).reshape(rows, -1, 2, 128)
        q = ((low | (high << 4)).to(torch.int16) - 32).reshape(rows, -1, 16, 16).float()
        sc = b[..., 192:208].contiguous().view(torch.int8).float()
        scale = (_half(b, 208) * sc).unsqueeze(-1)  # [rows, blocks, 16, 1]
        return (scale * q).reshape(rows, -1)
    sc, mn = k_scales_and_mins(b[..., 4:16])
    scale = (_half(b, 0) * sc.float()).unsqueeze(-1)  # [rows, blocks, 8, 1]
    minimum = (_half(b, 2) * mn.float()).unsqueeze(-1)
    start = 16 if qtype == "Q4_K" else 48
    q = _nibbles(b[..., start : start + 128].reshape(rows, -1, 4, 32))  # [rows, blocks, 8, 32]
    if qtype == "Q5_K":
        shifts = torch.arange(8, dtype=torch.uint8).view(8, 1)
        q = q | (((b[..., 16:48].unsqueeze(-2) >> shifts) & 1) << 4)
    return (scale * q.float() - minimum).reshape(rows, -1)
