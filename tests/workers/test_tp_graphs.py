"""CUDA graphs under tensor parallelism: which collectives a graph may hold, the ranks' agreement
on the captured sizes, and (on a GPU) decode graphs with NCCL's all-reduces inside them.

On one GPU an NCCL group of one rank still sends every all-reduce of the model through NCCL, so
the CUDA tests capture exactly what a TP rank's graphs hold. Without CUDA they skip; the CPU
tests run the decision and the size check over gloo.
"""

from __future__ import annotations

import gc
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scheduler import SamplingParams
from tests.random_checkpoint import TINY_FAMILIES, random_prompts, write_random_checkpoint
from workers.cuda_graphs import check_same_sizes, decode_graphs_enabled
from workers.distributed import destroy_distributed, free_port, init_distributed
from workers.parallel import (
    all_reduce,
    collectives_capturable,
    collectives_issued,
    init_tensor_parallel,
)

CUDA = torch.device("cuda")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def gloo_group_of_one():
    init_distributed(0, 1, f"127.0.0.1:{free_port()}", "cpu", timeout_s=60)
    try:
        yield
    finally:
        destroy_distributed()


def test_graphs_follow_device_enforce_eager_and_backend():
    assert collectives_capturable()  # no group: nothing to capture
    assert decode_graphs_enabled(CUDA, enforce_eager=False, backend_capturable=True)
    assert not decode_graphs_enabled(CUDA, enforce_eager=True, backend_capturable=True)
    assert not decode_graphs_enabled(CUDA, enforce_eager=False, backend_capturable=False)
    assert not decode_graphs_enabled(torch.device("cpu"), False, True)


def test_a_gloo_group_never_captures(gloo_group_of_one):
    """gloo's collectives run on the host: a graph would replay without them."""
    assert dist.get_backend() == "gloo"
    assert not collectives_capturable()
    assert not decode_graphs_enabled(CUDA, enforce_eager=False, backend_capturable=True)
    before = collectives_issued()
    check_same_sizes([1, 2, 4, 8], torch.device("cpu"))  # one rank agrees with itself
    assert collectives_issued() == before + 1


def _sizes_rank(rank: int, init_file: str, sizes: list[list[int]], out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    init_tensor_parallel(rank, 2, dist.group.WORLD)
    try:
        check_same_sizes(sizes[rank], torch.device("cpu"))
        result = "agreed"
    except RuntimeError as exc:
        result = str(exc)
    finally:
        dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as f:
        f.write(result)


def test_ranks_with_different_sizes_all_refuse_to_capture(tmp_path):
    """A rank replaying another graph than its peers would wait forever in a collective: every
    rank raises instead (here one rank holds max_num_seqs 64, the other 96)."""
    sizes = [[1, 2, 4, 8, 16, 32, 64], [1, 2, 4, 8, 16, 32, 64, 96]]
    out = str(tmp_path / "result")
    args = (str(tmp_path / "init"), sizes, out)
    # fork: the ranks need only this module's function and start in milliseconds
    ranks = mp.start_processes(_sizes_rank, args=args, nprocs=2, join=False, start_method="fork")
    deadline = time.monotonic() + 120
    while not ranks.join(timeout=1):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail("the two gloo ranks did not finish in 120 s")
    for rank in (0, 1):
        with open(f"{out}.{rank}") as f:
            text = f.read()
        assert "different batch sizes" in text and "max_num_seqs" in text, text


# ---- on a GPU --------------------------------------------------------------------------------


@pytest.fixture
def nccl_group_of_one():
    init_distributed(0, 1, f"127.0.0.1:{free_port()}", "cuda", timeout_s=120)
    try:
        yield
    finally:
        destroy_distributed()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    """Two layers, 4 query heads over 2 KV heads of Llama-3.2's head size (64)."""
    path = str(tmp_path_factory.mktemp("tp-graphs-llama"))
    spec = TINY_FAMILIES["llama"].with_fields(hidden_size=256, intermediate_size=512)
    return write_random_checkpoint(spec, path, seed=29).path


@needs_cuda
@pytest.mark.cuda
def test_an_nccl_all_reduce_replays_inside_a_graph(nccl_group_of_one):
    assert dist.get_backend() == "nccl" and collectives_capturable()
    x = torch.arange(8.0, device="cuda")
    all_reduce(x.clone())  # the communicator is set up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    before = collectives_issued()
    with torch.cuda.graph(graph):
        y = all_reduce(x * 2) + 1
    assert collectives_issued() == before + 1
    x.copy_(torch.arange(8.0, device="cuda") * 3)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.arange(8.0, device="cuda") * 6 + 1)


def _greedy_tokens(path: str, dtype: str, eager: bool) -> tuple[list[list[int]], object]:
    from engine.llm import LLM

    llm = LLM(
        model=path,
        dtype=dtype,
        device="cuda",
        load_progress=False,
        enforce_eager=eager,
        max_model_len=256,
        num_gpu_blocks=256,
        max_num_seqs=16,
        max_num_batched_tokens=512,
    )
    try:
        runner = llm.engine.executor.runner
        # 11 requests of 1..11 new tokens: the decode batch walks down through sizes 16..1.
        prompts = random_prompts(11, 400, 3, 40, seed=29)
        params = [
            SamplingParams(max_tokens=i + 1, temperature=0.0, ignore_eos=True) for i in range(11)
        ]
        tokens = [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        graphs = runner.graphs
        info = None if graphs is None else (dict(graphs.collectives), graphs.replays)
        return tokens, info
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_with_nccl_collectives_give_the_tokens_of_eager(dtype, tiny_llama):
    """An NCCL group of one: graphs hold the model's all-reduces and replay the eager tokens;
    enforce_eager still turns them off; without a group the tokens are the same again."""
    init_distributed(0, 1, f"127.0.0.1:{free_port()}", "cuda", timeout_s=120)
    try:
        graphed, info = _greedy_tokens(tiny_llama, dtype, eager=False)
        eager, eager_info = _greedy_tokens(tiny_llama, dtype, eager=True)
    finally:
        destroy_distributed()
    assert eager_info is None  # enforce_eager: no graphs, group or not
    assert info is not None
    collectives, replays = info
    # Two layers, each with two row-parallel all-reduces (o_proj, down_proj); at one rank the
    # embedding is whole and needs none.
    assert set(collectives.values()) == {4}, collectives
    assert replays > 0
    assert graphed == eager
    alone, alone_info = _greedy_tokens(tiny_llama, dtype, eager=False)
    assert alone_info is not None and set(alone_info[0].values()) == {0}
    assert alone == eager
