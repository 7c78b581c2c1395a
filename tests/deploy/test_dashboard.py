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
    # A histogram is read through its _bucket series.
    missing = {m for m in used if m not in exported and m.removesuffix("_bucket") not in exported}
    assert not missing, missing


def test_per_model_autoscaling_panels():
    dashboard = json.loads(DASHBOARD.read_text())
    titles = {p["title"] for p in dashboard["panels"]}
    assert {
        "Replicas over time, per model",
        "Scale decisions by reason, per model",
        "SLO attainment, per model",
    } <= titles
    assert "model" in {v["name"] for v in dashboard["templating"]["list"]}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
