"""`python -m sim plan --autoscale llm ongoing`: plan a fleet for a day, not for one rate.

A fixed fleet must be sized for the peak; an autoscaled one pays for what the hour needs. This
replays a day-shaped arrival curve (`sim.autoscale.day_workload`) through `AutoscaleSim` once per
policy setting and reports what each costs (replica-hours, scaled to a real day) and what it
delivers (SLO attainment: the share of requests whose TTFT and ITL p90 both meet the SLO). Each
policy is tuned to the SLO the same way: its knob is swept, and the cheapest setting whose
attainment reaches the target is its tuned point.

- `llm`: router.autoscaling.decide (what Serve runs), its knob the KV-cache and batch targets;
- `ongoing`: a model of Serve's default policy, its knob target_ongoing_requests.

Several seeds replay several days of the same shape, so that a saving is not one day's luck.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace

from router.autoscaling import AutoscalingPolicyConfig, SignalTargets, SloTargets
from router.config import RoutingConfig
from scheduler import SchedulerConfig
from settings import check_settings, setting
from sim.autoscale import (
    AutoscaleConfig,
    AutoscaleResult,
    AutoscaleSim,
    DayWorkloadConfig,
    LLMSignalsPolicy,
    OngoingRequestsPolicy,
    Policy,
    day_workload,
)
from sim.cost import load_profile
from sim.fleet_args import replica_scheduler
from sim.fleet_config import SimConfig

POLICIES = ("llm", "ongoing")
MAX_SEEDS = 1000
MAX_JOBS = 256
REAL_DAY_S = 86400.0
# What deploy.yaml gets when it leaves a setting out: both policies replay with it.
PRODUCTION = AutoscalingPolicyConfig()


@dataclass(slots=True)
class DayPlanConfig:
    """Everything a day's replay needs but the policy setting: plain data, so that worker
    processes can receive it."""

    day: DayWorkloadConfig
    scheduler: SchedulerConfig
    loop: AutoscaleConfig
    profile: str = "h100"
    shape: str = "day"  # names the day's shape in the tables ("day", or "shaped" for the other)
    router: str = "prefix_affinity"
    slo: SloTargets = field(default_factory=SloTargets)
    target: float = setting(0.99, "SLO attainment a tuned setting must reach", gt=0, le=1)
    min_replicas: int = PRODUCTION.min_replicas
    max_replicas: int = 64
    upscale_delay_s: float = PRODUCTION.upscale_delay_s
    downscale_delay_s: float = PRODUCTION.downscale_delay_s

    def __post_init__(self) -> None:
        check_settings(self)

    def policy(self, kind: str, knob: float, headroom: float) -> Policy:
        if kind == "ongoing":
            return OngoingRequestsPolicy(
                target_ongoing_requests=knob,
                min_replicas=self.min_replicas,
                max_replicas=self.max_replicas,
                upscale_delay_s=self.upscale_delay_s,
                downscale_delay_s=self.downscale_delay_s,
            )
        if kind == "llm":
            targets = SignalTargets(
                kv_cache_usage=knob, batch_fraction=knob, downscale_headroom=headroom
            )
            return LLMSignalsPolicy(
                AutoscalingPolicyConfig(
                    min_replicas=self.min_replicas,
                    max_replicas=self.max_replicas,
                    upscale_delay_s=self.upscale_delay_s,
                    downscale_delay_s=self.downscale_delay_s,
                    slo=self.slo,
                    targets=targets,
                )
            )
        raise ValueError(f"autoscale: one of {', '.join(POLICIES)}, got {kind!r}")


@dataclass(slots=True)
class DayRow:
    """One policy setting's day: its cost and what it delivered."""

    policy: str
    knob: float
    headroom: float
    seed: int
    requests: int
    replica_hours_day: float  # scaled to a real day: the compressed day's times the compression
    attainment: float
    ttft_p90_s: float
    itl_p90_s: float
    peak_replicas: int
    changes: int
    reasons: dict[str, int]
    wall_s: float
    shape: str = "day"

    @property
    def knobs(self) -> tuple[str, float, float]:
        """The policy setting, as `sweep` takes it."""
        return (self.policy, self.knob, self.headroom)

    @property
    def day(self) -> str:
        return str(self.seed) if self.shape == "day" else f"{self.shape} {self.seed}"

    @property
    def setting(self) -> str:
        if self.policy == "ongoing":
            return f"target_ongoing_requests {self.knob:g}"
        return f"kv/batch target {self.knob:g}, headroom {self.headroom:g}"

    def cells(self) -> str:
        return (
            f"| {self.seed} | {self.policy} | {self.setting} | {self.replica_hours_day:.1f} | "
            f"{self.attainment * 100:.2f}% | {self.ttft_p90_s:.3f} | {self.itl_p90_s * 1000:.1f} | "
            f"{self.peak_replicas} | {self.changes} | {self.wall_s:.0f} |"
        )


