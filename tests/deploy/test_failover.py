"""A replica killed, scaled down, redeployed or shut down mid-generation loses no request and no
character: each choice resumes on another replica and the client sees one uninterrupted stream
with the same text as an undisturbed run (greedy and seeded)."""

import asyncio
import json
import os
import signal
import time
from collections.abc import Awaitable, Callable

import httpx
import openai
import pytest
import ray
from ray import serve

from scheduler import EngineRequest, SamplingParams
from tests.deploy.conftest import delete_app, run_app, wait_for

pytestmark = pytest.mark.slow

APP = "failover"  # the module's first app; each fresh deploy names a new one (_deploy)
MODEL = "tiny-failover"
MAX_TOKENS = 200
# (prompt, sampling): greedy ones and seeded temperature sampling, which must resume exactly too.
CASES = [(f"Story number {i}:", {"temperature": 0.0}) for i in range(4)] + [
    (f"Poem number {i}:", {"temperature": 0.9, "seed": 100 + i}) for i in range(4)
]


def app_args(model_dir: str, **changes) -> dict:
    return {
        "model": model_dir,
        "served_model_name": MODEL,
        "max_model_len": 256,
        "num_gpu_blocks": 128,
        "num_replicas": 2,
        "replica_num_cpus": 0.5,
        "ingress_num_cpus": 0.25,
        "max_ongoing_requests": 16,
        # Held tokens die with a killed replica: resumption must regenerate them exactly.
        "stream_interval": 3,
        # The batch test's state outlives the ingress it kills (the module's own folder).
        "batch_dir": DEPLOYED["batch_dir"],
        # Serve learns that a killed replica is dead at its next probe: every 1 s instead of the
        # default 5 s, each replacement the tests wait for starts ~2 s sooner on average.
        "health_check_period_s": 1,
        **changes,
    }


# The app's name, and the args of its last serve.run: serve.run sets no deployment version, so
# Serve restarts every replica even for the same args, and a test that finds its args deployed
# skips it.
DEPLOYED: dict = {"app": APP, "args": None, "fresh": 0, "batch_dir": None}


def _app() -> str:
    """The name of the app the tests run on now."""
    return DEPLOYED["app"]


def _url() -> str:
    return f"http://127.0.0.1:{DEPLOYED['port']}/{_app()}/v1"


def _run_app(args: dict) -> None:
    """serve.run: returns once the app is RUNNING."""
    from deploy.app import build_app

    DEPLOYED["args"] = args
    run_app(build_app(args), _app(), f"/{_app()}")


@pytest.fixture(scope="module")
def failover_url(ray_cluster, http_port, tiny_model_dir, tmp_path_factory):
    DEPLOYED["port"] = http_port
    DEPLOYED["batch_dir"] = str(tmp_path_factory.mktemp("failover-batch"))
    _run_app(app_args(tiny_model_dir))
    yield _url()
    delete_app(_app())


def _body(prompt: str, sampling: dict, stream: bool) -> dict:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": stream,
        **sampling,
    }


async def _complete(client: httpx.AsyncClient, prompt: str, sampling: dict) -> tuple[str, int]:
    r = await client.post("/completions", json=_body(prompt, sampling, stream=False))
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["completion_tokens"]


async def _stream(
    client: httpx.AsyncClient, prompt: str, sampling: dict, started: asyncio.Event
) -> tuple[str, int]:
    text, usage = "", 0
    body = {**_body(prompt, sampling, stream=True), "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            if event.get("usage"):
                usage = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                text += choice["text"]
                started.set()
    return text, usage


def _kill_one_replica() -> str:
    names = _replica_names()
    assert len(names) == 2, names
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    return names[0]


async def _kill_replica_fault() -> None:
    _kill_one_replica()


async def _busy_replica() -> dict:
    """The stats of a replica that has requests in flight."""
    stats = await serve.get_deployment_handle("LLMReplica", app_name=_app()).stats.remote()
    assert stats["num_streams"] > 0, stats
    return stats


async def _kill_a_generating_replica(timeout: float = 30) -> str:
    """Kill a replica as soon as one reports requests running (a fixed sleep can miss them: 200
    tokens of the tiny model take well under a second)."""
    handle = serve.get_deployment_handle("LLMReplica", app_name=_app())
    deadline = time.monotonic() + timeout
    while True:
        stats = await handle.stats.remote()
        if stats["num_running"] > 0 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.01)
    assert stats["num_running"] > 0, stats
    victim = next(name for name in _replica_names() if stats["replica"] in name)
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    return victim


