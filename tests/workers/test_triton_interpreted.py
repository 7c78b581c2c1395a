"""The Triton kernels against the torch paths they replace, run by Triton's CPU interpreter.

No GPU is needed: with TRITON_INTERPRET=1, `@triton.jit` returns an interpreted function that runs
each program on CPU tensors (numpy underneath), slowly but with the kernel's own indexing, masks
and loop bounds. Shapes stay tiny so the module takes seconds.

Order matters: TRITON_INTERPRET must be set before `triton` is imported, so
tests/workers/triton_env.py (which says why, skips where triton is missing and picks DEVICE
and HALF) is imported first. On a machine with a CUDA GPU nothing is set and the same checks
run the compiled kernels on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

# First, before triton or a kernel module is imported (see triton_env's docstring).
from tests.workers.triton_env import DEVICE, HALF

# isort: split
from tests.workers.test_attention import SINKS, run_batch
from workers.layers import triton_ops
from workers.layers.activation import SiluAndMul
from workers.layers.attention import AttentionMetadata, AttentionParams, LayerKV
from workers.layers.backends.torch_ref import TorchBackend
from workers.layers.backends.triton_decode import TritonDecodeBackend, paged_decode
from workers.layers.norm import RMSNorm

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


@dataclass(frozen=True)
class DecodeCase:
    """One decode batch: context lengths (crossing 64-token tiles and cache blocks), heads, head
    size, block size."""

    lens: tuple[int, ...] = (1, 17, 64, 65, 150)
    hq: int = 8
    hk: int = 2
    d: int = 32
    block_size: int = 16
    dtype: torch.dtype = torch.float32


def decode_inputs(case: DecodeCase, seed: int = 0):
    """q [N, Hq, D], random caches (unused slots hold noise, so a stray read shows), scattered
    block tables, and the metadata of a pure-decode step."""
    gen = torch.Generator().manual_seed(seed)
    bs = case.block_size
    per_req = [-(-n // bs) for n in case.lens]
    num_blocks = sum(per_req) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(b)] for b in per_req]
    shape = (num_blocks, bs, case.hk, case.d)
    k_cache = torch.randn(shape, generator=gen).to(DEVICE, case.dtype)
    v_cache = torch.randn(shape, generator=gen).to(DEVICE, case.dtype)
    q = torch.randn(len(case.lens), case.hq, case.d, generator=gen).to(DEVICE, case.dtype)
    meta, _ = AttentionMetadata.build(
        [n - 1 for n in case.lens], [1] * len(case.lens), tables, bs, torch.device(DEVICE)
    )
    return q, k_cache, v_cache, meta


def torch_decode(q, k_cache, v_cache, meta, scale, window, **extras):
    """The torch reference backend's gather-and-SDPA decode (not the CPU C++ kernel)."""
    backend = TorchBackend()
    backend.prepare(meta)
    kv = LayerKV(k_cache, v_cache, AttentionParams(scale, window, **extras))
    return backend.decode(q, meta, kv)


