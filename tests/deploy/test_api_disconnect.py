"""A client that goes away (or a stop string that ends a choice early) frees the replica's slot and
blocks."""

import httpx
import pytest

from tests.deploy.conftest import SMOL, replica_stats, wait_for

pytestmark = pytest.mark.slow


def _idle(stats: dict) -> bool:
    return stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["num_streams"] == 0


def _idle_stats() -> dict | None:
    stats = replica_stats("raylm")
    return stats if _idle(stats) else None


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(smol_url):
    assert wait_for(_idle_stats)
    before = replica_stats("raylm")
    body = {
        "model": SMOL,
        "prompt": "Write a very long essay about the sea.",
        "max_tokens": 1000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", f"{smol_url}/completions", json=body) as r:
            assert r.status_code == 200
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: ")
                if events == 5:
                    break
        during = replica_stats("raylm")
    assert during["num_running"] == 1 and during["kv_cache_usage"] > before["kv_cache_usage"]
    # Closed without reading on: the replica must abort the request and return its blocks.
    after = wait_for(_idle_stats)
    assert after, replica_stats("raylm")
    assert after["kv_cache_usage"] == before["kv_cache_usage"]


def test_stop_string_tells_the_replica_to_stop(smol_url):
    assert wait_for(_idle_stats)
    before = replica_stats("raylm")
    r = httpx.post(
        f"{smol_url}/completions",
        timeout=120,
        json={
            "model": SMOL,
            "prompt": "1, 2, 3, 4,",
            "max_tokens": 1000,
            "ignore_eos": True,
            "temperature": 0,
            "stop": [" 6"],
        },
    )
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert r.json()["usage"]["completion_tokens"] < 1000
    after = wait_for(_idle_stats)
    assert after and after["kv_cache_usage"] == before["kv_cache_usage"]


def test_a_request_past_its_deadline_is_aborted_and_frees_its_blocks(smol_url):
    before = replica_stats("raylm")
    r = httpx.post(
        f"{smol_url}/completions",
        timeout=120,
        json={
            "model": SMOL,
            "prompt": "Write a very long story.",
            "max_tokens": 1500,
            "ignore_eos": True,
            "request_timeout_s": 0.5,
        },
    )
    assert r.status_code == 408 and r.json()["error"]["type"] == "timeout"
    assert wait_for(lambda: _idle(replica_stats("raylm")), timeout=30)
    assert replica_stats("raylm")["kv_cache_usage"] <= before["kv_cache_usage"]
