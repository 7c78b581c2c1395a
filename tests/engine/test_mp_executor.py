"""Ranks without naming an executor: MPExecutor runs one spawned process per rank (gloo on CPU),
gives the greedy tokens of one process, hands work to every rank, and a rank's death fails the
engine (naming the rank) and leaves no process behind."""

from __future__ import annotations

import os
import signal
from functools import partial

import psutil
import pytest
import torch

from engine import backends
from engine.backends import backend_for, default_executor
from engine.config import EngineConfig
from engine.executor import EngineDeadError, LocalExecutor
from engine.mp_executor import MPExecutor
from scheduler import (
    CachedRequestData,
    EngineRequest,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from tests.cluster.engine_driver import greedy_tokens
from tests.random_checkpoint import TINY_TP_LLAMA, write_random_checkpoint
from workers.runner import ModelRunner, RunnerConfig

NUM_BLOCKS = 64
PROMPTS = [[1 + (5 * i + 3 * j) % 240 for j in range(8 + 7 * i)] for i in range(3)]
BAD_NUMBERS = [2**64, -1, 0, float("nan"), 10**30]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    """4 attention heads, 2 KV heads (TP=2 splits them), with a word-level tokenizer."""
    return write_random_checkpoint(TINY_TP_LLAMA, str(tmp_path_factory.mktemp("mp-llama"))).path


def runner_config(model_dir: str) -> RunnerConfig:
    config = EngineConfig(model=model_dir, device="cpu", load_progress=False)
    return config.runner_config(model_dir, 256)


def scheduler_config() -> SchedulerConfig:
    return SchedulerConfig(num_gpu_blocks=NUM_BLOCKS, max_model_len=256)


@pytest.fixture(scope="module")
def reference(tiny_llama) -> dict[str, list[int]]:
    """Greedy tokens of one rank in this process."""
    local = LocalExecutor(runner_config(tiny_llama))
    local.init_kv_cache(NUM_BLOCKS, 0)
    tokens, _ = greedy_tokens(local, scheduler_config(), PROMPTS, max_tokens=12)
    local.shutdown()
    return tokens


@pytest.fixture(scope="module")
def mp_tp2(tiny_llama):
    executor = MPExecutor(runner_config(tiny_llama), 2)
    executor.init_kv_cache(NUM_BLOCKS, 0)
    yield executor
    executor.shutdown()


def rank_and_pid(runner: ModelRunner, tag: str) -> tuple[str, int, int]:
    """What call_ranks runs on each rank: its tensor-parallel rank and process."""
    from workers.parallel import get_tp_rank

    return tag, get_tp_rank(), os.getpid()


@pytest.mark.slow
def test_tp2_processes_give_the_greedy_tokens_of_one_process(mp_tp2, reference):
    tokens, _ = greedy_tokens(mp_tp2, scheduler_config(), PROMPTS, max_tokens=12)
    assert tokens == reference


@pytest.mark.slow
def test_the_ranks_are_child_processes_of_this_one(mp_tp2):
    children = {child.pid for child in psutil.Process().children()}
    assert len(set(mp_tp2.pids)) == 2 and set(mp_tp2.pids) <= children
    assert os.getpid() not in mp_tp2.pids


@pytest.mark.slow
def test_call_ranks_runs_on_every_rank_in_rank_order(mp_tp2):
    answers = mp_tp2.call_ranks(partial(rank_and_pid, tag="hello"))
    assert answers == [("hello", 0, mp_tp2.pids[0]), ("hello", 1, mp_tp2.pids[1])]


def tensor_total(runner: ModelRunner, tensor: torch.Tensor) -> float:
    return float(tensor.sum())


@pytest.mark.slow
def test_call_ranks_hands_tensors_to_every_rank(mp_tp2):
    """What LoRA does: an adapter's checked tensors go to every rank through call_ranks."""
    weights = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert mp_tp2.call_ranks(partial(tensor_total, tensor=weights)) == [66.0, 66.0]


@pytest.mark.slow
def test_an_error_in_call_ranks_is_the_callers_and_the_engine_lives_on(mp_tp2, reference):
    with pytest.raises(TypeError, match="tag"):
        mp_tp2.call_ranks(rank_and_pid)  # the keyword is missing on every rank
    tokens, _ = greedy_tokens(mp_tp2, scheduler_config(), PROMPTS[:1], 12, prefix="again")
    assert tokens["again-0"] == reference["req-0"]


@pytest.mark.slow
def test_a_rank_exception_in_a_step_names_rank_and_cause(mp_tp2):
    """Ends mp_tp2: the last of its tests."""
    cached = CachedRequestData(["nobody"], [False], [[]], [[0]], [0])
    with pytest.raises(EngineDeadError) as info:
        mp_tp2.execute_model(SchedulerOutput([], cached, {"nobody": 1}, 1))
    assert info.value.rank == 0 and "KeyError" in str(info.value)
    assert "nobody" in str(info.value)
    mp_tp2.shutdown()
    assert not _alive(mp_tp2.pids)


@pytest.mark.slow
def test_a_killed_rank_fails_the_engine_naming_it_and_shutdown_leaves_no_process(tiny_llama):
    # The step timeout is far away: the death must be seen, not waited out.
    executor = MPExecutor(runner_config(tiny_llama), 2, step_timeout_s=600)
    try:
        executor.init_kv_cache(NUM_BLOCKS, 0)
        with pytest.raises(EngineDeadError) as info:
            _generate_killing_rank_1_at_step(executor, 5)
    finally:
        executor.shutdown()
    assert info.value.rank == 1 and "died" in str(info.value)
    assert "-9" in str(info.value)  # its exit code: killed by SIGKILL
    with pytest.raises(EngineDeadError):  # dead stays dead
        executor.determine_num_blocks()
    assert not _alive(executor.pids)


def _generate_killing_rank_1_at_step(executor: MPExecutor, kill_at: int) -> None:
    scheduler = Scheduler(scheduler_config())
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        scheduler.add_request(Request(EngineRequest(f"doomed-{i}", prompt, params)))
    for step_number in range(1000):
        if step_number == kill_at:
            os.kill(executor.pids[1], signal.SIGKILL)
        step = scheduler.schedule()
        scheduler.update_from_output(step, executor.execute_model(step))
    raise AssertionError("the engine outlived its rank")


def _alive(pids: list[int]) -> list[int]:
    """Those of pids still running (a reaped process is gone; a zombie counts as not running)."""
    running = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
        except psutil.NoSuchProcess:
            pass
    return running


# ---- the backend choice and its settings ---------------------------------------------------------
def test_ranks_pick_mp_on_this_machine_unless_ray_is_asked_for():
    assert backend_for(EngineConfig(tensor_parallel_size=2), "cpu") == "mp"
    assert backend_for(EngineConfig(), "cpu") is None  # one rank: in this process
    ray = EngineConfig(tensor_parallel_size=2, distributed_executor_backend="ray")
    assert backend_for(ray, "cpu") == "ray"
    # More GPU ranks than this machine has GPUs: only Ray can place them.
    too_many = EngineConfig(tensor_parallel_size=1024)
    assert backend_for(too_many, "cuda") == "ray"


def test_ray_without_the_ray_adapter_loaded_says_how_to_get_it(monkeypatch, tiny_llama):
    monkeypatch.setattr(backends, "_RAY", [])
    config = EngineConfig(tensor_parallel_size=2, distributed_executor_backend="ray")
    with pytest.raises(ValueError, match="distributed_executor_backend.*import cluster.ray_exec"):
        default_executor(config, runner_config(tiny_llama))


@pytest.mark.parametrize("value", ["foo", "", "MP", 2**64, -1, float("nan"), "x" * 100_000])
def test_a_bad_backend_is_refused_naming_the_field(value):
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        EngineConfig(distributed_executor_backend=value)


@pytest.mark.parametrize("value", BAD_NUMBERS)
def test_a_bad_tensor_parallel_size_is_refused_naming_the_field(value):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=value)


