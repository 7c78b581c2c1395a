"""The `llm` autoscaling policy on a real Serve app of two models (CPU, the tiny random Llama): a
burst on one model scales it from 1 to 2 replicas on its replicas' signals, and once the burst is
over back to 1, draining, while every request, those sent during the scale-down included,
completes in full; the other model in the same app keeps its one replica and answers every
request sent to it all along (a model's replicas are isolated from the other's, issue 37).

One app for both models, so the test pays for one ingress and one extra replica, not a second app.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import httpx
import pytest
from ray import serve

from tests.deploy.conftest import delete_app, wait_for

pytestmark = pytest.mark.slow

APP = "autoscale"
MODEL = "tiny-autoscale"
STEADY = "tiny-steady"  # the other model: one fixed replica, a light steady load
STEADY_PAUSE_S = 0.5
MAX_TOKENS = 48
logger = logging.getLogger(__name__)


def _args(model_dir: str) -> dict:
    return {
        "max_model_len": 256,
        "num_gpu_blocks": 128,
        "max_num_seqs": 4,
        "replica_num_cpus": 0.5,
        "ingress_num_cpus": 0.25,
        # A drained replica's requests (48 tokens) end within it, or resume elsewhere past it. A
        # replica the policy asked for and then cancels while it starts cannot drain: Serve stops
        # it only at this timeout (20 s here cost the scale-down phase 20 s).
        "graceful_shutdown_timeout_s": 3,
        "models": [
            {
                "name": MODEL,
                "model": model_dir,
                "autoscaling": {
                    "policy": "llm",
                    "min_replicas": 1,
                    "max_replicas": 2,
                    "upscale_delay_s": 0,
                    "downscale_delay_s": 2,
                    # Fast pushes and a short window, so the test takes seconds, not minutes.
                    "metrics_interval_s": 0.25,
                    "look_back_period_s": 1.0,
                    # Latency on a shared 2-core machine says nothing: only the batch signal may
                    # scale.
                    "slo": {"ttft_p90_s": 3600, "itl_p90_s": 3600},
                    # lead_s 0: no trend. This test proves the batch signal and the drain; the
                    # trend (which once asked for a replica again after the drain) has its own
                    # tests in tests/router/.
                    "targets": {"batch_fraction": 0.75, "slo_cooldown_s": 0, "lead_s": 0},
                },
            },
            {"name": STEADY, "model": model_dir, "num_replicas": 1},
        ],
    }


def _replicas(model: str) -> int:
    """The model's RUNNING replicas; -1 while any is in another state (starting, stopping)."""
    app = serve.status().applications.get(APP)
    deployment = None if app is None else app.deployments.get(f"LLMReplica-{model}")
    states = {} if deployment is None else dict(deployment.replica_states)
    return states.get("RUNNING", 0) if set(states) <= {"RUNNING"} else -1


class Watch:
    """Every replica count the steady model shows while the other one scales (polled with it)."""

    def __init__(self) -> None:
        self.seen: set[int] = set()

    def running(self) -> int:
        self.seen.add(_replicas(STEADY))
        return _replicas(MODEL)


async def _request(client: httpx.AsyncClient, model: str, i: int) -> int | str:
    """The completion's token count, or what went wrong (which the test's final check shows)."""
    body = {
        "model": model,
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


async def _load(
    url: str,
    model: str,
    concurrency: int,
    stop: threading.Event,
    done: list[int | str],
    pause_s: float,
) -> None:
    """`concurrency` clients, each sending requests `pause_s` apart until stop is set."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def worker(k: int) -> None:
            i = 0
            while not stop.is_set():
                done.append(await _request(client, model, k * 10_000 + i))
                i += 1
                await asyncio.sleep(pause_s)

        await asyncio.gather(*(worker(k) for k in range(concurrency)))


def _in_background(
    url: str, model: str, concurrency: int, done: list[int | str], pause_s: float = 0.0
) -> tuple[threading.Event, threading.Thread]:
    stop = threading.Event()
    thread = threading.Thread(
        target=lambda: asyncio.run(_load(url, model, concurrency, stop, done, pause_s))
    )
    thread.start()
    return stop, thread


def _phase(url: str, clients: int, want: int, watch: Watch) -> tuple[bool, list[int | str]]:
    """`clients` clients on the scaled model until it runs `want` replicas (or 90 s pass: a bound
    for a 2-core machine shared with other test runs; a quiet one takes seconds)."""
    done: list[int | str] = []
    stop, thread = _in_background(url, MODEL, clients, done)
    try:
        reached = wait_for(lambda: watch.running() == want, 90, 0.25)
    finally:
        stop.set()
        thread.join(timeout=120)
    return reached, done


def test_a_burst_scales_one_model_to_two_replicas_and_back_leaving_the_other_alone(
    ray_cluster, http_port, tiny_model_dir
):
    from deploy.app import build_app

    t0 = time.monotonic()
    serve.run(build_app(_args(tiny_model_dir)), name=APP, route_prefix=f"/{APP}")
    url = f"http://127.0.0.1:{http_port}/{APP}/v1"
    try:
        assert wait_for(lambda: _replicas(MODEL) == _replicas(STEADY) == 1, 120, 0.25)
        logger.info("deployed with 1 + 1 replicas after %.1f s", time.monotonic() - t0)
        watch = Watch()
        # One client on the other model through both phases. A pause between its requests keeps
        # the load light: back to back, its replica's engine never rested and took CPU from the
        # new replica's start on a 2-core machine.
        steady: list[int | str] = []
        stop_steady, steady_thread = _in_background(url, STEADY, 1, steady, pause_s=STEADY_PAUSE_S)
        try:
            # 12 clients against max_num_seqs 4: (running + waiting) / 4 / 0.75 asks for 4
            # replicas, capped at 2.
            scaled_up, burst = _phase(url, 12, 2, watch)
            assert scaled_up, f"still {_replicas(MODEL)} replicas under the burst"
            logger.info("2 replicas after %.1f s (%d requests)", time.monotonic() - t0, len(burst))
            # One client after the burst: the load fits in one replica with headroom, so the
            # policy drains one while this client's requests keep arriving.
            scaled_down, trickle = _phase(url, 1, 1, watch)
            assert scaled_down, f"still {_replicas(MODEL)} replicas after the burst"
            logger.info("1 replica after %.1f s (%d requests)", time.monotonic() - t0, len(trickle))
        finally:
            stop_steady.set()
            steady_thread.join(timeout=120)
        assert burst and trickle and steady
        assert set(burst) | set(trickle) == {MAX_TOKENS}  # every request complete, none lost
        assert set(steady) == {MAX_TOKENS}  # the other model answered every request ...
        assert watch.seen == {1}, watch.seen  # ... with its one replica all along
        assert _replicas(STEADY) == 1
    finally:
        delete_app(APP)
