"""The production routing policies; the one place sim/ names their module."""
from cluster.routing_policies import POLICIES, FleetState, RouteRequest, RoutingConfig

__all__ = ["POLICIES", "FleetState", "RouteRequest", "RoutingConfig"]
