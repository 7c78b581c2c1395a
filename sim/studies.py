"""The README's studies: routing at scale, fairness under a heavy tenant, simulator speed.

`python -m sim.studies OUTDIR [ROUTING_SIZES...] [--only fairness vtc routing scale floor
decode-heavy]`
"""

from __future__ import annotations

import argparse
import math
import resource
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from router.config import POLICIES, RoutingConfig
from scheduler import SchedulerConfig
from scheduler.queues import FairQueue
from sim.cost import load_profile
from sim.fleet import FleetSim
from sim.fleet_config import SimConfig
from sim.metrics import SimResult, percentile
from sim.plots import plot_rows as _plot
from sim.replica import SimReplica
from sim.workload import SimRequest, WorkloadConfig, synthetic_workload

# The fairness studies' figures were computed with the profile derived from measurements, before
# the calibrated sim/profiles/cpu.json existed; they keep it so that they reproduce. Routing and
# scale use the calibrated profile, at half of the capacity measured below.
STUDY_PROFILE = "cpu-derived"
FLEET_PROFILE = "cpu"
# The fleet sizes and timed window of the routing and scale studies (the command line's defaults).
ROUTING_SIZES = (8, 64, 512)
SCALE_SIZES = (10, 100, 1000)
SCALE_SECONDS = 60.0


def _fleet_traffic(
    n: int,
    seconds: float,
    rate_per_replica: float,
    question_len: tuple[int, int],
    output_len: tuple[int, int],
) -> list[SimRequest]:
    """seconds of Poisson arrivals at rate_per_replica on each of n replicas, two tenants per
    replica."""
    return synthetic_workload(
        WorkloadConfig(
            num_requests=int(rate_per_replica * n * seconds),
            rate=rate_per_replica * n,
            tenants=2 * n,
            seed=0,
            question_len=question_len,
            output_len=output_len,
        )
    )


def fleet_workload(n: int, seconds: float, rate_per_replica: float) -> list[SimRequest]:
    """The routing study's traffic on n replicas: two tenants per replica, 256-token system prompts,
    16-token questions and answers."""
    return _fleet_traffic(n, seconds, rate_per_replica, question_len=(16, 16), output_len=(16, 16))


def fleet_config(n: int, router: str = "prefix_affinity") -> SimConfig:
    return SimConfig(
        num_replicas=n,
        scheduler=SchedulerConfig(num_gpu_blocks=120, max_model_len=1024),
        routing=RoutingConfig(router_policy=router, seed=0),
    )


def chat_workload(n: int, seconds: float, rate_per_replica: float) -> list[SimRequest]:
    """Chat-like traffic for the scale study: 256-token system prompts shared by two tenants per
    replica, 32-512-token questions, 64-512-token answers (about 530 in, 290 out on average)."""
    return _fleet_traffic(
        n, seconds, rate_per_replica, question_len=(32, 512), output_len=(64, 512)
    )


def chat_config(n: int) -> SimConfig:
    """1,024 blocks (16k tokens) per replica; records keep no per-token gaps (millions of
    requests)."""
    return SimConfig(
        num_replicas=n,
        scheduler=SchedulerConfig(num_gpu_blocks=1024, max_model_len=2048),
        routing=RoutingConfig(router_policy="prefix_affinity", seed=0),
        keep_itl=False,
    )


def capacity(
    make_workload: Callable[[int, float, float], list[SimRequest]],
    make_config: Callable[[int], SimConfig],
    overload_rate: float,
    replicas: int = 4,
    seconds: float = 240.0,
    warmup_s: float = 60.0,
) -> float:
    """A replica's capacity in requests/s: completions per replica-second after warm-up, under an
    offered load (overload_rate per replica) that keeps every queue from emptying."""
    result = FleetSim(make_config(replicas), load_profile(FLEET_PROFILE)).run(
        make_workload(replicas, seconds, overload_rate), until_s=seconds
    )
    done = sum(1 for r in result.records if r.finish_s is not None and r.finish_s > warmup_s)
    waiting = sum(len(r.scheduler.waiting) for r in result.replicas)
    if not waiting:
        raise ValueError(
            f"overload_rate {overload_rate}/s did not overload {replicas} replicas: raise it"
        )
    return done / (seconds - warmup_s) / replicas


