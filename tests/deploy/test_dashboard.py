"""The Grafana dashboard reads only metrics that the code exports, and has the per-model
autoscaling panels."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "raylm.json"


def exported_metrics() -> set[str]:
    """Every raylm_* metric name declared in cluster/ (Ray exports each as ray_<name>)."""
    names = set()
    for path in (ROOT / "cluster").glob("*.py"):
        names.update(re.findall(r'"(raylm_[a-z0-9_]+)"', path.read_text()))
    return names


def test_every_dashboard_metric_is_exported():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    used = {m for e in exprs for m in re.findall(r"ray_(raylm_[a-z0-9_]+)", e)}
    exported = exported_metrics()
    # A histogram is read through its _bucket, _sum and _count series.
    missing = {m for m in used if m not in exported and _histogram_of(m) not in exported}
    assert not missing, missing


def _histogram_of(series: str) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        series = series.removesuffix(suffix)
    return series


def test_per_model_autoscaling_panels():
    dashboard = json.loads(DASHBOARD.read_text())
    titles = {p["title"] for p in dashboard["panels"]}
    assert {
        "Replicas over time, per model",
        "Scale decisions by reason, per model",
        "SLO attainment, per model",
        "Cold-start duration by phase, per model",
        "LoRA requests by adapter, per model",
    } <= titles
    assert "model" in {v["name"] for v in dashboard["templating"]["list"]}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    # Each per-model panel follows the model selector and keeps the models apart.
    for panel in dashboard["panels"]:
        if panel["title"].endswith(", per model"):
            for target in panel["targets"]:
                assert 'model=~"$model"' in target["expr"], panel["title"]
                assert "by (model" in target["expr"], panel["title"]


def test_every_per_model_metric_is_tagged_by_model():
    """The metrics the per-model panels read carry the model tag, as their objects declare it
    (ray.util.metrics objects are built without a Ray cluster; nothing is recorded here)."""
    from ray.util.metrics import Metric

    from cluster.autoscaling_policy import AutoscalingMetrics
    from cluster.cold_start import ColdStart
    from cluster.lora_metrics import LoraMetrics
    from cluster.metrics import ReplicaMetrics, RequestMetrics

    owners = [
        AutoscalingMetrics("m"),
        ColdStart("m", "r"),
        LoraMetrics("r", "m"),
        ReplicaMetrics("r", "m"),
        RequestMetrics("m"),
    ]
    tags = {}
    for owner in owners:
        for name in getattr(owner, "__slots__", ()) or vars(owner):
            metric = getattr(owner, name)
            if isinstance(metric, Metric):
                tags[metric._name] = metric._tag_keys
    dashboard = json.loads(DASHBOARD.read_text())
    per_model = {
        _histogram_of(m)
        for p in dashboard["panels"]
        if p["title"].endswith(", per model")
        for t in p["targets"]
        for m in re.findall(r"ray_(raylm_[a-z0-9_]+)", t["expr"])
    }
    assert per_model <= set(tags), per_model - set(tags)
    assert all("model" in tags[m] for m in per_model), {m: tags[m] for m in per_model}
    assert all("model" in keys for name, keys in tags.items() if name.startswith("raylm_lora"))
