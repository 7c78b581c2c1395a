"""The small-row float32 CPU linear (workers/layers/backends/small_gemm.cpp): x @ W^T (+ b) within
float32 rounding of a float64 product for M = 1..16 on odd and even K and N (every vector, tail and
single-row path), rows independent of each other bit for bit, strided rows read in place, and bad
operands refused with ValueError naming the argument."""

from __future__ import annotations

import pytest
import torch

from workers.layers.backends import cpu_gemm

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="no C++ compiler to build it")

# K: under one vector, exactly one, one past (masked tail), the experts' widths and odd ones.
# N: a single row, blocks of four with 0-3 rows left over, an expert's 1,536.
SHAPES = [(1, 1), (7, 3), (16, 4), (17, 5), (31, 13), (576, 1536), (767, 6), (768, 577)]


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


def assert_within_rounding(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b=None) -> None:
    """|y - exact| <= 1e-5 of the sum of the terms' magnitudes: float32 rounding of a sum of K
    products in any order (a relative bound on y itself fails where the terms cancel)."""
    scale = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    err = (y.double() - reference(x, w, b)).abs()
    assert y.dtype == torch.float32 and y.shape == (x.shape[0], w.shape[0])
    assert bool((err <= 1e-5 * scale + 1e-30).all()), (
        f"max error {(err / scale).max():.3g} of scale"
    )


@pytest.mark.parametrize("k,n", SHAPES)
def test_every_row_count_up_to_16_matches_the_product(k, n):
    gen = torch.Generator().manual_seed(k * 1000 + n)
    w = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    for m in (*range(1, 17), cpu_gemm.MAX_ROWS):
        x = torch.randn(m, k, generator=gen)
        b = bias if m % 2 else None
        y = cpu_gemm.small_linear(x, w, b)
        assert_within_rounding(y, x, w, b)
        torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_a_row_does_not_depend_on_the_rows_beside_it():
    """Bit for bit: each output's sum order depends on K and N only, not on how many rows share
    the weight's pass (chunks of 1..6 rows run different register blocks)."""
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(16, 333, generator=gen), torch.randn(70, 333, generator=gen)
    together = cpu_gemm.small_linear(x, w)
    for m in range(1, 17):
        assert torch.equal(cpu_gemm.small_linear(x[:m], w), together[:m])
    for i in range(16):
        assert torch.equal(cpu_gemm.small_linear(x[i : i + 1], w)[0], together[i])


def test_strided_rows_are_read_in_place_and_threads_split_the_same_sums():
    gen = torch.Generator().manual_seed(4)
    wide, w = torch.randn(9, 600, generator=gen), torch.randn(2050, 577, generator=gen)
    x = wide[:, 5:582]  # row stride 600, unit column stride
    expected = cpu_gemm.small_linear(x.contiguous(), w)
    assert torch.equal(cpu_gemm.small_linear(x, w), expected)
    w_rows = torch.randn(2050, 700, generator=gen)[:, :577]  # weight rows strided too
    assert_within_rounding(cpu_gemm.small_linear(x, w_rows), x, w_rows)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(cpu_gemm.small_linear(x, w), expected)
    finally:
        torch.set_num_threads(threads)


def test_empty_operands():
    w = torch.randn(5, 8)
    assert cpu_gemm.small_linear(torch.empty(0, 8), w).shape == (0, 5)
    b = torch.randn(3)
    assert torch.equal(
        cpu_gemm.small_linear(torch.empty(2, 0), torch.empty(3, 0), b), b.expand(2, 3)
    )
    assert torch.equal(
        cpu_gemm.small_linear(torch.empty(2, 0), torch.empty(3, 0)), torch.zeros(2, 3)
    )


@pytest.mark.parametrize(
    "x,w,b,name",
    [
        (torch.randn(8, 4).T, torch.randn(5, 8), None, "x"),  # columns strided
        (torch.randn(4, 8).double(), torch.randn(5, 8), None, "x"),
        (torch.randn(4, 8).bfloat16(), torch.randn(5, 8), None, "x"),
        (torch.randn(2, 4, 8), torch.randn(5, 8), None, "x"),
        (torch.randn(4, 8), torch.randn(8, 5).T, None, "weight"),
        (torch.randn(4, 8), torch.randn(5, 9), None, "weight"),
        (torch.randn(4, 8), torch.randn(5, 8).half(), None, "weight"),
        (torch.randn(cpu_gemm.MAX_ROWS + 1, 8), torch.randn(5, 8), None, "x"),
        (torch.randn(4, 8), torch.randn(5, 8), torch.randn(4), "bias"),
        (torch.randn(4, 8), torch.randn(5, 8), torch.randn(10)[::2], "bias"),
        (torch.randn(4, 8), torch.randn(5, 8), torch.randn(5).double(), "bias"),
    ],
)
def test_bad_operands_are_refused_naming_the_argument(x, w, b, name):
    with pytest.raises(ValueError, match=f"^{name}: "):
        cpu_gemm.small_linear(x, w, b)


def test_the_largest_row_count_and_extreme_values_pass_through():
    """Values are not validated (a linear's input is whatever the model made): inf and NaN
    propagate as in torch, and 2^64-sized magnitudes overflow to inf as in torch."""
    w = torch.ones(4, 3)
    x = torch.tensor(
        [[2.0**64, 1.0, 0.0], [float("nan"), 0.0, 0.0], [-1.0, 0.0, 0.0], [3e38, 3e38, 0]]
    )
    y = cpu_gemm.small_linear(x, w)
    assert torch.equal(y[0], torch.full((4,), 2.0**64))
    assert y[1].isnan().all() and torch.equal(y[2], torch.full((4,), -1.0))
    assert torch.equal(y[3], torch.full((4,), float("inf")))