HEADER = (
    "| seed | policy | setting | replica-hours per day | SLO attainment | TTFT p90 (s) | "
    "ITL p90 (ms) | peak replicas | count changes | wall (s) |\n"
    "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
)


def simulate_day(cfg: DayPlanConfig, policy: Policy) -> tuple[AutoscaleResult, int]:
    """The day (cfg.day) replayed with a policy in the loop; its result and its request count."""
    workload = day_workload(cfg.day)
    sim = AutoscaleSim(
        SimConfig(
            scheduler=cfg.scheduler,
            routing=RoutingConfig(router_policy=cfg.router, seed=cfg.day.seed),
            keep_itl=False,
        ),
        load_profile(cfg.profile),
        policy,
        cfg.loop,
    )
    return sim.run_day(workload), len(workload)


def replay_day(cfg: DayPlanConfig, kind: str, knob: float, headroom: float) -> DayRow:
    """The day (cfg.day) replayed with one policy setting in the loop."""
    t0 = time.perf_counter()
    out, requests = simulate_day(cfg, cfg.policy(kind, knob, headroom))
    summary = out.result.summary(cfg.slo.ttft_p90_s, cfg.slo.itl_p90_s)
    return DayRow(
        policy=kind,
        knob=knob,
        headroom=headroom,
        seed=cfg.day.seed,
        requests=requests,
        replica_hours_day=out.replica_hours * REAL_DAY_S / cfg.day.day_s,
        attainment=out.slo_attainment(cfg.slo.ttft_p90_s, cfg.slo.itl_p90_s),
        ttft_p90_s=summary["ttft_p90_s"],
        itl_p90_s=summary["itl_p90_s"],
        peak_replicas=max(billed for _, _, billed in out.timeline),
        changes=sum(out.decisions.values()),
        reasons=dict(out.decisions.most_common()),
        wall_s=time.perf_counter() - t0,
        shape=cfg.shape,
    )


def tuned(rows: Sequence[DayRow], kind: str, target: float) -> DayRow | None:
    """The cheapest of a policy's settings that reaches the target (None: none does)."""
    ok = [r for r in rows if r.policy == kind and r.attainment >= target]
    return min(ok, key=lambda r: r.replica_hours_day) if ok else None


def saving(rows: Sequence[DayRow], target: float) -> float | None:
    """How much less the tuned llm setting pays than the tuned ongoing one (None: one of them has
    no setting that reaches the target)."""
    llm, ongoing = tuned(rows, "llm", target), tuned(rows, "ongoing", target)
    if llm is None or ongoing is None:
        return None
    return 1 - llm.replica_hours_day / ongoing.replica_hours_day


def sweep(
    cfg: DayPlanConfig,
    seeds: Sequence[int],
    settings: Sequence[tuple[str, float, float]],
    jobs: int,
    on_row: Callable[[DayRow], None] | None = None,
) -> list[DayRow]:
    """Every (seed, setting) replayed, `jobs` at a time; on_row sees each row as it is done (a
    long sweep shows its progress, and a cut one what it finished); the rows in a stable order."""
    days = [replace(cfg, day=replace(cfg.day, seed=seed)) for seed in seeds]
    return sweep_days(days, settings, jobs, on_row)


