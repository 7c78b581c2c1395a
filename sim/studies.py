"""The README's studies: routing at scale, fairness under a heavy tenant, simulator speed.

`python -m sim.studies OUTDIR [ROUTING_SIZES...] [--only fairness vtc routing scale decode-heavy]`
"""
from __future__ import annotations

import argparse
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from scheduler import SchedulerConfig
from sim.cost import load_profile
from sim.fleet import FleetSim, SimConfig
from sim.metrics import percentile
from sim.plots import plot_rows as _plot
from sim.policies import POLICIES, RoutingConfig
from sim.replica import SimReplica
from sim.workload import SimRequest, WorkloadConfig, synthetic_workload

# The README's study figures were computed with the profile derived from measurements, before the
# calibrated sim/profiles/cpu.json existed; they keep it so that they reproduce.
STUDY_PROFILE = "cpu-derived"
PER_REPLICA_RATE = 4.0  # about 50% of a CPU-profile replica's capacity on this workload (~8 req/s)


def fleet_workload(n: int, seconds: float) -> list[SimRequest]:
    """50% load on n CPU-profile replicas: two tenants per replica, 256-token system prompts."""
    return synthetic_workload(WorkloadConfig(num_requests=int(PER_REPLICA_RATE * n * seconds),
                                             rate=PER_REPLICA_RATE * n, tenants=2 * n, seed=0))


def fleet_config(n: int, router: str) -> SimConfig:
    return SimConfig(num_replicas=n, scheduler=SchedulerConfig(num_gpu_blocks=120, max_model_len=1024),
                     routing=RoutingConfig(router_policy=router, seed=0))


def routing_at_scale(out: Path, sizes=(8, 64, 512), seconds: float = 10.0) -> list[dict]:
    rows = []
    for n in sizes:
        wl = fleet_workload(n, seconds)
        for router in POLICIES:
            row = FleetSim(fleet_config(n, router), load_profile(STUDY_PROFILE)).run(wl).summary(slo_ttft_s=1.0, slo_itl_s=0.5)
            row.update(router=router, replicas=n)
            rows.append(row)
            print(f"{router:16s} {n:4d} hit {row['hit_rate']:.3f} ttft_p90 {row['ttft_p90_s']:.3f}"
                  f" goodput {row['goodput_rps']:.1f}", flush=True)
    _plot(str(out / "routing_at_scale.png"), rows, "replicas", ("hit_rate", "ttft_p90_s", "goodput_rps"),
          "routing at scale (CPU profile, 50% load)")
    return rows


def heavy_tenant_workload(requests: int = 1500) -> list[SimRequest]:
    """Ten tenants, one sending 10x the others, at 6 req/s: one CPU replica stays overloaded."""
    return synthetic_workload(WorkloadConfig(num_requests=requests, rate=6.0, tenants=10,
                                             tenant_weights=[10.0] + [1.0] * 9, system_prompt_len=0,
                                             question_len=(64, 256), output_len=(16, 64), seed=1))


def fairness(out: Path, requests: int = 1500) -> None:
    wl = heavy_tenant_workload(requests)
    for policy in ("fcfs", "fair"):
        cfg = SimConfig(num_replicas=1, scheduler=SchedulerConfig(num_gpu_blocks=1024, policy=policy,
                                                                  max_num_seqs=32),
                        routing=RoutingConfig(router_policy="round_robin"))
        result = FleetSim(cfg, load_profile(STUDY_PROFILE)).run(wl)
        light = [r.ttft_s for r in result.records if r.tenant != "t0"]
        heavy = [r.ttft_s for r in result.records if r.tenant == "t0"]
        # Service shares while every tenant is backlogged: requests finished by the last arrival.
        horizon = max(r.arrival_s for r in result.records)
        service: dict[str, float] = defaultdict(float)
        for r in result.records:
            if r.finish_s > horizon:
                continue
            service[r.tenant] += r.prompt_len + 2 * r.num_output_tokens  # the VTC weights (1 in, 2 out)
        total = sum(service.values())
        print(f"{policy}: light TTFT p90 {percentile(light, 90):.2f}s, heavy TTFT p90 {percentile(heavy, 90):.2f}s,"
              f" heavy share {service['t0'] / total:.3f}, light share each {min(service[f't{k}'] for k in range(1, 10)) / total:.3f}"
              f"-{max(service[f't{k}'] for k in range(1, 10)) / total:.3f}", flush=True)


@dataclass(slots=True)
class CounterGap:
    """After each step: the spread of VTC counters among the tenants backlogged at that moment."""

    max_gap: float = 0.0
    at_s: float = 0.0
    samples: int = 0  # steps that found at least two tenants backlogged
    max_running_per_tenant: int = 0

    def __call__(self, replica: SimReplica, now: float) -> None:
        queue = replica.scheduler.waiting
        tenants = queue.backlogged()
        per_tenant = Counter(r.tenant for r in replica.scheduler.running)
        self.max_running_per_tenant = max(self.max_running_per_tenant, max(per_tenant.values(), default=0))
        if len(tenants) < 2:
            return
        counters = [queue.counters[t] for t in tenants]
        gap = max(counters) - min(counters)
        self.samples += 1
        if gap > self.max_gap:
            self.max_gap, self.at_s = gap, now


