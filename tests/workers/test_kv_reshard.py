"""Which sending ranks' KV heads make a receiving rank's KV when the two engines run different
tensor-parallel sizes: QKVParallelLinear's split (heads in rank order, replicated when there are
more ranks than KV heads), cut and joined per layer."""

from __future__ import annotations

import pytest
import torch

from workers.kv_reshard import HeadSlice, join, plan, rank_heads, readers


def test_a_rank_holds_its_run_of_heads_or_one_replicated_head():
    assert [rank_heads(4, 2, r) for r in range(2)] == [range(0, 2), range(2, 4)]
    assert [rank_heads(2, 4, r) for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    assert rank_heads(1, 8, 5) == range(0, 1)  # MLA's latent row: on every rank


@pytest.mark.parametrize(
    ("heads", "src", "dst", "rank", "expected"),
    [
        (2, 2, 1, 0, [HeadSlice(0, 0, 1), HeadSlice(1, 0, 1)]),  # TP=2 -> TP=1: both, joined
        (2, 1, 2, 1, [HeadSlice(0, 1, 2)]),  # TP=1 -> TP=2: rank 1 cuts the second head
        (8, 4, 2, 1, [HeadSlice(2, 0, 2), HeadSlice(3, 0, 2)]),
        (2, 4, 1, 0, [HeadSlice(0, 0, 1), HeadSlice(2, 0, 1)]),  # replicas: the first holder
        (2, 2, 2, 1, [HeadSlice(1, 0, 1)]),  # same size: the namesake's whole shard
    ],
)
def test_the_plan_takes_each_head_from_the_first_rank_that_holds_it(
    heads, src, dst, rank, expected
):
    assert plan(heads, src, dst, rank) == expected


def test_readers_count_the_receiving_ranks_of_each_shard():
    assert [readers(2, 1, 2, 0)] == [2]  # both TP=2 ranks pull the one TP=1 shard
    assert [readers(2, 2, 1, r) for r in range(2)] == [1, 1]
    assert [readers(2, 4, 1, r) for r in range(4)] == [1, 0, 1, 0]


@pytest.mark.parametrize(("src", "dst"), [(2, 1), (1, 2), (4, 2), (2, 4), (1, 4)])
def test_resharded_blocks_equal_the_receiving_size_s_own_split(src, dst):
    """A block split for `src` ranks, re-split for `dst`, equals the block split for `dst` on
    every layer, K and V alike."""
    block = torch.randn(3, 2, 4, 4, 5)  # [layers, K/V, block_size, heads, head_dim]

    def shard(tp: int, rank: int) -> torch.Tensor:
        heads = rank_heads(4, tp, rank)
        return block[..., heads.start : heads.stop, :]

    for rank in range(dst):
        slices = plan(4, src, dst, rank)
        parts = [shard(src, s.src_rank) for s in slices]
        assert torch.equal(join(parts, slices), shard(dst, rank))


@pytest.mark.parametrize(
    ("heads", "tp", "rank"), [(3, 2, 0), (2, 3, 0), (4, 2, 2), (4, 2, -1), (0, 1, 0), (4, 0, 0)]
)
def test_sizes_that_do_not_split_are_a_value_error(heads, tp, rank):
    with pytest.raises(ValueError, match="rank_heads|tensor_parallel_size|num_key_value_heads"):
        rank_heads(heads, tp, rank)
