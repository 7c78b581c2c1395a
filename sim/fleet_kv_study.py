"""The fleet as one KV cache on an agent trace: today's router against the exact index from KV
events, then peer-to-peer pulls, then sessions, at several fleet sizes (issue 52).

    python -m sim agents --replicas 8 64 512 --jobs 1

Each fleet size gets the same trace per replica (`--contexts-per-replica` contexts, sim/agents.py)
and runs it four ways, the router being the production `FleetState` with prefix affinity:
- `today`: the approximate prefix index (routing's plants, the replicas' periodic prefix reports);
- `events`: the replicas publish KV events (reports and each last output), the exact index;
- `pulls`: `events` with `peer_pulls` on (a spilled request pulls its prefix from a peer);
- `sessions`: `pulls` with each request naming its session (a fork's turns keep to their replica).
Prints TTFT p50 / p90, the prompt tokens the fleet computed and pulled, the prefix hit rate, the
pulls made, declined and failed, the requests that joined a pull in flight to their replica,
and per size the TTFT p90 of `events` (recomputing) over `pulls`.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from router.config import RoutingConfig
from scheduler import SchedulerConfig
from sim.agents import AgentConfig, agent_workload
from sim.cost import CostModel, load_profile
from sim.fleet_config import SimConfig
from sim.fleet_kv import PULL_LATENCY_S, FleetKVConfig, KVFleetSim
from sim.kv_copy import LinkConfig

MODES = ("today", "events", "pulls", "sessions")
_AGENTS = AgentConfig()  # the command line's defaults are the workload's own
MAX_REPLICAS = 1 << 16


@dataclass(frozen=True, slots=True)
class Run:
    """One fleet size and mode of the study, with everything a worker process needs."""

    replicas: int
    mode: str
    agents: AgentConfig
    profile: str
    blocks: int
    link: LinkConfig


def prefill_tokens_per_s(cost: CostModel, chunk: int) -> float:
    """What a replica of this profile prefills a second, in chunks of `chunk` tokens from an empty
    cache: the pulling replica's figure in the pull cost model (a served replica's is measured)."""
    return chunk / cost.step_time(chunk, 0, 0, 1, chunk * (chunk + 1) // 2)


def sim_config(run: Run, cost: CostModel) -> SimConfig:
    scheduler = SchedulerConfig(
        num_gpu_blocks=run.blocks, max_model_len=min(1 << 15, run.blocks * 16)
    )
    routing = RoutingConfig(
        router_policy="prefix_affinity",
        seed=0,
        peer_pulls=run.mode in ("pulls", "sessions"),
        pull_bytes_per_s=run.link.bandwidth_bytes_per_s,
        pull_fixed_s=run.link.latency_s,
        prefill_tokens_per_s=prefill_tokens_per_s(cost, scheduler.max_num_batched_tokens),
    )
    return SimConfig(num_replicas=run.replicas, scheduler=scheduler, routing=routing)


def simulate(run: Run) -> dict[str, Any]:
    """One row of the table."""
    cost = load_profile(run.profile)
    workload = agent_workload(run.agents)
    kv = FleetKVConfig(
        kv_events=run.mode != "today", sessions=run.mode == "sessions", pull_link=run.link
    )
    t0 = time.perf_counter()
    sim = KVFleetSim(sim_config(run, cost), cost, kv)
    summary = sim.run(workload).summary()
    bs = sim.config.scheduler.block_size
    return {
        "replicas": run.replicas,
        "router": run.mode,
        "requests": summary["requests"],
        "ttft_p50_s": summary["ttft_p50_s"],
        "ttft_p90_s": summary["ttft_p90_s"],
        "prefill_tokens": sim.prefill_tokens(),
        "pulled_tokens": sim.pulls.blocks * bs,
        "loaded_tokens": sim.loaded_blocks() * bs,
        "hit_rate": summary["hit_rate"],
        "pulls": sim.pulls.pulled,
        "declined": sim.pulls.declined,
        "failed": sim.pulls.failed,
        "joined": sim.pulls.joined,
        "wall_s": time.perf_counter() - t0,
    }


COLUMNS = (
    "replicas",
    "router",
    "requests",
    "ttft_p50_s",
    "ttft_p90_s",
    "prefill_tokens",
    "pulled_tokens",
    "loaded_tokens",
    "hit_rate",
    "pulls",
    "declined",
    "failed",
    "joined",
    "wall_s",
)


def print_header() -> None:
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + " --- |" * len(COLUMNS), flush=True)


def print_row(row: dict[str, Any]) -> None:
    cells = [f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c]) for c in COLUMNS]
    print("| " + " | ".join(cells) + " |", flush=True)


def print_ratios(rows: list[dict[str, Any]]) -> None:
    """Per size, TTFT p90 recomputing (events) over pulling (pulls)."""
    for n in dict.fromkeys(r["replicas"] for r in rows):
        by = {r["router"]: r for r in rows if r["replicas"] == n}
        if "events" in by and "pulls" in by and by["pulls"]["ttft_p90_s"] > 0:
            ratio = by["events"]["ttft_p90_s"] / by["pulls"]["ttft_p90_s"]
            print(f"{n} replicas: TTFT p90 recomputing (events) / pulling (pulls): {ratio:.2f}x")


def _range(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition(",")
    return float(lo), float(hi or lo)


def _int_range(text: str) -> tuple[int, int]:
    lo, hi = _range(text)
    return int(lo), int(hi)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, nargs="+", default=[8, 64, 512])
    p.add_argument("--modes", choices=MODES, nargs="+", default=list(MODES))
    p.add_argument("--contexts-per-replica", type=float, default=0.5)
    p.add_argument("--context-len", type=int, default=_AGENTS.context_len)
    p.add_argument("--forks", type=int, default=16)
    p.add_argument("--turns", type=int, default=_AGENTS.turns)
    p.add_argument("--question-len", type=_int_range, default=_AGENTS.question_len)
    p.add_argument("--answer-len", type=_int_range, default=_AGENTS.answer_len)
    p.add_argument("--think", type=_range, default=_AGENTS.think_s, help="LO,HI seconds")
    p.add_argument("--fork-after", type=float, default=_AGENTS.fork_after_s)
    p.add_argument("--fork-spread", type=float, default=_AGENTS.fork_spread_s)
    p.add_argument("--start-spread", type=float, default=_AGENTS.start_spread_s)
    p.add_argument("--profile", default="cpu")
    p.add_argument("--blocks", type=int, default=1024, help="KV blocks per replica")
    p.add_argument("--link-bandwidth", type=float, default=LinkConfig().bandwidth_bytes_per_s)
    p.add_argument("--link-latency", type=float, default=PULL_LATENCY_S)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel processes")


def runs(a: argparse.Namespace) -> list[Run]:
    """Every (size, mode) of the study; ValueError naming a bad argument."""
    if not 1 <= a.jobs <= 64:
        raise ValueError(f"--jobs: must be in [1, 64], got {a.jobs}")
    if not 0 < a.contexts_per_replica <= 1024:  # False for NaN
        raise ValueError(
            f"--contexts-per-replica: must be in (0, 1024], got {a.contexts_per_replica}"
        )
    link = LinkConfig(a.link_bandwidth, a.link_latency)
    out = []
    for n in a.replicas:
        if not 1 <= n <= MAX_REPLICAS:
            raise ValueError(f"--replicas: each must be in [1, {MAX_REPLICAS}], got {n}")
        agents = AgentConfig(
            contexts=max(1, round(a.contexts_per_replica * n)),
            context_len=a.context_len,
            forks=a.forks,
            turns=a.turns,
            question_len=a.question_len,
            answer_len=a.answer_len,
            think_s=a.think,
            fork_after_s=a.fork_after,
            fork_spread_s=a.fork_spread,
            start_spread_s=a.start_spread,
            seed=a.seed,
        )
        out += [Run(n, mode, agents, a.profile, a.blocks, link) for mode in a.modes]
    return out


def cmd_agents(a: argparse.Namespace) -> None:
    """The table, a row as each run ends (a 512-replica run takes minutes), then the ratios."""
    todo = runs(a)
    print_header()
    rows = []
    with ProcessPoolExecutor(a.jobs) if a.jobs > 1 else nullcontext() as pool:
        for row in pool.map(simulate, todo) if pool is not None else map(simulate, todo):
            print_row(row)
            rows.append(row)
    print_ratios(rows)
