"""Fleet simulator: the production Scheduler and routing policies driven by a cost model.

Pure Python: imports scheduler/ and the routing policies, never torch or Ray.
"""

from sim.cost import CostModel, load_profile
from sim.fleet import FleetSim, SimResult
from sim.fleet_config import HostConfig, SimConfig
from sim.workload import SimRequest, WorkloadConfig, load_trace, synthetic_workload

__all__ = [
    "CostModel",
    "FleetSim",
    "HostConfig",
    "SimConfig",
    "SimRequest",
    "SimResult",
    "WorkloadConfig",
    "load_profile",
    "load_trace",
    "synthetic_workload",
]
