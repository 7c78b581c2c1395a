"""Serving metrics reach Ray's metrics export port: a replica's tagged by replica, and each
request's finish and latency as the ingress saw them."""

import re
import urllib.request

import httpx
import pytest
import ray

from tests.deploy.conftest import SMOL, replica_stats, wait_for

pytestmark = pytest.mark.slow

REPLICA_GAUGES = [
    "raylm_num_requests_waiting",
    "raylm_num_requests_running",
    "raylm_num_requests_swapped",
    "raylm_kv_cache_usage",
    "raylm_prefix_cache_hit_rate",
]
REPLICA_COUNTERS = ["raylm_prompt_tokens_total", "raylm_generation_tokens_total"]
REPLICA_HISTOGRAMS = ["raylm_ttft_seconds", "raylm_inter_token_seconds"]


def _scrape() -> str:
    port = ray._private.worker.global_worker.node.metrics_export_port
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def _total(text: str, name: str, **tags: str) -> float | None:
    """The sum of the series of ray_<name> that carry these tags (None when there is none)."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(f"ray_{name}{{") and all(f'{k}="{v}"' in line for k, v in tags.items())
    ]
    return sum(values) if values else None


def test_replica_metrics_carry_a_replica_tag_and_the_ingress_counts_each_finish(smol_url):
    before = _total(_scrape(), "raylm_requests_total", finish_reason="length") or 0.0
    r = httpx.post(
        f"{smol_url}/completions",
        timeout=120,
        json={"model": SMOL, "prompt": "Metrics, please.", "max_tokens": 4, "ignore_eos": True},
    )
    assert r.status_code == 200
    replica = replica_stats("raylm")["replica"]
    tagged = (
        REPLICA_GAUGES
        + REPLICA_COUNTERS
        + [f"{h}_{part}" for h in REPLICA_HISTOGRAMS for part in ("bucket", "count")]
    )

    def all_present():
        text = _scrape()
        by_replica = all(
            re.search(rf'^ray_{m}{{[^}}]*replica="{replica}"', text, re.M) for m in tagged
        )
        finished = (_total(text, "raylm_requests_total", finish_reason="length") or 0.0) > before
        e2e = _total(text, "raylm_e2e_seconds_count") or 0.0
        return text if by_replica and finished and e2e >= 1 else None

    text = wait_for(all_present, timeout=60, interval=1.0)
    assert text, [m for m in tagged if f"ray_{m}" not in _scrape()]
    # The ingress's series are its own: no replica could tell a stop string from a client gone.
    assert not re.search(r"^ray_raylm_requests_total{[^}]*replica=", text, re.M)


def test_every_finish_reason_exists_from_the_start_and_a_stop_string_counts_as_stop(smol_url):
    replica = replica_stats("raylm")["replica"]

    # Exported at zero before anything happened: panels read 0, not "No data".
    def exported_at_zero():
        t = _scrape()
        replica_zero = _total(t, "raylm_preemptions_total", replica=replica) is not None
        ingress_zero = _total(t, "raylm_requests_total", finish_reason="error") is not None
        return t if replica_zero and ingress_zero else None

    text = wait_for(exported_at_zero, timeout=60, interval=1.0)
    assert text
    stops = _total(text, "raylm_requests_total", finish_reason="stop") or 0.0
    aborts = _total(text, "raylm_requests_total", finish_reason="abort") or 0.0
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
            t if (_total(t, "raylm_requests_total", finish_reason="stop") or 0.0) > stops else None
        )

    text = wait_for(stop_counted, timeout=60, interval=1.0)
    assert text, "the stop-string finish was not counted as stop"
    # The ingress cancelled the replica's stream at the stop string: that is no abort.
    assert (_total(text, "raylm_requests_total", finish_reason="abort") or 0.0) == aborts
    assert _total(text, "raylm_requests_total", finish_reason="stop") == stops + 1


def test_a_client_that_goes_away_counts_as_abort(smol_url):
    aborts = _total(_scrape(), "raylm_requests_total", finish_reason="abort") or 0.0
    body = {
        "model": SMOL,
        "prompt": "Write a very long essay about the sea.",
        "max_tokens": 1000,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=120) as client,
        client.stream("POST", f"{smol_url}/completions", json=body) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break

    def abort_counted():
        t = _scrape()
        return (
            t
            if (_total(t, "raylm_requests_total", finish_reason="abort") or 0.0) > aborts
            else None
        )

    assert wait_for(abort_counted, timeout=60, interval=1.0), "the client's abort was not counted"
