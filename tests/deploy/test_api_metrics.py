"""Replica metrics reach Ray's metrics export port, tagged by replica."""
import re
import urllib.request

import httpx
import pytest
import ray

from tests.deploy.conftest import SMOL, replica_stats, wait_for

pytestmark = pytest.mark.slow

GAUGES = ["raylm_num_requests_waiting", "raylm_num_requests_running", "raylm_num_requests_swapped",
          "raylm_kv_cache_usage", "raylm_prefix_cache_hit_rate"]
COUNTERS = ["raylm_prompt_tokens_total", "raylm_generation_tokens_total", "raylm_requests_total"]
HISTOGRAMS = ["raylm_ttft_seconds", "raylm_inter_token_seconds", "raylm_e2e_seconds"]


def _scrape() -> str:
    port = ray._private.worker.global_worker.node.metrics_export_port
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def test_replica_metrics_are_exported_with_a_replica_tag(smol_url):
    r = httpx.post(f"{smol_url}/completions", timeout=120,
                   json={"model": SMOL, "prompt": "Metrics, please.", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200
    replica = replica_stats("raylm")["replica"]
    wanted = GAUGES + COUNTERS + [f"{h}_bucket" for h in HISTOGRAMS] + [f"{h}_count" for h in HISTOGRAMS]

    def length_finishes(text: str) -> float:
        lines = [line for line in text.splitlines() if line.startswith("ray_raylm_requests_total{")
                 and f'replica="{replica}"' in line and 'finish_reason="length"' in line]
        return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0

    def all_present():
        text = _scrape()
        tagged = all(re.search(rf'^ray_{m}{{[^}}]*replica="{replica}"', text, re.M) for m in wanted)
        return text if tagged and length_finishes(text) >= 1 else None

    text = wait_for(all_present, timeout=60, interval=1.0)
    assert text, [m for m in wanted if f"ray_{m}" not in _scrape()]
