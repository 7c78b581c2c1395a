"""Replica metrics reach Ray's metrics export port, tagged by replica."""

import re
import urllib.request

import httpx
import pytest
import ray

from tests.deploy.conftest import SMOL, replica_stats, wait_for

pytestmark = pytest.mark.slow

GAUGES = [
    "raylm_num_requests_waiting",
    "raylm_num_requests_running",
    "raylm_num_requests_swapped",
    "raylm_kv_cache_usage",
    "raylm_prefix_cache_hit_rate",
]
COUNTERS = ["raylm_prompt_tokens_total", "raylm_generation_tokens_total", "raylm_requests_total"]
HISTOGRAMS = ["raylm_ttft_seconds", "raylm_inter_token_seconds", "raylm_e2e_seconds"]


def _scrape() -> str:
    port = ray._private.worker.global_worker.node.metrics_export_port
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def test_replica_metrics_are_exported_with_a_replica_tag(smol_url):
    r = httpx.post(
        f"{smol_url}/completions",
        timeout=120,
        json={"model": SMOL, "prompt": "Metrics, please.", "max_tokens": 4, "ignore_eos": True},
    )
    assert r.status_code == 200
    replica = replica_stats("raylm")["replica"]
    wanted = (
        GAUGES + COUNTERS + [f"{h}_bucket" for h in HISTOGRAMS] + [f"{h}_count" for h in HISTOGRAMS]
    )

    def length_finishes(text: str) -> float:
        lines = [
            line
            for line in text.splitlines()
            if line.startswith("ray_raylm_requests_total{")
            and f'replica="{replica}"' in line
            and 'finish_reason="length"' in line
        ]
        return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0

    def all_present():
        text = _scrape()
        tagged = all(re.search(rf'^ray_{m}{{[^}}]*replica="{replica}"', text, re.M) for m in wanted)
        return text if tagged and length_finishes(text) >= 1 else None

    text = wait_for(all_present, timeout=60, interval=1.0)
    assert text, [m for m in wanted if f"ray_{m}" not in _scrape()]


def _series(text: str, name: str, replica: str, **tags: str) -> float | None:
    for line in text.splitlines():
        if (
            line.startswith(f"ray_{name}{{")
            and f'replica="{replica}"' in line
            and all(f'{k}="{v}"' in line for k, v in tags.items())
        ):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_every_counter_exists_from_the_start_and_a_stop_string_finish_counts_as_stop(smol_url):
    replica = replica_stats("raylm")["replica"]

    # Exported at zero before anything happened: panels read 0, not "No data".
    def exported_at_zero():
        t = _scrape()
        return t if _series(t, "raylm_preemptions_total", replica) is not None else None

    text = wait_for(exported_at_zero, timeout=60, interval=1.0)
    assert (
        text and _series(text, "raylm_requests_total", replica, finish_reason="error") is not None
    )
    before = _series(text, "raylm_requests_total", replica, finish_reason="stop") or 0.0
    aborts = _series(text, "raylm_requests_total", replica, finish_reason="abort") or 0.0
    r = httpx.post(
        f"{smol_url}/completions",
        timeout=120,
        json={
            "model": SMOL,
            "prompt": "Count: one, two, three, four,",
            "max_tokens": 40,
            "temperature": 0,
            "ignore_eos": True,
            "stop": [","],
        },
    )
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"

    def stop_counted():
        t = _scrape()
        return (
            t
            if (_series(t, "raylm_requests_total", replica, finish_reason="stop") or 0.0) > before
            else None
        )

    text = wait_for(stop_counted, timeout=60, interval=1.0)
    assert text, "the stop-string finish was not counted as stop"
    assert (_series(text, "raylm_requests_total", replica, finish_reason="abort") or 0.0) == aborts
