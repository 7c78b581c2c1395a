"""The Triton LoRA shrink/expand kernels against the torch path (LoraLayer's segment-grouped bmm),
run by Triton's CPU interpreter: mixed adapter and base rows, padded groups, fused q/k/v segments,
ranks below the slot rank, a row-parallel shard.

As in test_triton_interpreted.py, TRITON_INTERPRET=1 must be set before triton is imported
(tests/conftest.py and tests/workers/triton_env.py do it); `make test-triton` runs these on their
own. With a CUDA GPU
the compiled kernels run instead.
"""

from __future__ import annotations

import pytest
import torch

# First, before triton or a kernel module is imported (see triton_env's docstring).
from tests.workers.triton_env import DEVICE, HALF

# isort: split
from tests.workers.test_lora_layers import (
    IN,
    OUT_KV,
    OUT_Q,
    RANK,
    SLOTS,
    adapters,
    qkv_segments,
    set_batch,
)
from workers.layers import fused
from workers.layers.backends import triton_lora
from workers.lora.layers import LoraBatch, LoraLayer, Segment

MIXES = (
    [0, -1, 2, 1, -1, 0, 2],  # uneven groups: padding in two of three
    [1, 1, 0, 2, 0, 1, 2],
    [-1] * 7,  # base rows only: nothing to do
    [0, -1, -1, 0, -1, -1, -1],  # one slot
    [0, 1, 1, -1, 2, 2, 2],  # token row 0 and padding (which points at row 0) in one group
)


def qkv_layer(dtype=torch.float32, ranks=(4, 2, 3)) -> LoraLayer:
    batch = LoraBatch()
    layer = LoraLayer(batch, qkv_segments(), IN, None, SLOTS, RANK, dtype, torch.device("cpu"))
    for slot, w in enumerate(adapters(torch.Generator().manual_seed(0), list(ranks))):
        layer.load(slot, w)
    return layer


def kernel_update(layer: LoraLayer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    batch = layer.batch
    if not batch.active:
        return y
    assert batch.index is not None
    valid = None if batch.valid is None else batch.valid.to(DEVICE, x.dtype)
    out = triton_lora.lora_update(
        x.to(DEVICE),
        y.to(DEVICE),
        layer.a.to(DEVICE),
        [b.to(DEVICE) for b in layer.b],
        batch.index.to(DEVICE),
        valid,
        batch.num_slots,
        batch.group,
    )
    return out.cpu()


@pytest.mark.parametrize("slots", MIXES, ids=["mixed", "all", "base", "one", "row0"])
def test_kernels_equal_the_torch_path_on_mixed_rows(slots):
    gen = torch.Generator().manual_seed(1)
    layer = qkv_layer()
    x = torch.randn(len(slots), IN, generator=gen)
    base = torch.randn(len(slots), OUT_Q + 2 * OUT_KV, generator=gen)
    set_batch(layer.batch, slots)
    ref = layer(x, base.clone())  # CPU tensors: the torch path
    out = kernel_update(layer, x, base.clone())
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    base_rows = [i for i, s in enumerate(slots) if s < 0]
    assert torch.equal(out[base_rows], base[base_rows])  # base rows untouched, bit for bit


def test_kernels_16_bit_with_many_rows_per_slot():
    """40 rows over 3 slots: groups past one 16-row block."""
    gen = torch.Generator().manual_seed(2)
    layer = qkv_layer(HALF)
    slots = torch.randint(-1, SLOTS, (40,), generator=gen).tolist()
    x = torch.randn(40, IN, generator=gen).to(HALF)
    base = torch.randn(40, OUT_Q + 2 * OUT_KV, generator=gen).to(HALF)
    set_batch(layer.batch, slots)
    ref = layer(x, base.clone())
    torch.testing.assert_close(kernel_update(layer, x, base.clone()), ref, atol=1e-2, rtol=1e-2)


def test_kernels_on_a_row_parallel_shard():
    """o_proj's second half of the input columns: x is a strided view, A a column slice."""
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(RANK, IN, generator=gen), torch.randn(OUT_Q, RANK, generator=gen)
    batch = LoraBatch()
    half = IN // 2
    layer = LoraLayer(
        batch,
        [Segment("o_proj", 0, OUT_Q, 0)],
        half,
        half,
        1,
        RANK,
        torch.float32,
        torch.device("cpu"),
    )
    layer.load(0, {"o_proj": (a, b)})
    set_batch(batch, [0, -1, 0, 0, -1])
    x = torch.randn(5, IN, generator=gen)[:, half:]
    ref = layer(x, torch.zeros(5, OUT_Q))
    torch.testing.assert_close(kernel_update(layer, x, torch.zeros(5, OUT_Q)), ref)


@pytest.mark.skipif(DEVICE == "cuda", reason="CUDA tensors pick the kernels by themselves")
def test_the_layer_runs_the_kernels_where_they_are_picked(monkeypatch):
    gen = torch.Generator().manual_seed(4)
    layer = qkv_layer()
    x = torch.randn(7, IN, generator=gen)
    base = torch.randn(7, OUT_Q + 2 * OUT_KV, generator=gen)
    set_batch(layer.batch, MIXES[0])
    ref = layer(x, base.clone())
    calls = []
    monkeypatch.setattr(fused, "triton_lora", lambda t: calls.append(t) or triton_lora)
    out = layer(x, base.clone())
    assert len(calls) == 1
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
