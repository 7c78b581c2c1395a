"""A replica killed mid-generation loses no request: each choice resumes on the other replica and
the client sees one uninterrupted stream with the same text as an undisturbed run (greedy and seeded)."""
import asyncio
import json
import time

import httpx
import pytest
import ray
from ray import serve

pytestmark = pytest.mark.slow

APP = "failover"
MODEL = "tiny-failover"
MAX_TOKENS = 200
# (prompt, sampling): greedy ones and seeded temperature sampling, which must resume exactly too.
CASES = [(f"Story number {i}:", {"temperature": 0.0}) for i in range(4)] + \
        [(f"Poem number {i}:", {"temperature": 0.9, "seed": 100 + i}) for i in range(4)]


def app_args(model_dir: str, **changes) -> dict:
    return {"model": model_dir, "served_model_name": MODEL, "max_model_len": 256, "num_gpu_blocks": 128,
            "num_replicas": 2, "replica_num_cpus": 0.5, "ingress_num_cpus": 0.25, "max_ongoing_requests": 16,
            **changes}


@pytest.fixture(scope="module")
def failover_url(ray_cluster, http_port, tiny_model_dir):
    from deploy.app import build_app

    serve.run(build_app(app_args(tiny_model_dir)), name=APP, route_prefix=f"/{APP}")
    yield f"http://127.0.0.1:{http_port}/{APP}/v1"
    serve.delete(APP)


def _body(prompt: str, sampling: dict, stream: bool) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": stream,
            **sampling}


async def _complete(client: httpx.AsyncClient, prompt: str, sampling: dict) -> tuple[str, int]:
    r = await client.post("/completions", json=_body(prompt, sampling, stream=False))
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["completion_tokens"]


async def _stream(client: httpx.AsyncClient, prompt: str, sampling: dict, started: asyncio.Event) -> tuple[str, int]:
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
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if f"{APP}#LLMReplica" in a["name"]]
    assert len(names) == 2, names
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    return names[0]


def test_killing_a_replica_mid_generation_loses_no_request(failover_url):
    async def run(kill: bool) -> list[tuple[str, int]]:
        async with httpx.AsyncClient(base_url=failover_url, timeout=300) as client:
            events = [asyncio.Event() for _ in CASES]
            tasks = [asyncio.create_task(_stream(client, p, s, e) if i % 2 else _complete(client, p, s))
                     for i, ((p, s), e) in enumerate(zip(CASES, events))]
            if kill:
                await asyncio.wait_for(asyncio.gather(*(e.wait() for i, e in enumerate(events) if i % 2)), 120)
                in_flight = sum(not t.done() for t in tasks)
                _kill_one_replica()
                assert in_flight == len(CASES), "the kill must land while every request is generating"
            return await asyncio.gather(*tasks)

    undisturbed = asyncio.run(run(kill=False))
    disturbed = asyncio.run(run(kill=True))
    for (prompt, _), calm, hit in zip(CASES, undisturbed, disturbed):
        assert hit == calm, prompt  # same text, and usage counts every token exactly once
        assert hit[1] == MAX_TOKENS
    # Serve replaces the dead replica; the app keeps serving.
    deadline = time.monotonic() + 120
    while serve.status().applications[APP].status != "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert asyncio.run(_run_one(failover_url))[1] == MAX_TOKENS


def _wait_running(timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while serve.status().applications[APP].status != "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert serve.status().applications[APP].status == "RUNNING"


def test_a_rolling_update_under_load_loses_no_request_and_spent_migrations_give_a_clean_503(
        failover_url, tiny_model_dir):
    """Redeploy with a changed config while requests stream (the old replicas drain), then, with
    max_migrations 0, kill a replica: its requests end with a 503, the others complete."""
    from deploy.app import build_app

    async def under_update() -> list[tuple[str, int]]:
        async with httpx.AsyncClient(base_url=failover_url, timeout=300) as client:
            events = [asyncio.Event() for _ in CASES]
            tasks = [asyncio.create_task(_stream(client, p, s, e)) for (p, s), e in zip(CASES, events)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 120)
            await asyncio.to_thread(serve.run, build_app(app_args(tiny_model_dir, max_migrations=0)), name=APP,
                                    route_prefix=f"/{APP}", blocking=False)
            return await asyncio.gather(*tasks)

    for result in asyncio.run(under_update()):
        assert result[1] == MAX_TOKENS
    _wait_running()

    async def killed() -> list[int]:
        async with httpx.AsyncClient(base_url=failover_url, timeout=300) as client:
            body = _body("Once more:", {"temperature": 0.0}, stream=False)
            tasks = [asyncio.create_task(client.post("/completions", json=body)) for _ in range(6)]
            await asyncio.sleep(1.0)  # every request is generating (200 tokens take several seconds)
            _kill_one_replica()
            responses = await asyncio.gather(*tasks)
        for r in responses:
            if r.status_code != 200:
                error = r.json()["error"]
                assert error["code"] == "replica_unavailable", error
                assert "Traceback" not in r.text and "ray::" not in r.text
        return [r.status_code for r in responses]

    statuses = asyncio.run(killed())
    assert set(statuses) <= {200, 503} and 503 in statuses, statuses
    _wait_running()
    assert asyncio.run(_run_one(failover_url))[1] == MAX_TOKENS


async def _run_one(url: str) -> tuple[str, int]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        return await _complete(client, "After the storm:", {"temperature": 0.0})
