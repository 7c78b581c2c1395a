"""Tensor parallelism is a property of the layers: two gloo ranks give the single-rank logits.

Covers KV heads split across ranks and a single KV head replicated on both, biases on q/k/v/o
(the row-parallel o_proj adds its bias once), the vocab-split embedding and the gathered LM head.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from transformers import AutoConfig

from workers.kv_cache import KVCache, KVCacheSpec
from workers.layers.attention import AttentionMetadata, select_backend
from workers.layers.linear import QKVParallelLinear
from workers.loader import load_model
from workers.parallel import init_tensor_parallel, reset_tensor_parallel, set_expert_parallel

pytestmark = pytest.mark.slow


def forward_logits(model_dir: str) -> torch.Tensor | None:
    """Two steps on one rank's model: a 10-token prefill, then its decode beside a new prefill."""
    config = AutoConfig.from_pretrained(model_dir)
    model = load_model(model_dir, config, torch.float32, torch.device("cpu"), progress=False)
    layers = model.attention_layers()
    cache = KVCache(KVCacheSpec.of(layers, 4, torch.float32), 16, 0, torch.device("cpu"))
    cache.bind(layers)
    backend = select_backend(torch.device("cpu"), "torch")
    for layer in layers:
        layer.backend = backend
    logits = []
    with torch.inference_mode():
        for starts, lens, tables, ids in [
            ([0], [10], [[3, 7, 1]], list(range(50, 60))),
            ([10, 0], [1, 5], [[3, 7, 1], [2, 9]], [77, 5, 6, 7, 8, 9]),
        ]:
            meta, positions = AttentionMetadata.build(starts, lens, tables, 4, torch.device("cpu"))
            backend.prepare(meta)
            hidden = model(torch.tensor(ids), positions, meta)
            logits.append(model.compute_logits(hidden))
    return None if logits[0] is None else torch.cat(logits)


def tp_logits(rank: int, world: int, model_dirs: list[str], ep: bool = False) -> list | None:
    """A gloo_ranks job: each model's forward_logits on this rank (experts split whole when ep);
    rank 0 returns them, the others get none (only rank 0 receives logits)."""
    init_tensor_parallel(rank, world, dist.group.WORLD)
    set_expert_parallel(ep)
    logits = [forward_logits(d) for d in model_dirs]
    if rank != 0:
        assert logits == [None] * len(model_dirs)
        return None
    return logits


FAMILIES = ["llama", "llama_mqa"]


@pytest.fixture(scope="module")
def two_rank_logits(tiny_checkpoint, gloo_ranks) -> dict[str, torch.Tensor]:
    """Every family's logits from one job on two ranks (spawning ranks costs more than models)."""
    dirs = [tiny_checkpoint(family)[0] for family in FAMILIES]
    return dict(zip(FAMILIES, gloo_ranks(2).run(tp_logits, dirs)))


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_match_one(family, tiny_checkpoint, two_rank_logits):
    model_dir, _ = tiny_checkpoint(family)
    reset_tensor_parallel()
    expected = forward_logits(model_dir)
    torch.testing.assert_close(two_rank_logits[family], expected, atol=1e-4, rtol=1e-4)


def test_qkv_shards_replicate_kv_heads_when_ranks_outnumber_them(monkeypatch):
    """Rank r of 4 with 2 KV heads holds q heads [2r, 2r+1] and KV head r // 2."""
    import workers.layers.linear as linear

    hidden, head_dim = 8, 2
    q = torch.arange(8 * head_dim * hidden, dtype=torch.float32).view(8 * head_dim, hidden)
    k = -torch.arange(2 * head_dim * hidden, dtype=torch.float32).view(2 * head_dim, hidden)
    for rank in range(4):
        monkeypatch.setattr(linear, "get_tp_rank", lambda r=rank: r)
        monkeypatch.setattr(linear, "get_tp_world_size", lambda: 4)
        layer = QKVParallelLinear(hidden, head_dim, num_heads=8, num_kv_heads=2)
        layer.weight_loader(layer.weight, q, "q")
        layer.weight_loader(layer.weight, k, "k")
        assert layer.num_heads == 2 and layer.num_kv_heads == 1
        assert torch.equal(layer.weight[:4], q[rank * 4 : (rank + 1) * 4])
        kv_head = rank // 2
        assert torch.equal(layer.weight[4:6], k[kv_head * 2 : (kv_head + 1) * 2])


def test_a_group_of_one_runs_the_collectives_through_the_backend():
    """init_distributed at world size 1 still builds a real group (gloo here, NCCL on CUDA)."""
    from workers.distributed import destroy_distributed, free_port, init_distributed
    from workers.parallel import all_gather, all_reduce, gather

    init_distributed(0, 1, f"127.0.0.1:{free_port()}", "cpu", timeout_s=30)
    try:
        assert dist.get_backend() == "gloo" and dist.get_world_size() == 1
        x = torch.arange(6.0)
        assert torch.equal(all_reduce(x.clone()), x)
        assert torch.equal(all_gather(x), x)
        assert torch.equal(gather(x), x)
    finally:
        destroy_distributed()
    assert not dist.is_initialized()
