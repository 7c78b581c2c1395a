"""The FP8 KV cache in the Triton decode kernel and backend, run by Triton's CPU interpreter (on
a GPU, compiled): the kernel reading E4M3 codes equals the torch decode over the same cache
de-quantized to floats, across GQA groups, head sizes, block sizes, lengths, splits and scales.
"""

from __future__ import annotations

import pytest
import torch

# First, before triton or a kernel module is imported (see triton_env's docstring).
from tests.workers.triton_env import DEVICE, HALF

# isort: split
from tests.workers.test_kv_fp8 import fp8_mixed_batch
from tests.workers.test_triton_interpreted import DecodeCase, decode_inputs, torch_decode
from workers.kv_fp8 import dequantize, quantize
from workers.layers.backends.triton_decode import TritonDecodeBackend, paged_decode
from workers.layers.backends.triton_prefill import TritonBackend

if DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("Triton converts FP8 on compute capability 8.9+ only", allow_module_level=True)

# E4M3 codes de-quantized the same way on both sides: only float rounding differs.
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def check_fp8_decode(
    case: DecodeCase, splits: int, scales: tuple[float, float], window: int | None = None
) -> None:
    q, k_float, v_float, meta = decode_inputs(case)
    kv_scale = torch.tensor(scales, dtype=torch.float32, device=DEVICE)
    # Spread the values over E4M3's range (and past it: +-448 saturates), then store codes.
    k_cache = quantize(k_float * 3 * scales[0], kv_scale[0])
    v_cache = quantize(v_float * 3 * scales[1], kv_scale[1])
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
        kv_scale=kv_scale,
    )
    k_ref = dequantize(k_cache, kv_scale[0], torch.float32).to(case.dtype)
    v_ref = dequantize(v_cache, kv_scale[1], torch.float32).to(case.dtype)
    ref = torch_decode(q, k_ref, v_ref, meta, scale, window)
    tol = TOL[case.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("splits", [1, 8])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.037, 2.5)], ids=["unit", "scaled"])
def test_fp8_decode_equals_the_dequantized_reference_with_gqa(splits, scales):
    """GQA groups of 4, contexts crossing tiles and blocks; 8 splits leave some empty."""
    check_fp8_decode(DecodeCase(), splits, scales)


def test_fp8_decode_odd_head_size_small_blocks_no_grouping():
    check_fp8_decode(DecodeCase(lens=(3, 70, 9), hq=3, hk=3, d=24, block_size=4), 2, (0.5, 0.25))


def test_fp8_decode_large_blocks_long_contexts_and_a_window():
    check_fp8_decode(
        DecodeCase(lens=(5, 129, 300), hq=8, hk=1, block_size=128), 2, (1.0, 0.1), window=150
    )


def test_fp8_decode_16_bit_queries():
    check_fp8_decode(DecodeCase(dtype=HALF), 4, (0.02, 0.02))


@pytest.mark.parametrize("backend", [TritonDecodeBackend, TritonBackend])
def test_fp8_triton_backend_on_a_mixed_batch_equals_the_float_cache(backend):
    """Prefix-cached prefill chunks, a whole-prompt prefill and decodes, through the layer: the
    FP8 cache (written by the layer) gives what a float cache of the same values gives, with
    prefill chunks through the per-request path and through the varlen prefill kernel."""
    out, ref = fp8_mixed_batch(backend(), DEVICE)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_fp8_decode_refuses_float_caches_with_a_scale():
    q, k_cache, v_cache, meta = decode_inputs(DecodeCase(lens=(4,)))
    scales = torch.ones(2, device=DEVICE)
    with pytest.raises(ValueError, match="kv_scale"):
        paged_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 1.0, kv_scale=scales)
