"""Our Triton INT4 GEMM against the float product of the de-quantized weight, run by Triton's CPU
interpreter (or compiled, on a CUDA GPU): row counts across the kernel's row tiles, group sizes 32,
64 and 128, an output count that is not a multiple of the tile, act-order weights (through
Int4Weight's own kernel choice on CUDA), and a refused shape.

As in test_triton_interpreted.py, TRITON_INTERPRET=1 must be set before triton is imported
(tests/conftest.py and tests/workers/triton_env.py do it); `make test-triton` runs these alone.
"""

from __future__ import annotations

import pytest
import torch

# First, before triton or a kernel module is imported (see triton_env's docstring).
from tests.workers.triton_env import DEVICE, HALF

# isort: split
from workers.layers.backends.triton_int4_gemm import int4_gemm
from workers.layers.int4 import Int4Weight, pack_nibbles


def _weight(n: int, k: int, group: int, seed: int = 0, act_order: bool = False) -> Int4Weight:
    gen = torch.Generator().manual_seed(seed)
    groups = k // group
    g_idx = None
    if act_order:
        g_idx = (torch.randperm(k, generator=gen) // group).int().to(DEVICE)
    return Int4Weight(
        pack_nibbles(torch.randint(0, 16, (n, k), generator=gen)).to(DEVICE),
        (torch.rand(n, groups, generator=gen) * 0.02 + 0.001).to(DEVICE),
        torch.randint(0, 16, (n, groups), generator=gen).to(torch.uint8).to(DEVICE),
        group,
        g_idx,
    )


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    # each weight rounds once to the 16-bit dtype; float32 sums; one rounding of the output
    bound = 2 * torch.finfo(y.dtype).eps * ref.abs().max().item() + 1e-3
    assert (y.double() - ref).abs().max().item() <= bound


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_the_kernel_equals_the_de_quantized_product(rows, group):
    w = _weight(40, 256, group, seed=rows)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(group)).to(HALF).to(DEVICE)
    y = int4_gemm(x, w.codes, w.scales, w.zeros, group)
    assert y.dtype == x.dtype and y.shape == (rows, 40)
    _close(y, x.double() @ w.dequantize().double().t())


@pytest.mark.skipif(DEVICE != "cuda", reason="Int4Weight picks the Triton kernel on CUDA only")
def test_act_order_weights_multiply_through_the_kernel_in_group_order():
    w = _weight(64, 256, 64, seed=3, act_order=True)
    ref_w = w.dequantize().double()
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1)).to(HALF).to(DEVICE)
    w.prepare(HALF)
    assert type(w.kernel).__name__ == "_TritonKernel"
    _close(w.matmul(x), x.double() @ ref_w.t())


def test_inputs_that_are_not_whole_groups_are_refused():
    w = _weight(16, 128, 64)
    with pytest.raises(ValueError, match="whole groups"):
        int4_gemm(torch.zeros(1, 96, dtype=HALF, device=DEVICE), w.codes, w.scales, w.zeros, 64)
