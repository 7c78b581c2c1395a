"""The fused-MoE kernel's layout (workers/layers/moe_align.py): every pair of a local expert lands
once, in a block of its own expert, in its original order; blocks never mix experts; other
experts' pairs are left out; the bound on blocks always suffices."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from workers.layers.moe_align import align_by_expert, max_blocks


@st.composite
def routings(draw):
    experts = draw(st.integers(1, 9))
    tokens = draw(st.integers(0, 40))
    top_k = draw(st.integers(1, experts))
    ids = [draw(st.permutations(range(experts)))[:top_k] for _ in range(tokens)]
    first = draw(st.integers(0, experts - 1))
    num_local = draw(st.integers(1, experts - first))
    block_m = draw(st.sampled_from([1, 2, 4, 16]))
    ids_t = torch.tensor(ids, dtype=torch.long).view(tokens, top_k)
    return ids_t, first, num_local, block_m


@given(routings())
def test_blocks_hold_each_local_pair_once_in_order(case):
    ids, first, num_local, block_m = case
    blocks = align_by_expert(ids, first, num_local, block_m)
    p = ids.numel()
    flat = ids.reshape(-1)
    assert blocks.num_blocks == max_blocks(p, num_local, block_m)
    rows = blocks.rows.view(blocks.num_blocks, block_m)
    seen: dict[int, list[int]] = {e: [] for e in range(num_local)}
    for b in range(blocks.num_blocks):
        expert = int(blocks.block_expert[b])
        real = [r for r in rows[b].tolist() if r != p]
        if expert < 0:
            assert not real
            continue
        assert all(int(flat[r]) - first == expert for r in real)
        seen[expert] += real
    for e in range(num_local):
        mine = [i for i in range(p) if int(flat[i]) - first == e]
        assert seen[e] == mine  # each once, in ids order
        owned = int((blocks.block_expert == e).sum())
        assert owned == -(-len(mine) // block_m)  # padded to whole blocks, no more
