"""Paged decode attention on CPU: a small C++ kernel that reads K/V through the block table.

The torch path gathers every decode request's context blocks into a fresh copy per layer and then
runs SDPA over it: the context is read twice and written once. This kernel walks the block table
instead and reads each cached key and value once, one request (or, in small batches, one
(request, KV head) pair) per task, with all the query heads it serves sharing every key and value
it loads. Scores and the weighted sum accumulate in float32 (bfloat16 caches are widened on
load); softmax takes two passes, no running rescale.

The source is paged_decode.cpp next to this file. It is built once per machine and CPU capability
by torch.utils.cpp_extension.load (ATen headers only, no pybind, so the compile stays short),
cached in torch's extensions directory (~/.cache/torch_extensions unless TORCH_EXTENSIONS_DIR
says otherwise); later processes only load the built library. It needs a C++ compiler and ninja
(the `ninja` package is a dependency). Without them, or if the build fails, `load()` returns None
and callers keep the gather + SDPA path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import time

import torch

logger = logging.getLogger(__name__)

HEAD_SIZES = (32, 64, 96, 128, 256)  # compiled in; others keep the gather + SDPA path
DTYPES = (torch.float32, torch.bfloat16)

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "paged_decode.cpp")

# Vector flags per torch's own view of the CPU; part of the library's name, so a cache directory
# shared between machines never hands one machine code built for another's instruction set.
_ISA_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
}


def _put_ninja_on_path() -> None:
    """torch builds with `ninja` from PATH. The pip package (a dependency) installs it in the
    environment's scripts folder, which is on PATH only in an activated venv; CI and `make test`
    run .venv/bin/python directly."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def _source_digest() -> str:
    with open(_SOURCE, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:12]


@functools.cache
def load():
    """The compiled op (torch.ops.raylm.paged_decode), or None when it cannot be built here."""
    try:
        from torch.utils.cpp_extension import load as build

        _put_ninja_on_path()
        isa = torch.backends.cpu.get_cpu_capability().lower()
        flags = ["-O3", "-fopenmp", *_ISA_FLAGS.get(isa, [])]
        t0 = time.perf_counter()
        build(
            # The source's hash in the name: checkouts with different kernels (another branch's
            # worktree, an older install) sharing one extensions directory never load each
            # other's library or rebuild over each other.
            name=f"raylm_paged_decode_{isa}_{_source_digest()}",
            sources=[_SOURCE],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
        op = torch.ops.raylm.paged_decode
    except Exception as exc:
        logger.warning(
            "CPU paged-decode kernel unavailable, decode attention gathers blocks instead: %r", exc
        )
        return None
    logger.info("CPU paged-decode kernel ready (%s, %.1fs)", isa, time.perf_counter() - t0)
    return op


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
    load()(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap, sinks)
