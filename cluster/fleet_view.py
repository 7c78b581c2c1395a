"""The replicas' latest reports as the fleet routers of this process hold them.

The ingress's /metrics page shows them, so a scraper sees the replicas' queues and KV usage on the
HTTP port without reaching Ray's per-node metrics ports. Like cluster/outcomes.py, this module
must stay importable by reference: Serve ships the router class by value.
"""

from __future__ import annotations

import weakref
from typing import Protocol

from router.stats import RoutingStats


class FleetSource(Protocol):
    def replica_reports(self) -> dict[str, RoutingStats]: ...

    def replica_ids(self) -> set[str]: ...

    def deployment_name(self) -> str: ...


# Held weakly: Serve owns the routers.
_SOURCES: weakref.WeakSet[FleetSource] = weakref.WeakSet()


def register(source: FleetSource) -> None:
    """Let replica_reports() read source's reports (a router of this process)."""
    _SOURCES.add(source)


def replica_reports(deployment: str | None = None) -> dict[str, RoutingStats]:
    """Each replica's latest report known in this process (empty under Serve's own router); of
    one deployment's replicas only when `deployment` names it."""
    reports: dict[str, RoutingStats] = {}
    for source in list(_SOURCES):
        if deployment is not None and source.deployment_name() != deployment:
            continue
        try:
            reports.update(source.replica_reports())
        except RuntimeError:  # changed while copied on the router's thread: next scrape has it
            continue
    return reports


def replica_ids(deployment: str) -> set[str]:
    """The running replicas of `deployment` the routers of this process know (empty under Serve's
    own router): where a run-time adapter change must go (cluster/lora_admin.py)."""
    ids: set[str] = set()
    for source in list(_SOURCES):
        if source.deployment_name() != deployment:  # another model's replicas
            continue
        try:
            ids |= source.replica_ids()
        except RuntimeError:  # changed while copied on the router's thread
            continue
    return ids
