"""The production routing policies and the replicas' report format; the one place sim/ names their modules."""
from cluster.protocol import RoutingStats
from cluster.routing_policies import POLICIES, FleetState, RouteRequest, RoutingConfig

__all__ = ["POLICIES", "FleetState", "RouteRequest", "RoutingConfig", "RoutingStats"]