def routing_at_scale(
    out: Path,
    sizes: tuple[int, ...] = ROUTING_SIZES,
    seconds: float = 10.0,
    capacity_router: str = "prefix_affinity",
) -> list[dict]:
    """Every policy at 50% of a replica's capacity as measured under capacity_router's routing
    (prefix affinity's replicas hit their tenants' cached prompts, so they serve far more)."""
    cap = capacity(fleet_workload, lambda n: fleet_config(n, capacity_router), overload_rate=64.0)
    rate = cap / 2
    print(
        f"routing study: a replica's capacity under {capacity_router} {cap:.2f} req/s;"
        f" 50% load = {rate:.2f} req/s per replica",
        flush=True,
    )
    rows = []
    for n in sizes:
        wl = fleet_workload(n, seconds, rate)
        for router in POLICIES:
            summary = (
                FleetSim(fleet_config(n, router), load_profile(FLEET_PROFILE))
                .run(wl)
                .summary(slo_ttft_s=1.0, slo_itl_s=0.5)
            )
            row: dict[str, float | str] = {**summary, "router": router, "replicas": n}
            rows.append(row)
            print(
                f"{router:16s} {n:4d} hit {row['hit_rate']:.3f} ttft_p50 {row['ttft_p50_s']:.3f}"
                f" ttft_p90 {row['ttft_p90_s']:.3f} goodput {row['goodput_rps']:.1f} of "
                f"{rate * n:.1f} req/s",
                flush=True,
            )
    _plot(
        str(out / f"routing_at_scale_{capacity_router}.png"),
        rows,
        "replicas",
        ("hit_rate", "ttft_p90_s", "goodput_rps"),
        f"routing at scale (CPU profile, 50% of {capacity_router}'s capacity)",
    )
    return rows


def heavy_tenant_workload(requests: int = 1500) -> list[SimRequest]:
    """Ten tenants, one sending 10x the others, at 6 req/s: one CPU replica stays overloaded."""
    return synthetic_workload(
        WorkloadConfig(
            num_requests=requests,
            rate=6.0,
            tenants=10,
            tenant_weights=[10.0] + [1.0] * 9,
            system_prompt_len=0,
            question_len=(64, 256),
            output_len=(16, 64),
            seed=1,
        )
    )


def fairness(out: Path, requests: int = 1500) -> None:
    wl = heavy_tenant_workload(requests)
    for policy in ("fcfs", "fair"):
        cfg = SimConfig(
            num_replicas=1,
            scheduler=SchedulerConfig(num_gpu_blocks=1024, policy=policy, max_num_seqs=32),
            routing=RoutingConfig(router_policy="round_robin"),
        )
        result = FleetSim(cfg, load_profile(STUDY_PROFILE)).run(wl)
        light = [r.ttft_s for r in result.records if r.tenant != "t0"]
        heavy = [r.ttft_s for r in result.records if r.tenant == "t0"]
        # Service shares while every tenant is backlogged: requests finished by the last arrival.
        horizon = max(r.arrival_s for r in result.records)
        service: dict[str, float] = defaultdict(float)
        for r in result.records:
            if r.finish_s is None or r.finish_s > horizon:
                continue
            service[r.tenant] += (
                r.prompt_len + 2 * r.num_output_tokens
            )  # the VTC weights (1 in, 2 out)
        total = sum(service.values())
        print(
            f"{policy}: light TTFT p90 {percentile(light, 90):.2f}s, heavy TTFT p90 "
            f"{percentile(heavy, 90):.2f}s,"
            f" heavy share {service['t0'] / total:.3f}, light share each "
            f"{min(service[f't{k}'] for k in range(1, 10)) / total:.3f}"
            f"-{max(service[f't{k}'] for k in range(1, 10)) / total:.3f}",
            flush=True,
        )