def check_decode(case: DecodeCase, splits: int, window: int | None = None, **extras) -> None:
    q, k_cache, v_cache, meta = decode_inputs(case)
    scale = case.d**-0.5
    n = q.shape[0]
    out = paged_decode(
        q,
        k_cache,
        v_cache,
        meta.block_tables[:n],
        meta.seq_lens[:n],
        scale,
        splits=splits,
        window=window or 0,
        **extras,
    )
    ref = torch_decode(q, k_cache, v_cache, meta, scale, window, **extras)
    tol = TOL[case.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("splits", [1, 2, 8])
def test_paged_decode_equals_torch_with_gqa_and_splits(splits):
    """A GQA group of 4 per KV head; 8 splits leave some splits of short contexts empty."""
    check_decode(DecodeCase(), splits)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("window", [1, 40, 200])
def test_paged_decode_sliding_window(window, splits):
    """Windows shorter than some contexts (whole tiles skipped, a tile masked in part), and one
    longer than every context."""
    check_decode(DecodeCase(), splits, window)


def test_paged_decode_odd_head_size_small_blocks_no_grouping():
    """Head size 24 (padded to 32 in the kernel), 4-token blocks (16 per tile), one query head per
    KV head."""
    check_decode(DecodeCase(lens=(3, 70, 9), hq=3, hk=3, d=24, block_size=4), splits=2)


def test_paged_decode_blocks_larger_than_a_tile():
    check_decode(DecodeCase(lens=(5, 129, 300), block_size=128), splits=2, window=150)


def test_paged_decode_16_bit():
    check_decode(DecodeCase(dtype=HALF), splits=4, window=40)


# Scores here run to about +-4: a cap of 1.5 bends most of them; sinks from well below to well
# above them (one per query head).
CAP = 1.5
HEAD_SINKS = torch.tensor([-4.0, 0.0, 1.0, 3.0, -1.0, 2.0, 0.5, 6.0])


@pytest.mark.parametrize("splits", [1, 8])
@pytest.mark.parametrize(
    "softcap,sinks",
    [(CAP, None), (None, HEAD_SINKS), (CAP, HEAD_SINKS)],
    ids=["cap", "sinks", "both"],
)
def test_paged_decode_soft_cap_and_sinks(softcap, sinks, splits):
    """Split 0 carries the sink; 8 splits leave later splits of short contexts empty."""
    extras = {"softcap": softcap, "sinks": None if sinks is None else sinks.to(DEVICE)}
    check_decode(DecodeCase(), splits, **extras)


@pytest.mark.parametrize("window", [1, 40])
def test_paged_decode_soft_cap_and_sinks_in_a_sliding_window(window):
    """gpt-oss's layers: sinks with a window, where the first split starts past whole tiles."""
    check_decode(DecodeCase(), 4, window, softcap=CAP, sinks=HEAD_SINKS.to(DEVICE))


@pytest.mark.parametrize(
    "softcap,sinks", [(None, None), (CAP, None), (None, SINKS), (CAP, SINKS)], ids=str
)
def test_triton_backend_on_a_mixed_batch_equals_dense_attention(softcap, sinks):
    """The backend as the model calls it (decodes by the kernel, prefill chunks by torch) against
    transformers-style eager attention."""
    out, ref = run_batch(TritonDecodeBackend(), DEVICE, softcap=softcap, sinks=sinks)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_paged_decode_rejects_a_block_size_that_is_not_a_power_of_two():
    q, k_cache, _, meta = decode_inputs(DecodeCase(lens=(4,), block_size=16))
    k6 = torch.zeros(4, 6, *k_cache.shape[2:], device=DEVICE)
    with pytest.raises(ValueError, match="block_size"):
        paged_decode(q, k6, k6, meta.block_tables[:1], meta.seq_lens[:1], 1.0)


# The fused elementwise kernels round where the torch path rounds: equal to within a last bit.
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_kernel_equals_torch(dtype, with_residual):
    gen = torch.Generator().manual_seed(3)
    norm = RMSNorm(40, eps=1e-5)
    norm.weight.data = torch.randn(40, generator=gen).to(dtype)
    x = torch.randn(5, 40, generator=gen).to(dtype)
    residual = torch.randn(5, 40, generator=gen).to(dtype) if with_residual else None
    ref = norm(x, residual)  # CPU tensors: the torch path
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    out = triton_ops.rms_norm(dev(x), dev(norm.weight.data), norm.eps, dev(residual))
    refs, outs = (ref, out) if with_residual else ((ref,), (out,))
    for r, o in zip(refs, outs, strict=True):
        torch.testing.assert_close(o.cpu(), r)


def test_rms_norm_kernel_over_heads_of_a_strided_view():
    """Per-head q/k norms read [T, H, D] views of a fused QKV output."""
    gen = torch.Generator().manual_seed(4)
    norm = RMSNorm(16)
    norm.weight.data = torch.randn(16, generator=gen)
    qkv = torch.randn(6, 3 * 4 * 16, generator=gen)
    q = qkv[:, : 4 * 16].view(6, 4, 16)
    out = triton_ops.rms_norm(q.to(DEVICE), norm.weight.data.to(DEVICE), norm.eps)
    torch.testing.assert_close(out.cpu(), norm(q))


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_silu_and_mul_kernel_equals_torch(dtype):
    x = torch.randn(3, 2 * 1100, generator=torch.Generator().manual_seed(6)).to(dtype)
    torch.testing.assert_close(triton_ops.silu_and_mul(x.to(DEVICE)).cpu(), SiluAndMul()(x))
