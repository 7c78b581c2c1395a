"""A replica across Ray nodes: three nodes on this machine (the session's head and two joined to
it, tests/cluster/conftest.py), tensor-parallel ranks placed on different nodes give the greedy
tokens of one process, and a node killed mid-generation fails the engine at once; its requests,
resumed elsewhere with what they had emitted (the ingress's failover, EngineRequest's
output_token_ids), end with the same tokens as an undisturbed run. Served: a replica whose two
pipeline stages sit on two nodes loses one of them mid-stream and is replaced on the nodes left."""

from __future__ import annotations

import asyncio
import os
import time

import psutil
import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from cluster.placement import SPREAD_STRATEGY
from cluster.ray_executor import RayExecutor
from cluster.replica import LLMReplica
from engine.config import EngineConfig
from engine.executor import EngineDeadError, LocalExecutor
from scheduler import EngineRequest, Request, SamplingParams, Scheduler, SchedulerConfig
from tests.cluster.conftest import _start_node
from tests.cluster.engine_driver import greedy_tokens
from tests.deploy.conftest import delete_app
from workers.distributed import free_port
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
def reference(served_reference) -> dict[str, list[int]]:
    """Greedy tokens of one process (TP=1): the first MAX_TOKENS of the served test's longer
    run, whose first MAX_TOKENS steps run the same batch (every prompt, no preemption)."""
    return {rid: tokens[:MAX_TOKENS] for rid, tokens in served_reference.items()}


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


# ---- a served replica across nodes ---------------------------------------------------------------
SERVED_APP = "multinode_pp"
SERVED_TOKENS = 200  # long enough that the node's death lands while every stream still runs


@pytest.fixture(scope="module")
def served_reference(tiny_llama) -> dict[str, list[int]]:
    """Greedy tokens of one process (TP=1) for the served test's longer generations."""
    local = started(LocalExecutor(runner_config(tiny_llama)))
    tokens, _ = greedy_tokens(local, scheduler_config(), PROMPTS, max_tokens=SERVED_TOKENS)
    local.shutdown()
    return tokens


def test_a_served_replica_across_two_nodes_is_replaced_when_one_dies(
    ray_cluster, extra_nodes, tiny_llama, served_reference
):
    """One replica of PP=2 whose stages SPREAD over the cluster's three nodes; the joined node
    that holds a stage (and not the replica) dies mid-stream. Every stream ends: with its tokens,
    or with an error the ingress resumes elsewhere (a replica failure, cluster/errors.py); Serve
    replaces the replica on the nodes still alive, and each failed stream, resumed there with
    what it had emitted, ends with the undisturbed tokens."""
    from ray import serve

    from deploy.config import AppConfig
    from deploy.generation import is_replica_failure

    config = AppConfig.from_args(
        {
            "model": tiny_llama,
            "device": "cpu",
            "pipeline_parallel_size": 2,
            "placement_strategy": "SPREAD",  # the replacement must fit the two nodes left
            "num_gpu_blocks": NUM_BLOCKS,
            "max_model_len": 256,
            "replica_num_cpus": 0.5,
            "worker_num_cpus": 1,
        }
    )
    nodes = _two_live_nodes(ray_cluster, extra_nodes)
    serve.start(proxy_location="Disabled", http_options={"host": "127.0.0.1", "port": free_port()})
    replica = LLMReplica.options(
        num_replicas=1,
        ray_actor_options=config.replica_actor_options(),
        placement_group_bundles=config.placement_group_bundles(),
        placement_group_strategy=config.placement_group_strategy(),
        health_check_period_s=1,
        health_check_timeout_s=60,
    )
    handle = serve.run(replica.bind(config.engine), name=SERVED_APP, route_prefix=None)
    try:
        first = handle.stats.remote().result(timeout_s=60)
        raylets = _raylet_pids(nodes)
        stages = [_node_of(pid, raylets) for pid in first["model_pids"]]
        assert len(set(stages)) == 2, stages  # the stages sit on two nodes
        home = _node_of(_replica_pid(SERVED_APP), raylets)
        # A joined node that holds a stage and not the replica (SPREAD puts the three bundles on
        # the three nodes, so one is always there).
        doomed = next(n for n in nodes if n.node_id in stages and n.node_id != home)
        emitted, errors = asyncio.run(_stream_until_killed(handle, doomed))
        assert errors, "every stream finished before the node's death was seen"
        assert all(is_replica_failure(exc) for exc in errors.values()), errors
        for rid, tokens in emitted.items():
            if rid not in errors:
                assert tokens == served_reference[rid]
        # Serve replaces the failed replica; its stages avoid the dead node.
        second = _wait_for_new_replica(handle, first["replica"], timeout_s=300)
        assert doomed.node_id not in [_node_of(pid, raylets) for pid in second["model_pids"]]
        rest = asyncio.run(_resume_served(handle, {rid: emitted[rid] for rid in errors}))
        for rid in errors:
            assert emitted[rid] + rest[rid] == served_reference[rid], rid
    finally:
        delete_app(SERVED_APP)  # stops in the background, as the joined nodes do at module end