@dataclass(slots=True)
class CounterGap:
    """After each step: the spread of VTC counters among the tenants backlogged at that moment."""

    max_gap: float = 0.0
    at_s: float = 0.0
    samples: int = 0  # steps that found at least two tenants backlogged
    max_running_per_tenant: int = 0

    def __call__(self, replica: SimReplica, now: float) -> None:
        queue = replica.scheduler.waiting
        if not isinstance(queue, FairQueue):
            raise TypeError(
                f"CounterGap: needs the fair policy's queue, got {type(queue).__name__}"
            )
        tenants = queue.backlogged()
        per_tenant = Counter(r.tenant for r in replica.scheduler.running)
        self.max_running_per_tenant = max(
            self.max_running_per_tenant, max(per_tenant.values(), default=0)
        )
        if len(tenants) < 2:
            return
        counters = [queue.counters[t] for t in tenants]
        gap = max(counters) - min(counters)
        self.samples += 1
        if gap > self.max_gap:
            self.max_gap, self.at_s = gap, now


def vtc_gap_bound(
    sched: SchedulerConfig, workload: list[SimRequest], running_per_tenant: int | None = None
) -> float:
    """Upper bound on c_f - c_g for tenants f, g both backlogged, without preemption (README:
    Fairness).

    A tenant is admitted only while its counter is the least among the backlogged ones, and that
    least counter never falls; so f can get ahead only by what its running requests still owe
    right after one of its admissions: at most (running requests) x (w_in x longest prompt +
    w_out x longest output). Over any interval both stay backlogged, their service differs by at
    most twice this, VTC's 2 x max(w_p L_input, w_q M) in our terms.
    """
    per_request = sched.fair_input_weight * max(
        r.prompt_len for r in workload
    ) + sched.fair_output_weight * max(r.output_len for r in workload)
    return (running_per_tenant or sched.max_num_seqs) * per_request


def vtc_gap(requests: int = 1500) -> dict:
    """The fairness study's overloaded replica under VTC: the counter gap against its bound."""
    wl = heavy_tenant_workload(requests)
    sched = SchedulerConfig(num_gpu_blocks=1024, policy="fair", max_num_seqs=32)
    cfg = SimConfig(
        num_replicas=1, scheduler=sched, routing=RoutingConfig(router_policy="round_robin")
    )
    gap = CounterGap()
    result = FleetSim(cfg, load_profile(STUDY_PROFILE), on_step=gap).run(wl)
    row = {
        "max_gap": gap.max_gap,
        "at_s": gap.at_s,
        "samples": gap.samples,
        "bound": vtc_gap_bound(sched, wl),
        "observed_running_bound": vtc_gap_bound(sched, wl, gap.max_running_per_tenant),
        "max_running_per_tenant": gap.max_running_per_tenant,
        "preemptions": sum(r.scheduler.num_preemptions for r in result.replicas),
    }
    print(
        f"vtc: max counter gap among backlogged tenants {row['max_gap']:.0f} (at "
        f"{row['at_s']:.1f} s, over"
        f" {row['samples']} steps with >= 2 backlogged); bound {row['bound']:.0f} with "
        "max_num_seqs, "
        f"{row['observed_running_bound']:.0f} with the {row['max_running_per_tenant']} requests "
        "one tenant ran at"
        f" most; preemptions {row['preemptions']}",
        flush=True,
    )
    return row


@dataclass(slots=True)
class WallAt:
    """An on_step hook: the wall-clock time at which a run first reaches each of these simulated
    seconds."""

    at_s: tuple[float, ...]
    walls: list[float] = field(default_factory=list)

    def __call__(self, replica: SimReplica, now: float) -> None:
        if len(self.walls) < len(self.at_s) and now >= self.at_s[len(self.walls)]:
            self.walls.append(time.perf_counter())


