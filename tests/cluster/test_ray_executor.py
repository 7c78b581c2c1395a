"""RayExecutor: TP workers as Ray actors (gloo on CPU), every step transport, fail-fast on worker
loss."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import ray

from cluster.ray_executor import EngineDeadError, RayExecutor
from engine.config import EngineConfig
from engine.executor import LocalExecutor
from scheduler import CachedRequestData, Scheduler, SchedulerConfig, SchedulerOutput
from scheduler.features_spec import SpecDecoding
from scheduler.speculative import SpeculativeConfig
from tests.cluster.engine_driver import greedy_tokens
from workers.runner import RunnerConfig

pytestmark = pytest.mark.slow

NUM_BLOCKS = 64
PROMPTS = [[1 + (7 * i + j) % 240 for j in range(9 + 6 * i)] for i in range(3)]


def runner_config(model_dir: str) -> RunnerConfig:
    config = EngineConfig(
        model=model_dir, device="cpu", load_progress=False, kv_cache_memory_gb=0.01
    )
    return config.runner_config(model_dir, 256)


def scheduler_config() -> SchedulerConfig:
    return SchedulerConfig(num_gpu_blocks=NUM_BLOCKS, max_model_len=256)


def started(executor):
    executor.init_kv_cache(NUM_BLOCKS, 0)
    return executor


@pytest.fixture(scope="module")
def reference(tiny_llama) -> dict[str, list[int]]:
    """Greedy tokens of the single-process engine (TP=1, LocalExecutor)."""
    executor = started(LocalExecutor(runner_config(tiny_llama)))
    tokens, _ = greedy_tokens(executor, scheduler_config(), PROMPTS, max_tokens=16)
    executor.shutdown()
    return tokens


@pytest.fixture(scope="module")
def compiled_tp2(ray_cluster, tiny_llama):
    """TP=2 over a compiled graph, in a STRICT_PACK placement group the executor creates."""
    executor = started(RayExecutor(runner_config(tiny_llama), 2, step_transport="compiled_graph"))
    yield executor
    executor.shutdown()


@pytest.fixture(scope="module")
def socket_tp2(ray_cluster, tiny_llama):
    """TP=2 over the default transport, one TCP step channel per rank."""
    executor = started(RayExecutor(runner_config(tiny_llama), 2))
    yield executor
    executor.shutdown()


@pytest.fixture(scope="module")
def handed_pg(ray_cluster):
    """The Serve layout: bundle 0 for the replica, then one bundle per TP worker."""
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([{"CPU": 0.5}, {"CPU": 1}, {"CPU": 1}], strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=60)
    yield pg
    remove_placement_group(pg)


@pytest.fixture(scope="module")
def actor_calls_tp2(ray_cluster, tiny_llama, handed_pg):
    """TP=2 over plain actor calls, in a placement group it is handed (worker bundles from 1)."""
    executor = started(
        RayExecutor(
            runner_config(tiny_llama),
            2,
            placement_group=handed_pg,
            bundle_offset=1,
            step_transport="actor_calls",
        )
    )
    yield executor
    executor.shutdown()


def test_tp2_over_a_compiled_graph_gives_the_greedy_tokens_of_tp1(compiled_tp2, reference):
    tokens, _ = greedy_tokens(compiled_tp2, scheduler_config(), PROMPTS, max_tokens=16)
    assert tokens == reference


def test_tp2_over_the_step_channel_gives_the_greedy_tokens_of_tp1(socket_tp2, reference):
    assert socket_tp2.step_transport == "socket"
    tokens, _ = greedy_tokens(socket_tp2, scheduler_config(), PROMPTS, max_tokens=16)
    assert tokens == reference


def test_tp2_with_speculation_gives_the_greedy_tokens_of_tp1(ray_cluster, tiny_llama, reference):
    """Proposals come from rank 0 and reach both ranks in the step, with the block tables cut
    after rejections: every rank runs the same verify forward. They come from a draft model (the
    model drafting for itself, whole on rank 0 alone, workers/draft.py); an n-gram proposal takes
    the same way from rank 0 on."""
    spec = SpeculativeConfig(
        method="draft", draft_model=tiny_llama, num_tokens=3, min_acceptance_rate=0.0
    )
    config = replace(runner_config(tiny_llama), speculative=spec, draft_model_dir=tiny_llama)
    executor = started(RayExecutor(config, 2))
    try:
        scheduler = Scheduler(scheduler_config(), [SpecDecoding(spec)])
        tokens, _ = greedy_tokens(executor, scheduler_config(), PROMPTS, 16, scheduler=scheduler)
    finally:
        executor.shutdown()
    assert tokens == reference
    assert scheduler.stats().num_spec_verify_rows > 0


def test_a_worker_exception_over_the_step_channel_names_rank_and_cause(socket_tp2):
    with pytest.raises(EngineDeadError) as info:
        socket_tp2.execute_model(_step_for_unknown_request())
    assert info.value.rank == 0  # both ranks raise; rank 0 answers first
    assert (
        "rank 0" in str(info.value)
        and "KeyError" in str(info.value)
        and "nobody" in str(info.value)
    )
    socket_tp2.shutdown()  # dead now; its placement group is needed by the tests below


def test_tp2_over_actor_calls_gives_the_greedy_tokens_of_tp1(actor_calls_tp2, reference):
    tokens, _ = greedy_tokens(actor_calls_tp2, scheduler_config(), PROMPTS, max_tokens=16)
    assert tokens == reference


def test_num_blocks_is_the_minimum_over_ranks_and_ranks_hold_half_the_kv_heads(
    actor_calls_tp2, tiny_llama
):
    local = LocalExecutor(runner_config(tiny_llama))
    # Two KV heads split over two ranks: each rank's block is half as large, so twice as many fit.
    assert (
        0 <= actor_calls_tp2.determine_num_blocks() - 2 * local.determine_num_blocks() <= 1
    )  # rounding
    local.shutdown()


def test_too_small_placement_group_is_rejected(ray_cluster, tiny_llama):
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([{"CPU": 0.5}, {"CPU": 1}], strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=60)
    with pytest.raises(ValueError, match="placement_group"):
        RayExecutor(runner_config(tiny_llama), 2, placement_group=pg, bundle_offset=1)
    remove_placement_group(pg)


def _step_for_unknown_request() -> SchedulerOutput:
    cached = CachedRequestData(["nobody"], [False], [[]], [[0]], [0])
    return SchedulerOutput([], cached, {"nobody": 1}, 1)


def _kill_during_generation(ray, executor) -> EngineDeadError:
    """Kill rank 1 a moment into a long generation; the EngineDeadError it raised."""
    killer = threading.Timer(0.3, lambda: ray.kill(executor.workers[1]))
    killer.start()
    try:
        with pytest.raises(EngineDeadError) as info:
            greedy_tokens(executor, scheduler_config(), PROMPTS, max_tokens=200, prefix="doomed")
    finally:
        killer.join()
    return info.value


def _assert_dead_because_rank_1_died(executor, error: EngineDeadError) -> None:
    assert error.rank == 1
    # "died", not a timeout: the death was detected, rather than waited out for the 300 s step
    # timeout.
    assert "rank 1" in str(error) and "died" in str(error)
    # The engine stays dead: later steps fail at once instead of touching the lost workers.
    with pytest.raises(EngineDeadError):
        executor.execute_model(_step_for_unknown_request())


# The tests below end their executor, so they come last in this module.
def test_killing_a_worker_under_actor_calls_raises_engine_dead_error(
    ray_cluster, actor_calls_tp2, handed_pg
):
    from ray.util.placement_group import placement_group_table

    error = _kill_during_generation(ray, actor_calls_tp2)
    _assert_dead_because_rank_1_died(actor_calls_tp2, error)
    actor_calls_tp2.shutdown()
    assert (
        placement_group_table(handed_pg)["state"] == "CREATED"
    )  # the caller's group, not ours to remove


def test_killing_a_worker_under_the_step_channel_raises_engine_dead_error(ray_cluster, tiny_llama):
    executor = started(RayExecutor(runner_config(tiny_llama), 2, step_transport="socket"))
    try:
        error = _kill_during_generation(ray, executor)
    finally:
        executor.shutdown()
    _assert_dead_because_rank_1_died(executor, error)


def test_killing_a_worker_under_a_compiled_graph_raises_engine_dead_error(ray_cluster, tiny_llama):
    executor = started(RayExecutor(runner_config(tiny_llama), 2, step_transport="compiled_graph"))
    try:
        error = _kill_during_generation(ray, executor)
    finally:
        executor.shutdown()
    _assert_dead_because_rank_1_died(executor, error)


def test_a_worker_exception_raises_engine_dead_error_naming_rank_and_cause(compiled_tp2):
    with pytest.raises(EngineDeadError) as info:
        compiled_tp2.execute_model(_step_for_unknown_request())
    assert info.value.rank in (0, 1)  # both ranks raise; whichever answered first is named
    assert f"rank {info.value.rank}" in str(info.value)
    assert "KeyError" in str(info.value) and "nobody" in str(info.value)