KILLED: list[str] = []  # replicas whose worker was killed


async def _kill_worker_fault() -> None:
    """SIGKILL rank 1 of a TP=2 replica: the engine fails at its next collective."""
    stats = await _busy_replica()
    KILLED.append(stats["replica"])
    os.kill(stats["model_pids"][1], signal.SIGKILL)


STALLED: list[tuple[str, int]] = []  # (replica, pid of the stopped worker)


async def _stall_worker_fault() -> None:
    """SIGSTOP rank 1 of a TP=2 replica: its step never returns, and only the watchdog can tell."""
    stats = await _busy_replica()
    STALLED.append((stats["replica"], stats["model_pids"][1]))
    os.kill(stats["model_pids"][1], signal.SIGSTOP)


def _replica_names(excluding: str = "") -> list[str]:
    """The live LLMReplica actors of the app (all but `excluding`)."""
    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if f"{_app()}#LLMReplica" in a["name"] and a["name"] != excluding
    ]


def _wait_replica_gone(replica: str, timeout: float = 120) -> None:
    def gone() -> bool:
        return not any(
            replica in a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
        )

    assert wait_for(gone, timeout, 0.1), f"replica {replica} was not replaced"


async def _run_cases(
    url: str, fault: Callable[[], Awaitable[None]] | None, cases: list[tuple[str, dict]] = CASES
) -> list[tuple[str, int]]:
    """Every case at once (odd ones streamed); the fault strikes once every request is
    generating."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        events = [asyncio.Event() for _ in cases]
        tasks = [
            asyncio.create_task(_stream(client, p, s, e) if i % 2 else _complete(client, p, s))
            for i, ((p, s), e) in enumerate(zip(cases, events))
        ]
        if fault is not None:
            await asyncio.wait_for(
                asyncio.gather(*(e.wait() for i, e in enumerate(events) if i % 2)), 120
            )
            in_flight = sum(not t.done() for t in tasks)
            await fault()
            assert in_flight == len(cases), (
                "the fault must strike while every request is generating"
            )
        return await asyncio.gather(*tasks)


# Undisturbed texts by app configuration: greedy and seeded texts do not depend on the batch or
# the replica (the disturbed runs prove it), so tests on the same configuration share one run.
UNDISTURBED: dict[str, list[tuple[str, int]]] = {}


def _undisturbed(url: str, config: str, cases: list[tuple[str, dict]] = CASES) -> list:
    if config not in UNDISTURBED:
        UNDISTURBED[config] = asyncio.run(_run_cases(url, None, cases))
    return UNDISTURBED[config]


def test_killing_a_replica_mid_generation_loses_no_request(failover_url):
    undisturbed = _undisturbed(failover_url, "tp1")
    disturbed = asyncio.run(_run_cases(failover_url, _kill_replica_fault))
    for (prompt, _), calm, hit in zip(CASES, undisturbed, disturbed):
        assert hit == calm, prompt  # same text, and usage counts every token exactly once
        assert hit[1] == MAX_TOKENS
    # Serve replaces the dead replica; the app keeps serving.
    _wait_replicas_running(2)
    assert asyncio.run(_run_one(failover_url))[1] == MAX_TOKENS


BATCH_LINES = 24


def _batch_file() -> bytes:
    rows = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": _body(f"Batch line {i}:", {"temperature": 0.0}, False) | {"max_tokens": 48},
        }
        for i in range(BATCH_LINES)
    ]
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _batch_client(url: str) -> openai.OpenAI:
    # The app has no keys; the client's Authorization header is what lets a browser-less
    # multipart upload past the browser guard.
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30)


def _batch_status(client: openai.OpenAI, batch_id: str):
    """The batch as the ingress reports it, or None while no ingress answers (restarting)."""
    try:
        return client.batches.retrieve(batch_id)
    except openai.APIError:
        return None


def _kill_ingress() -> None:
    ingress = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if f"{_app()}#OpenAIIngress" in a["name"]
    ]
    assert len(ingress) == 1, ingress
    ray.kill(ray.get_actor(ingress[0], namespace="serve"), no_restart=True)


def test_a_batch_survives_a_replica_kill_and_an_ingress_restart(failover_url):
    """The batch's state is on disk: lines in flight on a killed replica migrate, lines in flight
    in a killed ingress are run again by its successor, and each line is answered exactly once."""
    client = _batch_client(failover_url)
    upload = client.files.create(file=("in.jsonl", _batch_file()), purpose="batch")
    batch_id = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
    ).id
    asyncio.run(asyncio.wait_for(_kill_a_generating_replica(), 120))
    # Some lines answered after the replica's death, and some still to run: kill the ingress.
    assert wait_for(
        lambda: (b := _batch_status(client, batch_id)) and b.request_counts.completed >= 2,
        120,
        0.1,
    )
    _kill_ingress()
    batch = wait_for(
        lambda: (b := _batch_status(client, batch_id)) and b.status == "completed" and b, 240, 0.5
    )
    assert batch, _batch_status(client, batch_id)
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (BATCH_LINES, BATCH_LINES, 0)
    assert batch.error_file_id is None
    rows = [json.loads(r) for r in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in rows) == sorted(f"line-{i}" for i in range(BATCH_LINES))
    assert all(r["response"]["status_code"] == 200 for r in rows), rows
    _wait_replicas_running(2)
    _wait_running()


def _wait_running(timeout: float = 180) -> None:
    """Until the app reads RUNNING (judged on one status read: a kill the controller has not yet
    noticed can turn a RUNNING app UNHEALTHY between two reads)."""
    last: dict[str, str] = {}

    def running() -> bool:
        last["status"] = serve.status().applications[_app()].status
        return last["status"] == "RUNNING"

    assert wait_for(running, timeout, 0.1), last["status"]


def _wait_replicas_running(n: int, timeout: float = 180) -> None:
    """Until the app's LLMReplica deployment has exactly n replicas, all RUNNING (a failed one
    replaced)."""

    def states() -> dict:
        app = serve.status().applications.get(_app())
        return {} if app is None else dict(app.deployments["LLMReplica"].replica_states)

    wait_for(lambda: states() == {"RUNNING": n}, timeout, 0.1)
    assert states() == {"RUNNING": n}, states()


def _deploy(args: dict, fresh: bool = False) -> str:
    """Deploy args as the app (unless they are deployed), wait for its replicas, and return its
    URL. Serve replaces a deployment's replicas one at a time (rolling_update_percentage); fresh:
    a new app (its own name and route) instead, so that a new model or engine starts every replica
    at once, while the old app stops in the background (a blocking delete waited ~3 s for it)."""
    if DEPLOYED["args"] != args:
        if fresh:
            delete_app(_app())
            DEPLOYED["fresh"] += 1
            DEPLOYED["app"] = f"{APP}-{DEPLOYED['fresh']}"
        _run_app(args)
    _wait_replicas_running(args["num_replicas"])
    return _url()


def _redeploy(model_dir: str, **changes) -> str:
    return _deploy(app_args(model_dir, **changes), fresh=True)


def test_a_rolling_update_under_load_loses_no_request_and_spent_migrations_give_a_clean_503(
    failover_url, tiny_model_dir
):
    """Redeploy with a changed config while requests stream (the old replicas drain): every text is
    that of an undisturbed run. Then, with max_migrations 0, kill a replica: its requests end with
    a 503, the others complete."""

    undisturbed = _undisturbed(failover_url, "tp1")

    async def under_update() -> list[tuple[str, int]]:
        async with httpx.AsyncClient(base_url=failover_url, timeout=300) as client:
            events = [asyncio.Event() for _ in CASES]
            tasks = [
                asyncio.create_task(_stream(client, p, s, e)) for (p, s), e in zip(CASES, events)
            ]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 120)
            await asyncio.to_thread(_run_app, _spent_args(tiny_model_dir))
            return await asyncio.gather(*tasks)

    assert asyncio.run(under_update()) == undisturbed  # same text, every token counted once
    _wait_running()

    async def killed() -> list[int]:
        async with httpx.AsyncClient(base_url=failover_url, timeout=300) as client:
            body = _body("Once more:", {"temperature": 0.0}, stream=False)
            tasks = [asyncio.create_task(client.post("/completions", json=body)) for _ in range(6)]
            await _kill_a_generating_replica()
            responses = await asyncio.gather(*tasks)
        for r in responses:
            if r.status_code != 200:
                error = r.json()["error"]
                assert error["code"] == "replica_unavailable", error
                assert "Traceback" not in r.text and "ray::" not in r.text
        return [r.status_code for r in responses]

    statuses = asyncio.run(killed())
    assert set(statuses) <= {200, 503} and 503 in statuses, statuses
    # No wait for Serve to replace the killed replica (a replica start, ~10 s): that replacement
    # and the app serving on are test_killing_a_replica_mid_generation_loses_no_request's checks,
    # and the next test deploys its own app.


def _spent_args(model_dir: str) -> dict:
    """The rolling update's new version: no migrations left. Its replicas stop within 1 s: the
    replica Serve starts in place of the one the test kills is still starting when the next test
    deletes the app, and a replica stopped while it starts is killed only at
    graceful_shutdown_timeout_s (30 s by default: it would finish starting, two more processes'
    work beside the next app's start). The old version's replicas, which the update drains, keep
    their own timeout."""
    return app_args(model_dir, max_migrations=0, graceful_shutdown_timeout_s=1)


async def _run_one(url: str) -> tuple[str, int]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        return await _complete(client, "After the storm:", {"temperature": 0.0})


# Held back at every moment (no text contains it): a hand-back or a migration must carry it on.
HOLD = "<never in this text: it holds back 40 chars>"
LONG_TOKENS = 300
LONG_CASES = [
    (prompt, {**sampling, "max_tokens": LONG_TOKENS, "stop": [HOLD]}) for prompt, sampling in CASES
]


def _long_app_args(model_dir: str, num_replicas: int = 2) -> dict:
    """Generations that outlast graceful_shutdown_timeout_s: a stopped replica dies mid-stream.
    Migrations enough to outlast the seconds until routers learn a replica is draining."""
    return app_args(
        model_dir,
        max_model_len=2048,
        num_gpu_blocks=1024,
        graceful_shutdown_timeout_s=0.5,
        max_migrations=16,
        num_replicas=num_replicas,
        # Both replicas must stream when a fault strikes. The long cases share their template's
        # first block, so prefix affinity may keep all of them on one replica (within its load
        # ceiling), and the shut-down test's least-loaded pick would then find an idle replica.
        router_kwargs={"router_policy": "least_loaded"},
    )


def _deploy_long(model_dir: str, num_replicas: int = 2, fresh: bool = False) -> str:
    return _deploy(_long_app_args(model_dir, num_replicas), fresh)


def test_a_replica_shut_down_mid_stream_hands_back_every_character(
    failover_url, long_tiny_model_dir
):
    """Serve's shutdown hook (LLMReplica.shutdown, which Serve awaits only once a replica is idle)
    called while every case streams: the replica hands each request back with the tokens it held
    (stream_interval 3), the ingress sends the text those tokens complete, keeps what the stop
    string holds back, and resumes on the other replica (the drained one refuses requests until
    the routers learn it is draining). Every text is that of an undisturbed run."""
    # A new app, both replicas started at once (another model than the earlier tests'; a rolling
    # update would start them one at a time). The scale-down test goes on with it.
    url = _deploy_long(long_tiny_model_dir, fresh=True)
    undisturbed = _undisturbed(url, "long", LONG_CASES)

    async def shut_down_one() -> None:
        handle = serve.get_deployment_handle("LLMReplica", app_name=_app())
        # DeploymentHandle.shutdown is the handle's own; the router picks the less loaded replica.
        victim = await handle.options(method_name="shutdown").remote()
        assert victim["handed_back"] > 0, victim

    disturbed = asyncio.run(_run_cases(url, shut_down_one, LONG_CASES))
    for (prompt, _), calm, hit in zip(LONG_CASES, undisturbed, disturbed):
        assert hit == calm, prompt


def test_a_scale_down_mid_stream_keeps_every_character(failover_url, long_tiny_model_dir):
    """2 -> 1 replicas while every case streams. serve.run deploys a new version (the ingress's
    arguments changed too), so Serve stops both replicas and, past graceful_shutdown_timeout_s,
    kills them without calling their shutdown hook; each choice resumes on the new replica from
    the tokens it received. With stream_interval 3 (tokens held back at the replica) and a stop
    string that holds text back at the ingress, every text is that of an undisturbed run."""

    # The shut-down test's app: Serve has replaced the replica that shut down (a replica start,
    # where a fresh app would start two and an ingress).
    url = _deploy_long(long_tiny_model_dir)
    undisturbed = _undisturbed(url, "long", LONG_CASES)

    async def scale_down() -> None:
        args = _long_app_args(long_tiny_model_dir, num_replicas=1)
        await asyncio.to_thread(_run_app, args)

    disturbed = asyncio.run(_run_cases(url, scale_down, LONG_CASES))
    for (prompt, _), calm, hit in zip(LONG_CASES, undisturbed, disturbed):
        assert hit == calm, prompt  # every character, and usage counts every token once
    _wait_replicas_running(1)


def test_an_ingress_that_dies_leaves_no_orphan_generation(failover_url, long_tiny_model_dir):
    """Ray keeps running a dead caller's stream; the replica notices the dead ingress and aborts its
    generations (freeing their blocks) instead of running them to max_tokens."""
    # 2,000 tokens take the tiny model several seconds: the watchdog (1 s rounds) must win the race.
    # The scale-down test's final configuration: after it, no redeploy.
    url = _deploy_long(long_tiny_model_dir, num_replicas=1)
    handle = serve.get_deployment_handle("LLMReplica", app_name=_app())
    orphans_before: list[int] = []
    body = _body("A very long tale:", {"temperature": 0.0}, stream=True) | {"max_tokens": 2000}

    async def orphan() -> dict:
        # The replica may have served the scale-down test: its own count of orphans so far.
        orphans_before.append((await handle.stats.remote())["orphans_aborted"])
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            tasks = [asyncio.create_task(client.post("/completions", json=body)) for _ in range(4)]
            for _ in range(600):
                stats = await handle.stats.remote()
                if stats["num_running"] == 4:
                    break
                await asyncio.sleep(0.05)  # a bounded poll: the replica admits them in its process
            assert stats["num_running"] == 4, stats
            ingress = [
                a["name"]
                for a in ray.util.list_named_actors(all_namespaces=True)
                if f"{_app()}#OpenAIIngress" in a["name"]
            ]
            ray.kill(ray.get_actor(ingress[0], namespace="serve"), no_restart=True)
            # The streams end as soon as the watchdog finds the orphans; the engine thread applies
            # the aborts (and republishes its figures) once its step in progress ends.
            for _ in range(1200):
                stats = await handle.stats.remote()
                if stats["num_streams"] == 0 and stats["num_running"] == 0:
                    break
                await asyncio.sleep(0.05)
            await asyncio.gather(*tasks, return_exceptions=True)
            return stats

    stats = asyncio.run(asyncio.wait_for(orphan(), 240))  # a failure, never a hang of the suite
    assert stats["num_streams"] == 0 and stats["num_running"] == 0, stats
    # Aborted as orphans, not finished at max_tokens.
    assert stats["orphans_aborted"] - orphans_before[0] == 4, (stats, orphans_before)
    assert stats["kv_cache_usage"] == 0.0, stats
    # The replica serves on. Asked directly: Serve notices the dead ingress only at its next probe
    # (every 10 s) and then restarts it, and that restart serving is the batch test's check.
    assert asyncio.run(_replica_generates()) == MAX_TOKENS


async def _replica_generates() -> int:
    """The tokens one greedy request streams from the app's LLMReplica, through its handle."""
    handle = serve.get_deployment_handle("LLMReplica", app_name=_app())
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    request = EngineRequest("after-the-orphans", [1, 2, 3, 4, 5], params)
    tokens = 0
    async for out in handle.options(stream=True).generate.remote(request):
        tokens += len(out.new_token_ids)
    return tokens


def test_a_tp2_replica_whose_worker_dies_or_stalls_hands_its_requests_to_the_other(
    failover_url, tiny_model_dir
):
    """TP=2 replicas: a stopped worker hangs its step, the watchdog notices
    (engine_stall_timeout_s) and Serve replaces the replica; a killed worker fails the engine at
    once. Either way every request finishes elsewhere with the text of an undisturbed run."""
    # Last in the module: the replica Serve starts in place of the failed one competes with no
    # later test for the CPUs.
    url = _redeploy(
        tiny_model_dir,
        tensor_parallel_size=2,
        worker_num_cpus=0.5,
        engine_stall_timeout_s=3,
        # A replica that fails its health check has handed its requests on: its graceful stop
        # (which the waits for it to be gone sit through) has nothing to wait for.
        graceful_shutdown_timeout_s=1,
    )
    # Both replicas take their first step here (8 requests between them). The watchdog does not
    # time a replica's first step (it warms the kernels), so the stall comes first, before Serve
    # starts a replica that has not stepped: a worker stopped in such a replica's first step (the
    # stall after the kill, in the former order) hung its requests until step_timeout_s (300 s).
    undisturbed = asyncio.run(_run_cases(url, None))
    try:
        disturbed = asyncio.run(_run_cases(url, _stall_worker_fault))
        assert disturbed == undisturbed
        _wait_replica_gone(STALLED[0][0])  # its health check failed ...
    finally:
        for _, pid in STALLED:  # never leave a stopped process behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    _wait_replicas_running(2)  # ... and Serve replaced it
    disturbed = asyncio.run(_run_cases(url, _kill_worker_fault))
    assert disturbed == undisturbed
    _wait_replica_gone(KILLED[0])  # its engine failed: Serve is replacing it