def _timed_window(
    n: int, workload: list[SimRequest], start_s: float, end_s: float
) -> tuple[SimResult, float, float]:
    """Run the scale study's fleet of n on workload to a simulated second past end_s (so that a step
    crosses it); returns the result, the wall seconds the run took from start_s to end_s (NaN if
    its fleet went idle before end_s), and in all."""
    marks = WallAt((start_s, end_s))
    t0 = time.perf_counter()
    result = FleetSim(chat_config(n), load_profile(FLEET_PROFILE), on_step=marks).run(
        workload, until_s=end_s + 1
    )
    window = marks.walls[1] - marks.walls[0] if len(marks.walls) == 2 else math.nan
    return result, window, time.perf_counter() - t0


def scale(
    sizes: tuple[int, ...] = SCALE_SIZES, seconds: float = SCALE_SECONDS, warmup_s: float = 120.0
) -> list[dict]:
    """Simulated seconds per wall second on the chat workload at 50% of measured capacity.

    The steady rate is that of the simulated window [warmup_s, warmup_s + seconds] of one run, timed
    as the run passes its ends. The window starts after warm-up because the fleet fills up over the
    first minute and the replicas' prefix caches over the first 100 s, each step of which makes a
    simulated second dearer. It is timed inside the one run: subtracting a second run's wall time to
    the window's start misreads it, as two runs do not spend the same wall time on the same
    simulated seconds.
    """
    cap = capacity(chat_workload, chat_config, overload_rate=2.0)
    rate = cap / 2
    print(
        f"scale: a replica's capacity {cap:.3f} req/s; 50% load = {rate:.3f} req/s per replica",
        flush=True,
    )
    rows = []
    end_s = warmup_s + seconds
    for n in sizes:
        result, window_wall, wall = _timed_window(
            n, chat_workload(n, end_s + 1, rate), warmup_s, end_s
        )
        steady = seconds / window_wall
        row = result.summary()
        row.update(
            replicas=n,
            rate_per_replica=rate,
            sim_per_wall=steady,
            wall_s=wall,
            hour_wall_min=3600 / steady / 60,
            jumped_steps=result.jumped_steps,
            max_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
        )
        rows.append(row)
        print(
            f"scale {n:5d} replicas: simulated s {warmup_s:.0f}-{end_s:.0f} at {steady:.2f}"
            f" simulated s per wall s (whole run {end_s + 1:.0f} s in {wall:.1f} s); an hour would"
            f" take {row['hour_wall_min']:.1f} min; {row['steps']} steps, {result.jumped_steps} "
            "jumped;"
            f" {row['requests']} requests done, TTFT p50/p90 "
            f"{row['ttft_p50_s']:.2f}/{row['ttft_p90_s']:.2f} s,"
            f" hit rate {row['hit_rate']:.3f}; max RSS {row['max_rss_gb']:.2f} GB",
            flush=True,
        )
    return rows


# The scale target: a simulated hour on 1,000 replicas in 15 wall minutes.
TARGET_US_PER_REPLICA_S = 15 * 60 / 3600 / 1000 * 1e6


