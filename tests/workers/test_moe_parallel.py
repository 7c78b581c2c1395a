"""Experts split over real gloo groups give the single-rank logits: tensor parallel at 2 and 3
ranks (each rank a slice of every expert's intermediate dimension, and of the shared expert), and
expert parallel at 2 and 4 ranks (each rank whole experts; attention stays tensor-parallel).

The model is TINY_TP_MOE (Qwen2-MoE shape: 8 experts, top-2, a gated shared expert, 12 heads);
gpt-oss (TINY_GPT_OSS) at 2 ranks checks its sinks split by head and its expert biases (the down
bias added by one rank only).
Each case spawns its ranks as processes: run under `flock /tmp/raylm-ray.lock`.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.random_checkpoint import TINY_GPT_OSS, TINY_TP_MOE, write_random_checkpoint
from tests.workers.test_tensor_parallel import forward_logits
from workers.parallel import init_tensor_parallel, reset_tensor_parallel, set_expert_parallel

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-tp-moe"))
    return write_random_checkpoint(TINY_TP_MOE, path, seed=30).path


@pytest.fixture(scope="module")
def single_rank(moe_dir) -> torch.Tensor:
    reset_tensor_parallel()
    logits = forward_logits(moe_dir)
    assert logits is not None
    return logits


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-tp-gpt-oss"))
    spec = TINY_GPT_OSS.with_fields(vocab_size=250)
    return write_random_checkpoint(spec, path, seed=31).path


def _rank_main(
    rank: int, world: int, init_file: str, model_dirs: list[str], ep: bool, outs: list[str]
) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        init_tensor_parallel(rank, world, dist.group.WORLD)
        set_expert_parallel(ep)
        for model_dir, out in zip(model_dirs, outs):
            logits = forward_logits(model_dir)
            if rank == 0:
                torch.save(logits, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "world,ep", [(2, False), (3, False), (2, True), (4, True)], ids=["tp2", "tp3", "ep2", "ep4"]
)
def test_split_experts_match_one_rank(world, ep, moe_dir, single_rank, gpt_oss_dir, tmp_path):
    dirs, refs = [moe_dir], [single_rank]
    if (world, ep) == (2, False):  # the same ranks then run gpt-oss (spawning costs most)
        reset_tensor_parallel()
        dirs.append(gpt_oss_dir)
        refs.append(forward_logits(gpt_oss_dir))
    outs = [str(tmp_path / f"logits{i}.pt") for i in range(len(dirs))]
    mp.spawn(
        _rank_main,
        args=(world, str(tmp_path / "init"), dirs, ep, outs),
        nprocs=world,
        join=True,
    )
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(torch.load(out), ref, atol=1e-4, rtol=1e-4)