async def _stream_until_killed(handle, node) -> tuple[dict[str, list[int]], dict[str, Exception]]:
    """Stream every prompt; kill `node` once every stream has tokens. The tokens each emitted and
    the error of each that failed; every stream must end within the bound."""
    params = SamplingParams(max_tokens=SERVED_TOKENS, temperature=0.0, ignore_eos=True)
    emitted: dict[str, list[int]] = {f"req-{i}": [] for i in range(len(PROMPTS))}
    errors: dict[str, Exception] = {}
    going = {rid: asyncio.Event() for rid in emitted}

    async def stream(i: int, prompt: list[int]) -> None:
        rid = f"req-{i}"
        try:
            request = EngineRequest(rid, prompt, params)
            async for out in handle.options(stream=True).generate.remote(request):
                emitted[rid].extend(out.new_token_ids)
                going[rid].set()
        except Exception as exc:  # what the ingress would see, to classify below
            errors[rid] = exc
        finally:
            going[rid].set()

    tasks = [asyncio.create_task(stream(i, p)) for i, p in enumerate(PROMPTS)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in going.values())), 120)
    node.kill()
    await asyncio.wait_for(asyncio.gather(*tasks), 180)  # no stream outlives the bound
    return emitted, errors


async def _resume_served(handle, emitted: dict[str, list[int]]) -> dict[str, list[int]]:
    """Each failed stream resumed with its emitted tokens, as the ingress resumes a choice."""
    params = SamplingParams(max_tokens=SERVED_TOKENS, temperature=0.0, ignore_eos=True)
    rest: dict[str, list[int]] = {rid: [] for rid in emitted}

    async def resume(rid: str) -> None:
        prompt = PROMPTS[int(rid.split("-")[1])]
        request = EngineRequest(f"{rid}-m1", prompt, params, output_token_ids=list(emitted[rid]))
        async for out in handle.options(stream=True).generate.remote(request):
            rest[rid].extend(out.new_token_ids)

    await asyncio.wait_for(asyncio.gather(*(resume(rid) for rid in emitted)), 180)
    return rest


def _two_live_nodes(gcs_address: str, nodes: list) -> list:
    """Two live joined nodes: the module's, with one started in place of each that an earlier
    test killed (appended to the module's list, so the fixture stops it at the end)."""
    # The GCS marks a killed node dead only after its heartbeats time out; a node whose processes
    # this process killed is dead already.
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]} - {
        n.node_id for n in nodes if "raylet" not in n.node.all_processes
    }
    while sum(n.node_id in alive for n in nodes) < 2:
        nodes.append(_start_node(gcs_address, f"raylm_test_node_{len(nodes)}_{os.getpid()}"))
        alive.add(nodes[-1].node_id)
    return [n for n in nodes if n.node_id in alive]


def _raylet_pids(nodes) -> dict[int, str]:
    """Each joined node's raylet pid: the parent of every worker process Ray starts there."""
    return {n.node.all_processes["raylet"][0].process.pid: n.node_id for n in nodes}


def _node_of(pid: int, raylets: dict[int, str]) -> str:
    """The joined node whose raylet started process `pid` (this machine's processes), else
    "head"; no state API here (the session's cluster runs without a dashboard)."""
    for parent in psutil.Process(pid).parents():
        if parent.pid in raylets:
            return raylets[parent.pid]
    return "head"


def _replica_pid(app: str) -> int:
    """The Serve replica's process, by the title Ray gives an actor's process."""
    [pid] = [
        proc.pid
        for proc in psutil.process_iter(["cmdline"])
        if any(f"ServeReplica:{app}:LLMReplica" in part for part in proc.info["cmdline"] or ())
    ]
    return pid


def _wait_for_new_replica(handle, old: str, timeout_s: float) -> dict:
    """The stats of the replica Serve started in place of `old`, once it serves."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            stats = handle.stats.remote().result(timeout_s=30)
        except Exception:  # the failed replica refusing, or none routable yet
            stats = None
        if stats is not None and stats["replica"] != old:
            return stats
        time.sleep(1.0)
    raise AssertionError(f"replica {old} was not replaced within {timeout_s:.0f}s")