def scale_floor(
    sizes: tuple[int, ...] = (1000,),
    running: int = 3,
    seconds: float = 40.0,
    warmup_s: float = 10.0,
) -> list[dict]:
    """What a fleet costs per replica and simulated second with no request arriving or finishing.

    Each replica decodes `running` long requests (the scale study's replicas run about 3.5 at 50%
    load, by Little's law: 0.347 req/s times ~10 s from arrival to finish) and reports to the
    router once a second: one k-step jump, one prefix report and one cruise plan per
    replica-second, and the router's share of each. Set beside the scale target's budget, it shows
    how much of that budget is spent before any request arrives.
    """
    rows = []
    end_s = warmup_s + seconds
    for n in sizes:
        workload = [
            SimRequest(f"r{i}", i * 1e-5, 128, 1900, tenant=f"t{i % (2 * n)}")
            for i in range(n * running)
        ]
        result, window_wall, _ = _timed_window(n, workload, warmup_s, end_s)
        finished = sum(1 for rec in result.records if rec.finish_s is not None)
        counts = sorted({len(r.scheduler.running) for r in result.replicas})
        if finished or counts != [running]:
            raise ValueError(
                f"seconds: by simulated second {end_s + 1:.0f} {finished} requests finished and "
                f"replicas ran {counts} requests, not {running} each; shorten the window"
            )
        us = 1e6 * window_wall / (seconds * n)
        rows.append(
            {
                "replicas": n,
                "us_per_replica_s": us,
                "budget_share": us / TARGET_US_PER_REPLICA_S,
                "steps": sum(r.num_steps for r in result.replicas),
                "min_replica_steps": min(r.num_steps for r in result.replicas),
            }
        )
        print(
            f"floor {n:5d} replicas, {running} decoding each, no arrivals: simulated s "
            f"{warmup_s:.0f}-{end_s:.0f}"
            f" cost {us:.0f} us per replica-second, {us / TARGET_US_PER_REPLICA_S:.0%} of the "
            "scale target's"
            f" {TARGET_US_PER_REPLICA_S:.0f} us",
            flush=True,
        )
    return rows


def decode_heavy(n: int = 100, seconds: float = 120.0) -> list[dict]:
    """Where k-step jumps pay: 256-512-token outputs at ~50% load, with and without coalescing."""
    wl = synthetic_workload(
        WorkloadConfig(
            num_requests=int(0.2 * n * seconds),
            rate=0.2 * n,
            tenants=2 * n,
            output_len=(256, 512),
            seed=0,
        )
    )
    rows = []
    for coalesce in (True, False):
        cfg = SimConfig(
            num_replicas=n,
            scheduler=SchedulerConfig(num_gpu_blocks=4096, max_model_len=1024),
            routing=RoutingConfig(router_policy="prefix_affinity", seed=0),
            coalesce=coalesce,
        )
        t0 = time.perf_counter()
        result = FleetSim(cfg, load_profile(STUDY_PROFILE)).run(wl, until_s=seconds)
        wall = time.perf_counter() - t0
        steps = sum(r.num_steps for r in result.replicas)
        rows.append(
            {
                "coalesce": coalesce,
                "wall_s": wall,
                "steps": steps,
                "jumped_steps": result.jumped_steps,
            }
        )
        print(
            f"decode-heavy {n} replicas, coalesce {coalesce}: {seconds:.0f} simulated s in "
            f"{wall:.1f} wall s ="
            f" {seconds / wall:.2f} sim-s/wall-s; {steps} steps, {result.jumped_steps} jumped",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sim.studies", description=__doc__)
    parser.add_argument("outdir", nargs="?", default="sim/results")
    parser.add_argument(
        "sizes", nargs="*", type=int, default=list(ROUTING_SIZES), help="routing study fleet sizes"
    )
    parser.add_argument("--only", nargs="+", choices=STUDIES, default=list(STUDIES))
    parser.add_argument("--scale-sizes", nargs="+", type=int, default=list(SCALE_SIZES))
    parser.add_argument(
        "--scale-seconds",
        type=float,
        default=SCALE_SECONDS,
        help="simulated seconds timed, after two minutes",
    )
    a = parser.parse_args(argv)
    target = Path(a.outdir)
    target.mkdir(parents=True, exist_ok=True)
    if "fairness" in a.only:
        fairness(target)
    if "vtc" in a.only:
        vtc_gap()
    if "routing" in a.only:
        for capacity_router in ("prefix_affinity", "round_robin"):
            routing_at_scale(target, sizes=tuple(a.sizes), capacity_router=capacity_router)
    if "scale" in a.only:
        scale(tuple(a.scale_sizes), a.scale_seconds)
    if "floor" in a.only:
        scale_floor(tuple(a.scale_sizes))
    if "decode-heavy" in a.only:
        decode_heavy()


STUDIES = ("fairness", "vtc", "routing", "scale", "floor", "decode-heavy")

if __name__ == "__main__":
    main()