def sweep_days(
    days: Sequence[DayPlanConfig],
    settings: Sequence[tuple[str, float, float]],
    jobs: int,
    on_row: Callable[[DayRow], None] | None = None,
) -> list[DayRow]:
    """Every (day, setting) replayed, as `sweep` does, over days of any shape."""
    tasks = [(day, *setting) for day in days for setting in settings]
    rows: list[DayRow] = []
    if jobs == 1:
        done: Iterable[DayRow] = (replay_day(*task) for task in tasks)
        rows = [_seen(row, on_row) for row in done]
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(replay_day, *task) for task in tasks]
            rows = [_seen(f.result(), on_row) for f in as_completed(futures)]
    rows.sort(key=lambda r: (r.shape, r.seed, r.policy != "ongoing", r.knob, r.headroom))
    return rows


def _seen(row: DayRow, on_row: Callable[[DayRow], None] | None) -> DayRow:
    if on_row is not None:
        on_row(row)
    return row


# ---- the command line (sim/__main__.py's `plan` hands over when --autoscale is given) ----------
def add_arguments(p: argparse.ArgumentParser) -> None:
    day = DayWorkloadConfig()
    loop = AutoscaleConfig()
    g = p.add_argument_group(
        "a day with autoscaling (--autoscale): --rate is the peak rate, --requests is unused"
    )
    g.add_argument(
        "--autoscale",
        choices=POLICIES,
        nargs="+",
        help="replay a day-shaped arrival curve with these policies in the loop, each tuned to "
        "the SLO; report replica-hours and SLO attainment",
    )
    g.add_argument("--day-s", type=float, default=900.0, help="the day compressed to this long")
    g.add_argument("--peak-to-trough", type=float, default=day.peak_to_trough)
    g.add_argument("--long-share-peak", type=float, default=day.long_share_peak)
    g.add_argument("--long-share-trough", type=float, default=day.long_share_trough)
    g.add_argument("--seeds", type=int, nargs="+", help="one day per seed (default: --seed)")
    g.add_argument("--ongoing-targets", type=float, nargs="+", default=[2.5, 2.75, 3, 3.5, 4])
    g.add_argument(
        "--kv-targets", type=float, nargs="+", default=[PRODUCTION.targets.kv_cache_usage]
    )
    g.add_argument(
        "--headrooms", type=float, nargs="+", default=[PRODUCTION.targets.downscale_headroom]
    )
    g.add_argument("--target", type=float, default=0.99, help="SLO attainment to tune for")
    g.add_argument("--start-delay", type=float, default=loop.start_delay_s)
    g.add_argument("--decision-period", type=float, default=loop.decision_period_s)
    g.add_argument("--look-back", type=float, default=loop.look_back_s)
    g.add_argument("--upscale-delay", type=float, default=PRODUCTION.upscale_delay_s)
    g.add_argument("--downscale-delay", type=float, default=PRODUCTION.downscale_delay_s)
    g.add_argument("--initial-replicas", type=int, default=2)
    g.add_argument(
        "--move-queued",
        action="store_true",
        help="a replica that starts taking requests takes over queued requests that never ran",
    )
    g.add_argument("--jobs", type=int, default=1, help="days replayed in parallel")


def config_of(a: argparse.Namespace) -> DayPlanConfig:
    """The command line's day plan; a bad value is a ValueError naming its field."""
    if not 1 <= a.jobs <= MAX_JOBS:
        raise ValueError(f"jobs: must be in [1, {MAX_JOBS}], got {a.jobs}")
    return DayPlanConfig(
        day=DayWorkloadConfig(
            day_s=a.day_s,
            peak_rate=a.rate,
            peak_to_trough=a.peak_to_trough,
            long_share_peak=a.long_share_peak,
            long_share_trough=a.long_share_trough,
            tenants=a.tenants,
            system_prompt_len=a.system_prompt_len,
            seed=a.seed,
        ),
        scheduler=replica_scheduler(a, a.blocks * a.block_size),
        loop=AutoscaleConfig(
            decision_period_s=a.decision_period,
            look_back_s=a.look_back,
            start_delay_s=a.start_delay,
            initial_replicas=a.initial_replicas,
            move_queued=a.move_queued,
        ),
        profile=a.profile,
        router=a.router[0],
        slo=SloTargets(ttft_p90_s=a.slo_ttft, itl_p90_s=a.slo_itl),
        target=a.target,
        max_replicas=a.max_replicas,
        upscale_delay_s=a.upscale_delay,
        downscale_delay_s=a.downscale_delay,
    )


