"""Paged decode attention on CPU: a small C++ kernel that reads K/V through the block table.

The torch path gathers every decode request's context blocks into a fresh copy per layer and then
runs SDPA over it: the context is read twice and written once. This kernel walks the block table
instead and reads each cached key and value once, one request (or, in small batches, one
(request, KV head) pair) per task, with all the query heads it serves sharing every key and value
it loads. Scores and the weighted sum accumulate in float32 (bfloat16 caches are widened on
load); softmax takes two passes, no running rescale.

The source is paged_decode.cpp next to this file, built once per machine and CPU capability by
workers/layers/backends/cpu_build.py (ATen headers only, no pybind, so the compile stays short).
Where it cannot be built, `load()` returns None and callers keep the gather + SDPA path.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

from workers.layers.backends.cpu_build import build_ops

HEAD_SIZES = (32, 64, 96, 128, 256)  # compiled in; others keep the gather + SDPA path
DTYPES = (torch.float32, torch.bfloat16)

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCE = os.path.join(_HERE, "paged_decode.cpp")
_HEADER = os.path.join(_HERE, "cpu_math.h")


@functools.cache
def load() -> Callable[..., None] | None:
    """The compiled op (torch.ops.raylm.paged_decode), or None when it cannot be built here."""
    ops = build_ops(
        "paged_decode",
        [_SOURCE],
        "raylm",
        probe="paged_decode",
        what="CPU paged-decode kernel",
        fallback="decode attention gathers blocks instead",
        headers=[_HEADER],
    )
    return None if ops is None else ops.paged_decode


def supports(dtype: torch.dtype, head_size: int) -> bool:
    return dtype in DTYPES and head_size in HEAD_SIZES


def paged_decode(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> None:
    """out[i] = softmax(q[i] K_i^T * scale) V_i over the first seq_lens[i] cached tokens of request
    i (the last `window` of them when window > 0), K_i/V_i read through block_tables[i]. softcap >
    0 caps the scores at softcap * tanh(score / softcap); sinks (float32 [Hq]) add one logit per
    head to the softmax's denominator. Requires `load()` to have returned the op."""
    if sinks is None:
        sinks = torch.empty(0, dtype=torch.float32)
    op = load()
    if op is None:
        raise RuntimeError(
            "CPU paged-decode kernel: the C++ library could not be built (see the warning)"
        )
    op(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap, sinks)
