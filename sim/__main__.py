"""`python -m sim run|plan`: simulate a fleet, or size one for SLOs (bench/calibrate.py fits a
device profile)."""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from typing import Any

from router.config import RoutingConfig
from sim.autoscale_protocol import add_arguments as add_day_arguments
from sim.autoscale_protocol import cmd_plan_day
from sim.cost import load_profile
from sim.disagg import DisaggConfig, DisaggSim
from sim.fleet import FleetSim
from sim.fleet_args import add_fleet_arguments, replica_scheduler
from sim.fleet_config import SIM_MAX_MODEL_LEN, SimConfig
from sim.fleet_kv_study import add_arguments as add_agent_arguments
from sim.fleet_kv_study import cmd_agents
from sim.kv_copy import LinkConfig
from sim.plots import plot_rows as _plot
from sim.workload import SimRequest, WorkloadConfig, load_trace, synthetic_workload


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


def _add_common(p: argparse.ArgumentParser) -> None:
    _add_workload_arguments(p)
    add_fleet_arguments(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft", type=float, default=1.0, help="seconds")
    p.add_argument("--slo-itl", type=float, default=0.5, help="seconds")
    p.add_argument(
        "--until",
        type=float,
        default=math.inf,
        help="stop at this simulated second; requests still in flight are left out",
    )
    p.add_argument("--plot", help="PNG path")


def _add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The device profile and the workload: a trace, or the synthetic one's shape."""
    p.add_argument(
        "--profile", default="cpu", help="profile name under sim/profiles or a JSON path"
    )
    p.add_argument("--trace", help="JSONL trace instead of the synthetic workload")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--rate", type=float, default=1.0, help="requests per second")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--tenants", type=int, default=12)
    p.add_argument("--system-prompt-len", type=int, default=256)
    p.add_argument("--question-len", type=_range, default=(16, 16), help="LO,HI tokens")
    p.add_argument("--output-len", type=_range, default=(16, 16), help="LO,HI tokens")


def _workload(a: argparse.Namespace) -> list[SimRequest]:
    if a.trace:
        return load_trace(a.trace)
    return synthetic_workload(
        WorkloadConfig(
            num_requests=a.requests,
            rate=a.rate,
            burstiness=a.burstiness,
            tenants=a.tenants,
            system_prompt_len=a.system_prompt_len,
            question_len=a.question_len,
            output_len=a.output_len,
            seed=a.seed,
        )
    )


