"""The /metrics page as one caller sees it: the ingress picks the models and replicas; the page
shows of the replicas' adapters only those the caller may use (a key scoped by `loras`)."""

from cluster.metrics import RequestMetrics
from deploy.metrics_page import render
from router.stats import RoutingStats
from scheduler.outputs import SchedulerStats

REPORTS = {
    "r1": RoutingStats(SchedulerStats(0, 0, 0, 0.0, 0.0, 0, loaded_loras=("a", "b", "c"))),
    "r2": RoutingStats(SchedulerStats(0, 0, 0, 0.0, 0.0, 0, loaded_loras=("c",))),
}


def test_a_key_scoped_to_some_adapters_sees_only_those():
    page = render([RequestMetrics("m")], REPORTS, 0, loras=["b"])
    assert 'raylm_lora_adapter_loaded{replica="r1",lora="b"} 1' in page
    assert 'lora="a"' not in page and 'lora="c"' not in page
    assert 'raylm_lora_adapters_loaded{replica="r1"} 1' in page  # of its adapters, not all
    assert 'raylm_lora_adapters_loaded{replica="r2"} 0' in page


def test_without_a_scope_every_adapter_is_shown():
    page = render([RequestMetrics("m")], REPORTS, 3)
    for lora in "abc":
        assert f'raylm_lora_adapter_loaded{{replica="r1",lora="{lora}"}} 1' in page
    assert 'raylm_lora_adapters_loaded{replica="r1"} 3' in page
    assert "raylm_ingress_requests_in_flight 3" in page
