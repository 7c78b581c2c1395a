"""The Triton fused-MoE kernel against the torch grouped path (FusedMoE.experts), run by Triton's
CPU interpreter: top-2 and top-4 over 8 experts, uneven loads, an expert no token picks, shapes
that are not multiples of the kernel's tiles, and an expert-parallel rank's share.

As in test_triton_interpreted.py, TRITON_INTERPRET=1 must be set before triton is imported
(tests/conftest.py and tests/workers/triton_env.py do it); `make test-triton` runs these on their
own. With a CUDA GPU
the compiled kernel runs instead.
"""

from __future__ import annotations

import pytest
import torch

# First, before triton or a kernel module is imported (see triton_env's docstring).
from tests.workers.triton_env import DEVICE, HALF

# isort: split
from tests.workers.test_moe import build, random_experts
from workers.layers import fused
from workers.layers.backends import triton_moe
from workers.layers.backends.triton_moe import fused_experts
from workers.layers.moe import MoEConfig, route


def cfg(top_k: int, hidden: int = 40, inter: int = 24) -> MoEConfig:
    return MoEConfig(
        num_experts=8, top_k=top_k, hidden_size=hidden, intermediate_size=inter, renormalize=True
    )


def skewed_routing(c: MoEConfig, rows: int, seed: int):
    """Logits that send most tokens to experts 0 and 1, few to the others, none to expert 5."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, c.num_experts, generator=gen)
    logits[:, :2] += 2.0
    logits[:, 5] = float("-inf")
    return route(logits, c)


def check(c: MoEConfig, rows: int, monkeypatch, dtype=torch.float32, **shard) -> None:
    layer = build(c, random_experts(c), monkeypatch, **shard)
    x = torch.randn(rows, c.hidden_size, generator=torch.Generator().manual_seed(7))
    weights, ids = skewed_routing(c, rows, seed=rows)
    assert not (ids == 5).any()
    ref = layer.to(dtype).experts(x.to(dtype), weights, ids)  # CPU tensors: the torch path
    out = fused_experts(
        x.to(DEVICE, dtype),
        layer.w13.to(DEVICE),
        layer.w2.to(DEVICE),
        weights.to(DEVICE),
        ids.to(DEVICE),
        first=layer.first,
    )
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.cpu(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("top_k", [2, 4])
@pytest.mark.parametrize("rows", [1, 7, 50])
def test_fused_moe_equals_the_torch_path(top_k, rows, monkeypatch):
    """50 rows at top-4 put about 70 pairs on expert 0: blocks of 32, several per expert."""
    check(cfg(top_k), rows, monkeypatch)


def test_fused_moe_tiles_wider_than_one_block(monkeypatch):
    """Hidden and intermediate sizes past one 64-wide output tile and several 32-wide k steps."""
    check(cfg(2, hidden=72, inter=80), 20, monkeypatch)


def test_fused_moe_16_bit(monkeypatch):
    check(cfg(4), 30, monkeypatch, dtype=HALF)


@pytest.mark.parametrize("rank", [0, 1])
def test_fused_moe_an_expert_parallel_rank_computes_its_experts_only(rank, monkeypatch):
    """Rank 1 of 2 holds experts 4..7 (expert 5 idle): pairs routed to rank 0's experts are zero."""
    check(cfg(2), 30, monkeypatch, rank=rank, world=2, expert_parallel=True)


def test_fused_moe_a_tensor_parallel_shard(monkeypatch):
    """Rank 1 of 2 holds half of every expert's intermediate rows."""
    check(cfg(4), 12, monkeypatch, rank=1, world=2)


@pytest.mark.skipif(DEVICE == "cuda", reason="CUDA tensors pick the kernel by themselves")
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_the_layer_runs_the_kernel_where_it_is_picked(expert_parallel, monkeypatch):
    """FusedMoE.forward through the kernel (picked for CPU tensors here, as CUDA picks it) gives
    the torch path's output and the same rows-per-rank counts."""
    shard = {"rank": 1, "world": 2, "expert_parallel": expert_parallel}
    layer = build(cfg(2), random_experts(cfg(2)), monkeypatch, **shard)
    gen = torch.Generator().manual_seed(8)
    x, logits = torch.randn(9, 40, generator=gen), torch.randn(9, 8, generator=gen)
    ref, ref_rows = layer(x, logits), layer.rows_per_rank
    calls = []
    monkeypatch.setattr(fused, "triton_moe", lambda t: calls.append(t) or triton_moe)
    out = layer(x, logits)
    assert len(calls) == 1
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert layer.rows_per_rank == ref_rows
