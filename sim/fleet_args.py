"""The command line's fleet flags (each replica's scheduler, the router) and the scheduler config
they describe: declared and read here once for `python -m sim run|plan` (sim/__main__.py) and the
autoscaled day (`plan --autoscale`, sim/autoscale_plan.py)."""

from __future__ import annotations

import argparse

from router.config import POLICIES
from scheduler import SchedulerConfig
from scheduler.config import POLICIES as QUEUE_POLICIES
from sim.fleet_config import SIM_NUM_GPU_BLOCKS, SimConfig

# The command line's defaults are the configs' own.
_SCHEDULER = SchedulerConfig()
_SIM = SimConfig()


def add_fleet_arguments(p: argparse.ArgumentParser) -> None:
    """Each replica's scheduler (the production defaults) and the router."""
    p.add_argument("--router", choices=POLICIES, nargs="+", default=["prefix_affinity"])
    p.add_argument("--policy", choices=QUEUE_POLICIES, default=_SCHEDULER.policy)
    p.add_argument("--blocks", type=int, default=SIM_NUM_GPU_BLOCKS, help="KV blocks per replica")
    p.add_argument("--block-size", type=int, default=_SCHEDULER.block_size, help="tokens per block")
    p.add_argument("--max-num-seqs", type=int, default=_SCHEDULER.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=_SCHEDULER.max_num_batched_tokens)
    p.add_argument(
        "--stats-delay",
        type=float,
        default=_SIM.stats_delay_s,
        help="seconds a replica's report takes to reach the router",
    )


def replica_scheduler(a: argparse.Namespace, max_model_len: int) -> SchedulerConfig:
    """Each replica's scheduler as the flags describe it; the caller's context length (a fixed
    fleet's is capped where its workload needs no more, a day's long documents need the pool)."""
    return SchedulerConfig(
        num_gpu_blocks=a.blocks,
        block_size=a.block_size,
        max_num_seqs=a.max_num_seqs,
        policy=a.policy,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_model_len=max_model_len,
    )
