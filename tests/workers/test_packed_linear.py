"""CPU linears through a weight packed once by oneDNN give F.linear's result.

Tolerances: float32 within atol = rtol = 1e-5 on outputs of order 1 (oneDNN may sum in another
order than BLAS; no bit-identity is promised), bfloat16 within torch's bf16 defaults widened to
atol 1e-2 (one bf16 rounding of the output). Shapes are decode-like (few rows) and prefill-like
(hundreds of rows), at SmolLM2's widths and at odd ones.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import workers.layers.linear as linear_mod
from workers.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
    cpu_pack,
    linear,
    pack_cpu_weights,
    packed_rows,
)
from workers.loader import load_model

TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1.6e-2},
}
DTYPES = [torch.float32] + (
    [torch.bfloat16] if cpu_pack(torch.ones(2, 2, dtype=torch.bfloat16)) is not None else []
)


def weights(n: int, k: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight scaled so outputs are of order 1, and a bias."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k**0.5
    return w.to(dtype), torch.randn(n, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 17, 32, 64, 100, 513])
@pytest.mark.parametrize("k, n", [(576, 960), (1536, 576), (100, 37)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(dtype, rows, k, n, with_bias):
    w, b = weights(n, k, dtype)
    bias = b if with_bias else None
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    packed = cpu_pack(w)
    assert packed is not None
    out = linear(x, w, bias, packed)
    assert out.shape == (rows, n) and out.dtype == dtype
    torch.testing.assert_close(out, F.linear(x, w, bias), **TOLERANCE[dtype])


def test_packed_linear_takes_leading_dims_and_strided_input():
    w, b = weights(48, 32, torch.float32)
    packed = cpu_pack(w)
    x = torch.randn(3, 5, 32)
    torch.testing.assert_close(
        linear(x, w, b, packed), F.linear(x, w, b), **TOLERANCE[torch.float32]
    )
    xt = torch.randn(32, 6).t()  # a transposed view, as a split or chunk may hand over
    torch.testing.assert_close(
        linear(xt, w, None, packed), F.linear(xt, w), **TOLERANCE[torch.float32]
    )


def test_row_counts_round_up_to_a_few_buckets_with_little_padding():
    """oneDNN keeps a primitive per row count it sees: a step's token count may take every value
    up to the budget, the buckets must stay few (well under its 1,024-entry cache)."""
    budget = 2048
    buckets = {packed_rows(r) for r in range(1, budget + 1)}
    assert len(buckets) <= 80
    for rows in range(1, 4 * budget):
        assert rows <= packed_rows(rows) <= rows * 1.125
        assert packed_rows(packed_rows(rows)) == packed_rows(rows)
    assert [packed_rows(r) for r in range(1, 17)] == list(range(1, 17))  # decodes run unpadded


def test_packed_linear_shows_onednn_only_bucketed_row_counts(capfd):
    """What oneDNN executes (its verbose log) is the bucketed row count, whatever the input's."""
    w, _ = weights(48, 32, torch.float32)
    packed = cpu_pack(w)
    capfd.readouterr()
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        for rows in range(1, 80):
            out = linear(torch.randn(rows, 32), w, None, packed)
            assert out.shape == (rows, 48)
    executed = {int(m) for m in re.findall(r"mb(\d+)ic32oc48", capfd.readouterr().out)}
    assert executed == {packed_rows(r) for r in range(1, 80)}


def test_weights_oneDNN_cannot_pack_take_the_plain_path():
    assert cpu_pack(torch.ones(4, 4, dtype=torch.float64)) is None
    assert cpu_pack(torch.ones(4)) is None
    w, b = weights(8, 4, torch.float32)
    x = torch.randn(3, 4)
    torch.testing.assert_close(
        linear(x.double(), w.double(), b.double(), None), F.linear(x, w, b).double()
    )


@pytest.mark.parametrize("rank", [0, 1])
def test_each_tp_rank_packs_its_own_shard(rank, monkeypatch):
    """Rank r of 2: the column layer's packed output is rows r of the full output, the row layer's
    is the partial sum over its input columns (summed over ranks by the all-reduce)."""
    monkeypatch.setattr(linear_mod, "get_tp_rank", lambda: rank)
    monkeypatch.setattr(linear_mod, "get_tp_world_size", lambda: 2)
    gate, up = weights(96, 64, torch.float32, seed=2)[0], weights(96, 64, torch.float32, seed=3)[0]
    merged = MergedColumnParallelLinear(64, [96, 96])
    merged.weight_loader(merged.weight, gate, 0)
    merged.weight_loader(merged.weight, up, 1)
    column = ColumnParallelLinear(64, 96, bias=True)
    w, b = weights(96, 64, torch.float32, seed=4)
    column.weight_loader(column.weight, w)
    column.weight_loader(column.bias, b)
    down = RowParallelLinear(96, 64)
    w_down = weights(64, 96, torch.float32, seed=5)[0]
    down.weight_loader(down.weight, w_down)
    assert all(layer.pack_weight() for layer in (merged, column, down))

    x = torch.randn(5, 64)
    rows = slice(48 * rank, 48 * (rank + 1))
    expected = torch.cat([F.linear(x, gate[rows]), F.linear(x, up[rows])], dim=-1)
    torch.testing.assert_close(merged(x), expected, **TOLERANCE[torch.float32])
    torch.testing.assert_close(column(x), F.linear(x, w[rows], b[rows]), **TOLERANCE[torch.float32])
    h = torch.randn(5, 96)
    torch.testing.assert_close(
        down(h[:, rows]), F.linear(h[:, rows], w_down[:, rows]), **TOLERANCE[torch.float32]
    )


def test_load_model_packs_every_linear_and_the_lm_head(tiny_checkpoint):
    from transformers import AutoConfig

    path, hf = tiny_checkpoint("llama")
    model = load_model(
        path, AutoConfig.from_pretrained(path), torch.float32, torch.device("cpu"), progress=False
    )
    layers = [m for m in model.modules() if isinstance(m, linear_mod.CpuPackedWeight)]
    assert model.lm_head in layers and len(layers) == 1 + 4 * model.args.num_layers
    assert all(m.packed is not None for m in layers)
    hidden = torch.randn(3, model.args.hidden_size)
    expected = F.linear(hidden, hf.lm_head.weight)[:, : model.args.vocab_size]
    torch.testing.assert_close(model.compute_logits(hidden), expected, **TOLERANCE[torch.float32])
    assert pack_cpu_weights(model) == len(layers)  # packing again keeps every packed copy
    torch.testing.assert_close(model.compute_logits(hidden), expected, **TOLERANCE[torch.float32])


def test_load_model_keeps_each_linear_weight_once(tiny_checkpoint):
    """The float weight beside a packed copy is freed (its shape kept), except one a tied
    embedding reads."""
    from transformers import AutoConfig

    for family, tied in (("llama", False), ("qwen2", True)):
        path, hf = tiny_checkpoint(family)
        config = AutoConfig.from_pretrained(path)
        assert bool(config.tie_word_embeddings) is tied
        model = load_model(path, config, torch.float32, torch.device("cpu"), progress=False)
        for m in model.modules():
            if isinstance(m, linear_mod.CpuPackedWeight) and m is not model.lm_head:
                assert m.weight.packed_only and m.weight.stride() == (0, 0), m
                assert m.weight.untyped_storage().nbytes() <= 4
        head = model.lm_head.weight
        assert getattr(head, "packed_only", False) is not tied
        ids = torch.tensor([1, 5, 9])
        torch.testing.assert_close(
            model.model.embed_tokens(ids), hf.model.embed_tokens(ids), rtol=0, atol=0
        )
