"""The weight-only FP8 kernel for small batches against the float product of its de-quantized
weight, run by Triton's CPU interpreter (or compiled, on a CUDA GPU): row counts 1..16, shapes
whose N and K are not multiples of the tiles, per-channel and per-tensor scales, a row shard.

As in test_triton_interpreted.py, TRITON_INTERPRET=1 must be set before triton is imported
(tests/conftest.py and tests/workers/triton_env.py do it); `make test-triton` runs these alone.
"""

from __future__ import annotations

import pytest
import torch

# First, before triton or a kernel module is imported (see triton_env's docstring).
from tests.workers.triton_env import DEVICE, HALF

# isort: split
from workers.layers.backends.triton_fp8_gemv import MAX_ROWS, fp8_gemv
from workers.layers.fp8 import FP8Weight, quantize_weight


def _weight(n: int, k: int, per_tensor: bool = False, seed: int = 0) -> FP8Weight:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    q = quantize_weight(w, per_tensor)
    return FP8Weight(q.codes.to(DEVICE), q.scales.to(DEVICE))


def _check(x: torch.Tensor, w: FP8Weight) -> None:
    y = fp8_gemv(x, w.codes, w.scales)
    ref = x.double() @ w.dequantize().double().t()
    # float32 sums of exact products; one rounding to the 16-bit output dtype at the end
    bound = torch.finfo(x.dtype).eps * ref.abs().max().item() + 1e-3
    assert y.dtype == x.dtype and y.shape == ref.shape
    assert (y.double() - ref).abs().max().item() <= bound


@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("n,k", [(48, 512), (40, 200)])
def test_small_batches_equal_the_float_product_of_the_de_quantized_weight(rows, n, k):
    w = _weight(n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(HALF).to(DEVICE)
    _check(x, w)


def test_per_tensor_scales_and_a_row_shard_multiply_like_the_whole():
    whole = _weight(64, 256, per_tensor=True, seed=3)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(9)).to(HALF).to(DEVICE)
    shard = whole.narrow(0, 16, 32)
    _check(x, whole)
    _check(x, shard)
    y_whole = fp8_gemv(x, whole.codes, whole.scales)
    assert torch.equal(fp8_gemv(x, shard.codes, shard.scales), y_whole[:, 16:48])


def test_more_rows_than_the_kernel_takes_are_refused():
    w = _weight(16, 64)
    with pytest.raises(ValueError, match="rows"):
        fp8_gemv(torch.zeros(MAX_ROWS + 1, 64, dtype=HALF, device=DEVICE), w.codes, w.scales)
