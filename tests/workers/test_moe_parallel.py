"""Experts split over real gloo groups give the single-rank logits: tensor parallel at 2 and 3
ranks (each rank a slice of every expert's intermediate dimension, and of the shared expert), and
expert parallel at 2 and 4 ranks (each rank whole experts; attention stays tensor-parallel).

The model is TINY_TP_MOE (Qwen2-MoE shape: 8 experts, top-2, a gated shared expert, 12 heads);
gpt-oss (TINY_GPT_OSS) at 2 ranks checks its sinks split by head and its expert biases (the down
bias added by one rank only).
The ranks are spawned processes (gloo_ranks, shared by the parallel tests): run under
`flock /tmp/raylm-ray.lock`.
"""

from __future__ import annotations

import pytest
import torch

from tests.random_checkpoint import TINY_GPT_OSS, TINY_TP_MOE, write_random_checkpoint
from tests.workers.test_tensor_parallel import forward_logits, tp_logits
from workers.parallel import reset_tensor_parallel

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


# The 2-rank cases last: their group stays up for the other parallel tests (workers/conftest.py).
@pytest.mark.parametrize(
    "world,ep", [(3, False), (4, True), (2, False), (2, True)], ids=["tp3", "ep4", "tp2", "ep2"]
)
def test_split_experts_match_one_rank(world, ep, moe_dir, single_rank, gpt_oss_dir, gloo_ranks):
    dirs, refs = [moe_dir], [single_rank]
    if (world, ep) == (2, False):  # the same ranks then run gpt-oss
        reset_tensor_parallel()
        dirs.append(gpt_oss_dir)
        refs.append(forward_logits(gpt_oss_dir))
    for got, ref in zip(gloo_ranks(world).run(tp_logits, dirs, ep), refs, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