def vtc_gap_bound(sched: SchedulerConfig, workload: list[SimRequest], running_per_tenant: int | None = None) -> float:
    """Upper bound on c_f - c_g for tenants f, g both backlogged, without preemption (README: Fairness).

    A tenant is admitted only while its counter is the least among the backlogged ones, and that
    least counter never falls; so f can get ahead only by what its running requests still owe
    right after one of its admissions: at most (running requests) x (w_in x longest prompt +
    w_out x longest output). Over any interval both stay backlogged, their service differs by at
    most twice this, VTC's 2 x max(w_p L_input, w_q M) in our terms.
    """
    per_request = (sched.fair_input_weight * max(r.prompt_len for r in workload)
                   + sched.fair_output_weight * max(r.output_len for r in workload))
    return (running_per_tenant or sched.max_num_seqs) * per_request


def vtc_gap(requests: int = 1500) -> dict:
    """The fairness study's overloaded replica under VTC: the counter gap against its bound."""
    wl = heavy_tenant_workload(requests)
    sched = SchedulerConfig(num_gpu_blocks=1024, policy="fair", max_num_seqs=32)
    cfg = SimConfig(num_replicas=1, scheduler=sched, routing=RoutingConfig(router_policy="round_robin"))
    gap = CounterGap()
    result = FleetSim(cfg, load_profile(STUDY_PROFILE), on_step=gap).run(wl)
    row = {"max_gap": gap.max_gap, "at_s": gap.at_s, "samples": gap.samples, "bound": vtc_gap_bound(sched, wl),
           "observed_running_bound": vtc_gap_bound(sched, wl, gap.max_running_per_tenant),
           "max_running_per_tenant": gap.max_running_per_tenant,
           "preemptions": sum(r.scheduler.num_preemptions for r in result.replicas)}
    print(f"vtc: max counter gap among backlogged tenants {row['max_gap']:.0f} (at {row['at_s']:.1f} s, over"
          f" {row['samples']} steps with >= 2 backlogged); bound {row['bound']:.0f} with max_num_seqs, "
          f"{row['observed_running_bound']:.0f} with the {row['max_running_per_tenant']} requests one tenant ran at"
          f" most; preemptions {row['preemptions']}", flush=True)
    return row


def scale(sizes=(10, 100, 1000), seconds: float = 10.0) -> list[dict]:
    """Simulated seconds per wall second on the routing study's fleet, over `seconds` of arrivals.

    The run stops at the last simulated second (no drain), so the rate is the loaded fleet's.
    """
    rows = []
    for n in sizes:
        wl = fleet_workload(n, seconds)
        t0 = time.perf_counter()
        result = FleetSim(fleet_config(n, "prefix_affinity"), load_profile(STUDY_PROFILE)).run(wl, until_s=seconds)
        wall = time.perf_counter() - t0
        row = result.summary()
        row.update(replicas=n, sim_s=seconds, wall_s=wall, sim_per_wall=seconds / wall,
                   jumped_steps=result.jumped_steps)
        rows.append(row)
        print(f"scale {n:5d} replicas: {seconds:.0f} simulated s in {wall:.1f} wall s ="
              f" {seconds / wall:.3f} sim-s/wall-s; {row['steps']} steps, {result.jumped_steps} of them jumped;"
              f" {row['requests']} of {len(wl)} requests"
              f" done, hit rate {row['hit_rate']:.3f}, TTFT p50/p90 {row['ttft_p50_s']:.2f}/{row['ttft_p90_s']:.2f} s",
              flush=True)
    return rows


def decode_heavy(n: int = 100, seconds: float = 120.0) -> list[dict]:
    """Where k-step jumps pay: 256-512-token outputs at ~50% load, with and without coalescing."""
    wl = synthetic_workload(WorkloadConfig(num_requests=int(0.2 * n * seconds), rate=0.2 * n, tenants=2 * n,
                                           output_len=(256, 512), seed=0))
    rows = []
    for coalesce in (True, False):
        cfg = SimConfig(num_replicas=n, scheduler=SchedulerConfig(num_gpu_blocks=4096, max_model_len=1024),
                        routing=RoutingConfig(router_policy="prefix_affinity", seed=0), coalesce=coalesce)
        t0 = time.perf_counter()
        result = FleetSim(cfg, load_profile(STUDY_PROFILE)).run(wl, until_s=seconds)
        wall = time.perf_counter() - t0
        steps = sum(r.num_steps for r in result.replicas)
        rows.append({"coalesce": coalesce, "wall_s": wall, "steps": steps, "jumped_steps": result.jumped_steps})
        print(f"decode-heavy {n} replicas, coalesce {coalesce}: {seconds:.0f} simulated s in {wall:.1f} wall s ="
              f" {seconds / wall:.2f} sim-s/wall-s; {steps} steps, {result.jumped_steps} jumped", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sim.studies", description=__doc__)
    parser.add_argument("outdir", nargs="?", default="sim/results")
    parser.add_argument("sizes", nargs="*", type=int, default=[8, 64, 512], help="routing study fleet sizes")
    parser.add_argument("--only", nargs="+", choices=STUDIES, default=list(STUDIES))
    parser.add_argument("--scale-sizes", nargs="+", type=int, default=[10, 100, 1000])
    parser.add_argument("--scale-seconds", type=float, default=10.0)
    a = parser.parse_args(argv)
    target = Path(a.outdir)
    target.mkdir(parents=True, exist_ok=True)
    if "fairness" in a.only:
        fairness(target)
    if "vtc" in a.only:
        vtc_gap()
    if "routing" in a.only:
        routing_at_scale(target, sizes=tuple(a.sizes))
    if "scale" in a.only:
        scale(tuple(a.scale_sizes), a.scale_seconds)
    if "decode-heavy" in a.only:
        decode_heavy()


STUDIES = ("fairness", "vtc", "routing", "scale", "decode-heavy")

if __name__ == "__main__":
    main()