def _simulate(
    a: argparse.Namespace,
    replicas: int,
    router: str,
    workload: list[SimRequest],
    split: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """One fleet's figures; split (prefill, decode): a disaggregated fleet of that many replicas."""
    cfg = _sim_config(a, replicas, router)
    t0 = time.perf_counter()
    cost = load_profile(a.profile)
    if split is None:
        result = FleetSim(cfg, cost).run(workload, until_s=a.until)
    else:
        link = LinkConfig(a.link_bandwidth, a.link_latency)
        disagg = DisaggConfig(*split, link=link, local_prefill_tokens=a.local_prefill_tokens)
        result = DisaggSim(cfg, cost, disagg).run(workload, until_s=a.until)
    wall = time.perf_counter() - t0
    row: dict[str, Any] = dict(result.summary(a.slo_ttft, a.slo_itl))
    row.update(
        replicas=replicas if split is None else f"{split[0]}+{split[1]}",
        router=router,
        wall_s=wall,
        sim_per_wall=row["sim_end_s"] / wall if wall else 0,
    )
    return row


def _sim_config(a: argparse.Namespace, replicas: int, router: str) -> SimConfig:
    """The fleet the command line describes: its replicas' scheduler and its router."""
    return SimConfig(
        num_replicas=replicas,
        scheduler=replica_scheduler(a, min(SIM_MAX_MODEL_LEN, a.blocks * a.block_size)),
        stats_delay_s=a.stats_delay,
        routing=RoutingConfig(router_policy=router, seed=a.seed),
    )


_COLUMNS = (
    "router",
    "replicas",
    "requests",
    "hit_rate",
    "ttft_p50_s",
    "ttft_p90_s",
    "itl_p90_s",
    "output_tok_s",
    "goodput_rps",
    "steps",
    "sim_per_wall",
)


def _print_table(rows: list[dict]) -> None:
    print("| " + " | ".join(_COLUMNS) + " |")
    print("|" + " --- |" * len(_COLUMNS))
    for r in rows:
        cells = [f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in _COLUMNS]
        print("| " + " | ".join(cells) + " |")


def cmd_run(a: argparse.Namespace) -> None:
    workload = _workload(a)
    rows = [_simulate(a, n, router, workload) for router in a.router for n in a.replicas]
    _print_table(rows)
    if a.plot:
        _plot(a.plot, rows, "replicas", ("hit_rate", "ttft_p90_s", "goodput_rps"), "sim run")


def _smallest(ok: Callable[[int], bool], hi: int, lo: int = 0) -> int:
    """The smallest n in (lo, hi] with ok(n), given ok(hi) and not ok(lo) unless lo is 0
    (bisection: ok is monotone)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _doubling(ok: Callable[[int], bool], limit: int) -> int | None:
    """The first of 1, 2, 4, ... (the last capped at limit) with ok(n); None if not even limit."""
    n = 1
    while not ok(n):
        if n >= limit:
            return None
        n = min(n * 2, limit)
    return n


def _plan_disagg(a: argparse.Namespace, workload: list[SimRequest]) -> None:
    """Smallest prefill and decode pools meeting the SLOs: double both until (k, k) meets them,
    then the fewest decode replicas beside k prefill ones, then the fewest prefill replicas."""
    rows: list[dict] = []

    def ok(split: tuple[int, int]) -> bool:
        row = _simulate(a, sum(split), a.router[0], workload, split)
        rows.append(row)
        return row["ttft_p90_s"] <= a.slo_ttft and row["itl_p90_s"] <= a.slo_itl

    k = _doubling(lambda n: ok((n, n)), a.max_replicas)
    if k is None:
        _print_table(rows)
        print(f"no fleet of <= {a.max_replicas} + {a.max_replicas} replicas meets the SLOs")
        return
    decode = _smallest(lambda d: ok((k, d)), k)
    prefill = _smallest(lambda p: ok((p, decode)), k)
    _print_table(rows)
    print(
        f"plan: {prefill} prefill + {decode} decode replicas ({prefill + decode} GPUs) meet TTFT "
        f"p90 <= {a.slo_ttft}s and ITL p90 <= {a.slo_itl}s at {a.rate} req/s"
    )


def cmd_plan(a: argparse.Namespace) -> None:
    """Smallest replica count whose TTFT p90 and ITL p90 meet the SLOs (bisection; load is
    monotone); --disagg: the smallest prefill and decode pools; with --autoscale, a day's
    replica-hours and SLO attainment under each policy."""
    if a.autoscale:
        cmd_plan_day(a)
        return
    workload = _workload(a)
    if a.disagg:
        _plan_disagg(a, workload)
        return
    rows: list[dict] = []

    def ok(n: int) -> bool:
        row = _simulate(a, n, a.router[0], workload)
        rows.append(row)
        return row["ttft_p90_s"] <= a.slo_ttft and row["itl_p90_s"] <= a.slo_itl

    hi = _doubling(ok, a.max_replicas)
    if hi is None:
        _print_table(rows)
        print(f"no fleet of <= {a.max_replicas} replicas meets the SLOs")
        return
    hi = _smallest(ok, hi, hi // 2)  # hi // 2 is known to fail (or 0)
    rows.sort(key=lambda r: r["replicas"])
    _print_table(rows)
    print(
        f"plan: {hi} replicas meet TTFT p90 <= {a.slo_ttft}s and ITL p90 <= {a.slo_itl}s at "
        f"{a.rate} req/s"
    )
    if a.plot:
        _plot(a.plot, rows, "replicas", ("ttft_p90_s", "itl_p90_s"), f"plan at {a.rate} req/s")


def command_line() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sim")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="simulate a fleet and print its figures")
    _add_common(run)
    run.add_argument("--replicas", type=int, nargs="+", default=[2])
    plan = sub.add_parser(
        "plan", help="smallest replica count meeting the SLOs, or an autoscaled day's cost"
    )
    _add_common(plan)
    plan.add_argument("--max-replicas", type=int, default=4096)
    _add_disagg_arguments(plan)
    add_day_arguments(plan)
    agents = sub.add_parser(
        "agents",
        help="an agent trace: today's router, KV events, peer pulls, sessions (sim/fleet_kv.py)",
    )
    add_agent_arguments(agents)
    return parser


def _add_disagg_arguments(plan: argparse.ArgumentParser) -> None:
    plan.add_argument(
        "--disagg",
        action="store_true",
        help="size a disaggregated fleet: prefill and decode pools apart (sim/disagg.py)",
    )
    plan.add_argument(
        "--link-bandwidth",
        type=float,
        default=LinkConfig().bandwidth_bytes_per_s,
        help="--disagg: prefill -> decode KV link, bytes/s",
    )
    plan.add_argument(
        "--link-latency",
        type=float,
        default=LinkConfig().latency_s,
        help="--disagg: the link's latency per transfer, seconds",
    )
    plan.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=0,
        help="--disagg: prompts shorter than this prefill on a decode replica",
    )


def main(argv: list[str] | None = None) -> None:
    parser = command_line()
    a = parser.parse_args(argv)
    try:
        {"run": cmd_run, "plan": cmd_plan, "agents": cmd_agents}[a.command](a)
    except ValueError as exc:
        parser.exit(2, f"error: {exc}\n")


if __name__ == "__main__":
    main()
