"""The `llm` autoscaling policy on a real Serve app (CPU, the tiny random Llama): a burst scales the
model from 1 to 2 replicas on its replicas' signals, and once the burst is over back to 1, draining,
while every request, those sent during the scale-down included, completes in full.

One model only: an app serves one model until several models per app land (issue 37, item 1).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import httpx
import pytest
from ray import serve

from tests.deploy.conftest import wait_for

pytestmark = pytest.mark.slow

APP = "autoscale"
MODEL = "tiny-autoscale"
MAX_TOKENS = 48
logger = logging.getLogger(__name__)


def _args(model_dir: str) -> dict:
    return {
        "model": model_dir,
        "served_model_name": MODEL,
        "max_model_len": 256,
        "num_gpu_blocks": 128,
        "max_num_seqs": 4,
        "replica_num_cpus": 0.5,
        "ingress_num_cpus": 0.25,
        "graceful_shutdown_timeout_s": 20,
        "autoscaling": {
            "policy": "llm",
            "min_replicas": 1,
            "max_replicas": 2,
            "upscale_delay_s": 0,
            "downscale_delay_s": 2,
            # Fast pushes and a short window, so the test takes seconds, not minutes.
            "metrics_interval_s": 0.25,
            "look_back_period_s": 1.0,
            # Latency on a shared 2-core machine says nothing: only the batch signal may scale.
            "slo": {"ttft_p90_s": 3600, "itl_p90_s": 3600},
            "targets": {"batch_fraction": 0.75, "slo_cooldown_s": 0},
        },
    }


def _running() -> int:
    app = serve.status().applications.get(APP)
    states = {} if app is None else dict(app.deployments["LLMReplica"].replica_states)
    return states.get("RUNNING", 0) if set(states) <= {"RUNNING"} else -1


async def _request(client: httpx.AsyncClient, i: int) -> int | str:
    """The completion's token count, or what went wrong (which the test's final check shows)."""
    body = {
        "model": MODEL,
        "prompt": f"Request {i}:",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    try:
        r = await client.post("/completions", json=body)
    except httpx.HTTPError as exc:
        return repr(exc)
    return r.json()["usage"]["completion_tokens"] if r.status_code == 200 else r.text


async def _load(url: str, concurrency: int, stop: threading.Event, done: list[int | str]) -> None:
    """`concurrency` clients, each sending requests back to back until stop is set."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def worker(k: int) -> None:
            i = 0
            while not stop.is_set():
                done.append(await _request(client, k * 10_000 + i))
                i += 1

        await asyncio.gather(*(worker(k) for k in range(concurrency)))


def _in_background(
    url: str, concurrency: int, done: list[int | str]
) -> tuple[threading.Event, threading.Thread]:
    stop = threading.Event()
    thread = threading.Thread(target=lambda: asyncio.run(_load(url, concurrency, stop, done)))
    thread.start()
    return stop, thread


def test_a_burst_scales_one_to_two_replicas_and_back_losing_no_request(
    ray_cluster, http_port, tiny_model_dir
):
    from deploy.app import build_app

    t0 = time.monotonic()
    serve.run(build_app(_args(tiny_model_dir)), name=APP, route_prefix=f"/{APP}")
    url = f"http://127.0.0.1:{http_port}/{APP}/v1"
    try:
        assert wait_for(lambda: _running() == 1, 60, 0.25), _running()
        logger.info("deployed with 1 replica after %.1f s", time.monotonic() - t0)
        burst: list[int | str] = []
        # 12 clients against max_num_seqs 4: (running + waiting) / 4 / 0.75 asks for 4 replicas,
        # capped at 2.
        stop, thread = _in_background(url, 12, burst)
        try:
            scaled_up = wait_for(lambda: _running() == 2, 40, 0.25)
        finally:
            stop.set()
            thread.join(timeout=120)
        assert scaled_up, f"still {_running()} replicas under the burst"
        logger.info("2 replicas after %.1f s (%d requests)", time.monotonic() - t0, len(burst))
        # One client after the burst: the load fits in one replica with headroom, so the policy
        # drains one while this client's requests keep arriving.
        trickle: list[int | str] = []
        stop, thread = _in_background(url, 1, trickle)
        try:
            scaled_down = wait_for(lambda: _running() == 1, 40, 0.25)
        finally:
            stop.set()
            thread.join(timeout=120)
        assert scaled_down, f"still {_running()} replicas after the burst"
        logger.info("1 replica after %.1f s (%d requests)", time.monotonic() - t0, len(trickle))
        assert burst and trickle
        assert set(burst) | set(trickle) == {MAX_TOKENS}  # every request complete, none lost
    finally:
        serve.delete(APP)