@pytest.mark.parametrize("value", BAD_NUMBERS + [1025])
def test_llm_refuses_a_bad_tensor_parallel_size_before_starting_anything(value):
    from engine.llm import LLM

    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(model="default", tensor_parallel_size=value)


@pytest.mark.slow
def test_llm_with_two_ranks_and_no_executor_named_gives_the_tokens_of_one(tiny_llama, reference):
    from engine.llm import LLM

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(model=tiny_llama, tensor_parallel_size=2, device="cpu", load_progress=False) as llm:
        assert isinstance(llm.engine.executor, MPExecutor)
        pids = llm.engine.executor.pids
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [out.token_ids for out in outputs] == [reference[f"req-{i}"] for i in range(3)]
    assert not _alive(pids)  # the with block ended the rank processes


@pytest.mark.parametrize("value", ["foo", 2**64, -1, float("nan"), "x" * 100_000])
def test_served_config_refuses_a_bad_backend_naming_the_field(value):
    from deploy.config import AppConfig

    with pytest.raises(ValueError, match="engine.distributed_executor_backend"):
        AppConfig.from_args({"distributed_executor_backend": value})


def test_served_config_takes_the_backend_into_the_engine_settings():
    from deploy.config import AppConfig

    config = AppConfig.from_args({"distributed_executor_backend": "ray"})
    assert config.engine.distributed_executor_backend == "ray"


@pytest.mark.slow
def test_lora_adapters_reach_every_rank_process(tiny_checkpoint, tmp_path):
    """Adapters are checked once in the engine and handed to each rank through call_ranks
    (engine/loras.py): over rank processes, TP=2 gives the tokens of one process, per adapter."""
    from engine.llm import LLM
    from tests.random_checkpoint import random_prompts
    from tests.random_lora import write_random_lora

    model_dir, _ = tiny_checkpoint("llama_mqa")
    modules = {"all": write_random_lora(model_dir, str(tmp_path / "all"), seed=31, rank=8)}
    prompts = random_prompts(2, 256, 10, 20, seed=5)
    batch, loras = [p for p in prompts for _ in (0, 1)], [None, "all"] * len(prompts)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = {}
    for tp in (1, 2):
        kwargs = {"device": "cpu", "load_progress": False, "max_model_len": 128}
        with LLM(model_dir, tensor_parallel_size=tp, lora_modules=modules, **kwargs) as llm:
            assert isinstance(llm.engine.executor, MPExecutor) == (tp == 2)
            outputs = llm.generate(batch, params, use_tqdm=False, lora=loras)
        tokens[tp] = [out.token_ids for out in outputs]
    assert tokens[2] == tokens[1]
    assert tokens[1][0] != tokens[1][1]  # the adapter changed the tokens