def settings_of(a: argparse.Namespace) -> list[tuple[str, float, float]]:
    settings: list[tuple[str, float, float]] = []
    if "llm" in a.autoscale:
        settings += [("llm", k, h) for k in a.kv_targets for h in a.headrooms]
    if "ongoing" in a.autoscale:
        settings += [("ongoing", t, 0.0) for t in a.ongoing_targets]
    return settings


def cmd_plan_day(a: argparse.Namespace) -> None:
    cfg = config_of(a)
    seeds = a.seeds if a.seeds is not None else [a.seed]
    if not 1 <= len(seeds) <= MAX_SEEDS:
        raise ValueError(f"seeds: 1 to {MAX_SEEDS} seeds, got {len(seeds)}")
    settings = settings_of(a)
    for kind, knob, headroom in settings:  # refused here, before any worker starts
        cfg.policy(kind, knob, headroom)
    print(describe(cfg, a), flush=True)
    rows = sweep(cfg, seeds, settings, a.jobs, lambda r: print("done:", r.cells(), flush=True))
    print()
    print(HEADER)
    for r in rows:
        print(r.cells())
    print()
    for r in rows:
        print(f"seed {r.seed} {r.policy} {r.setting}: changes by reason {r.reasons}")
    print()
    print(summary_table(rows, seeds, cfg.target))


def describe(cfg: DayPlanConfig, a: argparse.Namespace) -> str:
    """The day, the fleet, the SLO and the control loop, in one line."""
    moved = ", queued requests move to new replicas" if cfg.loop.move_queued else ""
    return (
        f"# a day with autoscaling: profile {cfg.profile}, day compressed to {cfg.day.day_s:g} s "
        f"({REAL_DAY_S / cfg.day.day_s:g}x), peak {cfg.day.peak_rate:g} req/s, peak:trough "
        f"{cfg.day.peak_to_trough:g}, long share {cfg.day.long_share_peak:g} at peak / "
        f"{cfg.day.long_share_trough:g} at trough; {a.blocks} KV blocks and max_num_seqs "
        f"{a.max_num_seqs} per replica; SLO TTFT p90 {cfg.slo.ttft_p90_s:g} s and ITL p90 "
        f"{cfg.slo.itl_p90_s * 1000:g} ms per request, target {cfg.target:.0%}; start delay "
        f"{cfg.loop.start_delay_s:g} s, decisions every {cfg.loop.decision_period_s:g} s over "
        f"{cfg.loop.look_back_s:g} s{moved}, upscale/downscale delay {cfg.upscale_delay_s:g}/"
        f"{cfg.downscale_delay_s:g} s, replicas {cfg.min_replicas}-{cfg.max_replicas}"
    )


def summary_table(rows: Sequence[DayRow], seeds: Sequence[int], target: float) -> str:
    """Per seed: each policy's tuned setting, its replica-hours and attainment, and the saving."""
    lines = [
        f"| seed | ongoing tuned | replica-hours | attainment | llm tuned | replica-hours | "
        f"attainment | llm saves (both >= {target:.0%}) |",
        "| ---: | --- | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for seed in seeds:
        day = [r for r in rows if r.seed == seed]
        cells = [str(seed)]
        for kind in ("ongoing", "llm"):
            best = tuned(day, kind, target)
            cells += (
                [best.setting, f"{best.replica_hours_day:.1f}", f"{best.attainment:.2%}"]
                if best is not None
                else ["none reaches the target", "", ""]
            )
        cut = saving(day, target)
        cells.append(f"{cut:.1%}" if cut is not None else "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
