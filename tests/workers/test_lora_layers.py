"""The batched LoRA update against a per-row reference, with base rows untouched and tensor-parallel
shards that add up to the whole."""

from __future__ import annotations

import torch

from workers.lora.layers import LoraBatch, LoraLayer, Segment
from workers.lora.manager import LoraManager

IN, OUT_Q, OUT_KV, SLOTS, RANK = 12, 8, 4, 3, 4


def adapters(gen: torch.Generator, ranks: list[int]) -> list[dict]:
    """Per slot: target -> (A [r, IN], B [out, r])."""
    outs = {"q_proj": OUT_Q, "k_proj": OUT_KV, "v_proj": OUT_KV}
    return [
        {
            t: (torch.randn(r, IN, generator=gen), torch.randn(o, r, generator=gen))
            for t, o in outs.items()
        }
        for r in ranks
    ]


def qkv_segments() -> list[Segment]:
    return [
        Segment("q_proj", 0, OUT_Q, 0),
        Segment("k_proj", OUT_Q, OUT_KV, 0),
        Segment("v_proj", OUT_Q + OUT_KV, OUT_KV, 0),
    ]


def set_batch(batch: LoraBatch, token_slots: list[int]) -> None:
    manager = LoraManager.__new__(LoraManager)  # only set_batch: no model needed
    manager.batch, manager.dtype, manager.device = batch, torch.float32, torch.device("cpu")
    manager.set_batch(token_slots, [1] * len(token_slots))


def reference(x: torch.Tensor, slots: list[int], weights: list[dict]) -> torch.Tensor:
    rows = []
    for row, slot in zip(x, slots):
        if slot < 0:
            rows.append(torch.zeros(OUT_Q + 2 * OUT_KV))
            continue
        parts = [
            (row @ a.T) @ b.T for a, b in (weights[slot][t] for t in ("q_proj", "k_proj", "v_proj"))
        ]
        rows.append(torch.cat(parts))
    return torch.stack(rows)


def test_mixed_rows_get_their_own_adapter_and_base_rows_nothing():
    gen = torch.Generator().manual_seed(0)
    weights = adapters(gen, [4, 2, 3])
    batch = LoraBatch()
    layer = LoraLayer(
        batch, qkv_segments(), IN, None, SLOTS, RANK, torch.float32, torch.device("cpu")
    )
    for slot, w in enumerate(weights):
        layer.load(slot, w)
    x = torch.randn(7, IN, generator=gen)
    for slots in (
        [0, -1, 2, 1, -1, 0, 2],
        [1, 1, 0, 2, 0, 1, 2],
        [-1] * 7,
        [0, -1, -1, 0, -1, -1, -1],
    ):
        base = torch.randn(7, OUT_Q + 2 * OUT_KV, generator=gen)
        set_batch(batch, slots)
        y = layer(x, base.clone())
        torch.testing.assert_close(y, base + reference(x, slots, weights), rtol=1e-5, atol=1e-5)


def test_row_and_column_shards_add_up_to_the_whole_update():
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(RANK, IN, generator=gen), torch.randn(OUT_Q, RANK, generator=gen)
    x = torch.randn(5, IN, generator=gen)
    batch = LoraBatch()
    set_batch(batch, [0] * 5)
    whole = (x @ a.T) @ b.T
    # Row-parallel (o_proj, down_proj): each rank sees its half of x's columns; the partial
    # updates are summed by the all-reduce.
    partial = torch.zeros(5, OUT_Q)
    for rank in range(2):
        half = IN // 2
        layer = LoraLayer(
            batch,
            [Segment("o_proj", 0, OUT_Q, 0)],
            half,
            rank * half,
            1,
            RANK,
            torch.float32,
            torch.device("cpu"),
        )
        layer.load(0, {"o_proj": (a, b)})
        partial += layer(x[:, rank * half : (rank + 1) * half], torch.zeros(5, OUT_Q))
    torch.testing.assert_close(partial, whole, rtol=1e-5, atol=1e-5)
    # Column-parallel: each rank computes its rows of the output.
    cols = []
    for rank in range(2):
        size = OUT_Q // 2
        layer = LoraLayer(
            batch,
            [Segment("q_proj", 0, size, rank * size)],
            IN,
            None,
            1,
            RANK,
            torch.float32,
            torch.device("cpu"),
        )
        layer.load(0, {"q_proj": (a, b)})
        cols.append(layer(x, torch.zeros(5, size)))
    torch.testing.assert_close(torch.cat(cols, 1), whole, rtol=1e-5, atol=1e-5)
