"""One autoscaled day replayed with its decisions in view: the diagnosis tool behind
docs/autoscaling.md's day 15.

`sim plan --autoscale` reports a day's totals; this replays one day (the same `sim plan` flags, so
the same figures) and prints what the totals hide:

- the SLO misses by the 30 s in which their requests arrived (where a day loses its attainment);
- with `--log FROM TO`, each decision in that window: the count, the reason, the replicas that
  report, the fleet's load in replicas (the largest demand), KV usage, running and waiting;
- with `--floor FROM TO N`, the policy's count held at N or more from FROM to TO (the replicas
  asked at FROM serve from FROM + the start delay): how much standing capacity a stretch of the
  day needs, which no policy setting tells directly.

    python bench/autoscale_day_trace.py --log 265 330 -- --profile h100 --day-s 900 --rate 30 \\
        --blocks 512 --max-num-seqs 64 --tenants 64 --slo-ttft 1 --slo-itl 0.1 \\
        --max-replicas 64 --shaped-seeds 15 --shaped-peak-to-trough 4 \\
        --shaped-long-share-peak 0.3 --shaped-long-share-trough 0.3 --shaped-burst-at 0.3 \\
        --shaped-burst-len 0.05 --shaped-burst-factor 1.5

Without `--shaped-seeds` the day is `--seed`'s of the tuning shape. Prints figures; never passes
or fails on them.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from router.autoscaling import (
    AutoscalingState,
    ReplicaSignals,
    ScaleDecision,
    SignalTargets,
    demand,
)
from sim import autoscale_plan as plan
from sim.__main__ import command_line
from sim.autoscale import AutoscaleResult, Policy
from sim.autoscale_protocol import shaped_day

BUCKET_S = 30


@dataclass(slots=True)
class Traced:
    """A policy with a standing floor in a window, and its decisions in another kept as lines."""

    inner: Policy
    targets: SignalTargets
    log: tuple[float, float] | None = None
    floor: tuple[float, float, int] | None = None
    lines: list[str] = field(default_factory=list)

    def decide(
        self, signals: list[ReplicaSignals], current: int, state: AutoscalingState, now: float
    ) -> ScaleDecision:
        d = self.inner.decide(signals, current, state, now)
        if self.floor is not None and self.floor[0] <= now <= self.floor[1]:
            d = replace(d, replicas=max(d.replicas, self.floor[2]))
        if self.log is not None and self.log[0] <= now <= self.log[1]:
            self.lines.append(_line(signals, current, d, now, self.targets))
        return d


def _line(
    signals: list[ReplicaSignals],
    current: int,
    d: ScaleDecision,
    now: float,
    targets: SignalTargets,
) -> str:
    n = max(1, len(signals))
    load = demand(signals, targets).largest()[0] if signals else 0.0
    return (
        f"{now:7.1f} {current:3d} -> {d.replicas:3d} {d.reason:16s} reporting {len(signals):3d} "
        f"load {load:6.2f} kv {sum(s.kv_cache_usage for s in signals) / n:.2f} "
        f"running {sum(s.num_running for s in signals):4d} "
        f"waiting {sum(s.num_waiting for s in signals):5d}"
    )


def misses_by_arrival(out: AutoscaleResult, ttft_s: float, itl_s: float) -> Counter[int]:
    """SLO misses of finished requests, by the 30 s in which they arrived."""
    return Counter(
        int(r.arrival_s // BUCKET_S) * BUCKET_S
        for r in out.result.records
        if r.finish_s is not None and not (r.ttft_s <= ttft_s and r.itl_p90_s <= itl_s)
    )


def _args(argv: list[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    own, rest = argv, []
    if "--" in argv:
        own, rest = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--policy", choices=plan.POLICIES, default="llm")
    p.add_argument("--knob", type=float, help="KV/batch target or target_ongoing_requests")
    p.add_argument("--headroom", type=float, default=plan.PRODUCTION.targets.downscale_headroom)
    p.add_argument("--log", type=float, nargs=2, metavar=("FROM", "TO"))
    p.add_argument("--floor", type=float, nargs=3, metavar=("FROM", "TO", "N"))
    a = p.parse_args(own)
    return a, command_line().parse_args(["plan", "--autoscale", a.policy, *rest])


def traced_policy(a: argparse.Namespace, cfg: plan.DayPlanConfig) -> Traced:
    """The command line's policy setting, with its floor and its decision log."""
    if a.policy == "ongoing" and a.knob is None:
        raise ValueError("knob: the ongoing policy needs --knob (target_ongoing_requests)")
    knob = a.knob if a.knob is not None else plan.PRODUCTION.targets.kv_cache_usage
    for name in ("log", "floor"):
        window = getattr(a, name)
        if window is not None and not 0 <= window[0] <= window[1] <= cfg.day.day_s:
            raise ValueError(f"{name}: need 0 <= FROM <= TO <= day_s, got {window[:2]}")
    floor = None
    if a.floor is not None:
        if not 1 <= a.floor[2] <= cfg.max_replicas:
            raise ValueError(f"floor: N must be in [1, {cfg.max_replicas}], got {a.floor[2]}")
        floor = (a.floor[0], a.floor[1], int(a.floor[2]))
    targets = plan.PRODUCTION.targets
    if a.policy == "llm":
        targets = SignalTargets(
            kv_cache_usage=knob, batch_fraction=knob, downscale_headroom=a.headroom
        )
    return Traced(cfg.policy(a.policy, knob, a.headroom), targets, a.log, floor)


def summary(out: AutoscaleResult, requests: int, cfg: plan.DayPlanConfig) -> str:
    slo = cfg.slo
    return (
        f"day {cfg.day.seed} ({cfg.shape}): {requests} requests, "
        f"{out.replica_hours * plan.REAL_DAY_S / cfg.day.day_s:.1f} replica-hours per day, "
        f"SLO attainment {out.slo_attainment(slo.ttft_p90_s, slo.itl_p90_s):.2%}, "
        f"{sum(out.decisions.values())} count changes, "
        f"peak {max(billed for _, _, billed in out.timeline)}, "
        f"{out.moved} queued requests moved to new replicas"
    )


def main(argv: list[str]) -> None:
    a, day = _args(argv)
    cfg = plan.config_of(day)
    cfg = shaped_day(cfg, day, 0) if day.shaped_seeds else cfg
    traced = traced_policy(a, cfg)
    out, requests = plan.simulate_day(cfg, traced)
    print(plan.describe(cfg, day))
    print(f"{a.policy} {a.knob if a.knob is not None else 'default'}:", summary(out, requests, cfg))
    misses = misses_by_arrival(out, cfg.slo.ttft_p90_s, cfg.slo.itl_p90_s)
    print("misses by arrival (s: count):", dict(sorted(misses.items())))
    for line in traced.lines:
        print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
