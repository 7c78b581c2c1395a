"""A replica across Ray nodes: three nodes on this machine (the session's head and two joined to
it, tests/cluster/conftest.py), tensor-parallel ranks placed on different nodes give the greedy
tokens of one process, and a node killed mid-generation fails the engine at once; its requests,
resumed elsewhere with what they had emitted (the ingress's failover, EngineRequest's
output_token_ids), end with the same tokens as an undisturbed run."""

from __future__ import annotations

import time

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from cluster.placement import SPREAD_STRATEGY
from cluster.ray_executor import RayExecutor
from engine.config import EngineConfig
from engine.executor import EngineDeadError, LocalExecutor
from scheduler import EngineRequest, Request, SamplingParams, Scheduler, SchedulerConfig
from tests.cluster.engine_driver import greedy_tokens
from workers.runner import RunnerConfig

pytestmark = pytest.mark.slow

NUM_BLOCKS = 64
MAX_TOKENS = 40
PROMPTS = [[1 + (13 * i + 5 * j) % 240 for j in range(6 + 5 * i)] for i in range(4)]
KILL_AT_STEP = 8  # the node dies after this many steps: every request has emitted some tokens


def runner_config(model_dir: str) -> RunnerConfig:
    config = EngineConfig(model=model_dir, device="cpu", load_progress=False)
    return config.runner_config(model_dir, 256)


def scheduler_config() -> SchedulerConfig:
    return SchedulerConfig(num_gpu_blocks=NUM_BLOCKS, max_model_len=256)


def started(executor):
    executor.init_kv_cache(NUM_BLOCKS, 0)
    return executor


def node_ids(executor: RayExecutor) -> list[str]:
    return ray.get([w.node_id.remote() for w in executor.workers], timeout=60)


@pytest.fixture(scope="module")
def reference(tiny_llama) -> dict[str, list[int]]:
    """Greedy tokens of one process (TP=1)."""
    local = started(LocalExecutor(runner_config(tiny_llama)))
    tokens, _ = greedy_tokens(local, scheduler_config(), PROMPTS, max_tokens=MAX_TOKENS)
    local.shutdown()
    return tokens


def test_spread_ranks_sit_on_different_nodes_and_give_the_tokens_of_one_process(
    extra_nodes, tiny_llama, reference
):
    executor = started(
        RayExecutor(runner_config(tiny_llama), 2, placement_strategy=SPREAD_STRATEGY)
    )
    try:
        where = node_ids(executor)
        tokens, _ = greedy_tokens(executor, scheduler_config(), PROMPTS, max_tokens=MAX_TOKENS)
    finally:
        executor.shutdown()
    assert len(set(where)) == 2  # all-reduces crossed nodes (gloo over loopback TCP)
    assert tokens == reference


def test_a_node_killed_mid_generation_loses_no_request(extra_nodes, tiny_llama, reference):
    """Rank 0 on one joined node, rank 1 on the other; the second node dies mid-generation."""
    survivor, doomed = extra_nodes
    pinned = placement_group([{survivor.resource: 1}, {doomed.resource: 1}], strategy="PACK")
    ray.get(pinned.ready(), timeout=120)
    # The step timeout is far away: the death must be seen, not waited out.
    executor = started(
        RayExecutor(runner_config(tiny_llama), 2, placement_group=pinned, step_timeout_s=600)
    )
    try:
        assert node_ids(executor) == [survivor.node_id, doomed.node_id]
        emitted, error = _generate_until_the_node_dies(executor, doomed)
    finally:
        executor.shutdown()
        remove_placement_group(pinned)
    assert "no answer in time" not in str(error)
    assert all(0 < len(tokens) < MAX_TOKENS for tokens in emitted.values())
    # Every accepted request resumes on ranks spread over the nodes still alive.
    resumed = started(RayExecutor(runner_config(tiny_llama), 2, placement_strategy=SPREAD_STRATEGY))
    try:
        assert doomed.node_id not in node_ids(resumed)
        rest = _resume(resumed, emitted)
    finally:
        resumed.shutdown()
    assert {rid: emitted[rid] + rest[rid] for rid in emitted} == reference


def _generate_until_the_node_dies(executor, node) -> tuple[dict[str, list[int]], EngineDeadError]:
    """Greedy generation that kills `node` after KILL_AT_STEP steps; the tokens each request had
    emitted, and the error the engine raised."""
    scheduler = Scheduler(scheduler_config())
    for i, prompt in enumerate(PROMPTS):
        scheduler.add_request(Request(EngineRequest(f"req-{i}", prompt, _params())))
    emitted: dict[str, list[int]] = {f"req-{i}": [] for i in range(len(PROMPTS))}
    for step_number in range(10 * MAX_TOKENS):
        if step_number == KILL_AT_STEP:
            node.kill()
            # Its workers exit when they notice their raylet is gone, a moment later; a tiny model
            # could finish every request first, so generation waits for the rank to be gone.
            _wait_until_unreachable(executor.workers[1])
        step = scheduler.schedule()
        try:
            output = executor.execute_model(step)
        except EngineDeadError as exc:
            return emitted, exc
        for out in scheduler.update_from_output(step, output):
            emitted[out.request_id].extend(out.new_token_ids)
    raise AssertionError("the engine outlived its node")


def _wait_until_unreachable(worker, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(worker.node_id.remote(), timeout=5)
        except ray.exceptions.RayError:
            return
        time.sleep(0.2)
    raise AssertionError(f"the killed node's rank still answers after {timeout_s:.0f}s")


def _resume(executor, emitted: dict[str, list[int]]) -> dict[str, list[int]]:
    """The rest of each request, resumed with its emitted tokens as the ingress resumes a choice."""
    scheduler = Scheduler(scheduler_config())
    for i, prompt in enumerate(PROMPTS):
        rid = f"req-{i}"
        request = EngineRequest(rid, prompt, _params(), output_token_ids=list(emitted[rid]))
        scheduler.add_request(Request(request))
    rest: dict[str, list[int]] = {rid: [] for rid in emitted}
    while scheduler.has_unfinished_requests():
        step = scheduler.schedule()
        for out in scheduler.update_from_output(step, executor.execute_model(step)):
            rest[out.request_id].extend(out.new_token_ids)
    return rest


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("strategy", ["SIDEWAYS", "", "strict_spread"])
def test_an_unknown_placement_strategy_is_refused_naming_it(ray_cluster, tiny_llama, strategy):
    with pytest.raises(ValueError, match="placement_strategy"):
        RayExecutor(runner_config(tiny_llama), 2, placement_strategy=strategy)
