"""`python -m sim plan --autoscale ... --tune-seeds ... --eval-seeds ...`: tune on some days, judge
on others.

A setting tuned on the day it is judged on flatters its policy: the sweep finds the setting that
happened to suit that day's arrivals. The protocol here keeps the two apart:

1. every setting of each policy replays the tuning days;
2. each policy's setting is the cheapest (fewest replica-hours over the tuning days) that meets
   the SLO target on every tuning day (none does: the one whose worst day comes closest, marked);
3. those settings, and only those, replay the evaluation days: days of the same shape under seeds
   never used for tuning, and days of another shape (`--shaped-seeds`: another peak-to-trough
   ratio, another long/short mix, a burst), which is what a shipped default meets in production.

Only evaluation days are reported as results; the tuning table says how each setting was chosen.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from sim import autoscale_plan as plan
from sim.autoscale_plan import (
    HEADER,
    MAX_SEEDS,
    DayPlanConfig,
    DayRow,
    sweep,
    sweep_days,
)

SHAPED = "shaped"


@dataclass(frozen=True, slots=True)
class Pick:
    """A policy's setting as the tuning days chose it."""

    knobs: tuple[str, float, float]  # (policy, knob, headroom), as `sweep` takes it
    setting: str
    meets: bool  # met the target on every tuning day
    worst: float  # its lowest attainment over the tuning days
    hours: float  # its replica-hours per day, averaged over the tuning days


def candidates(rows: Sequence[DayRow], policy: str, target: float) -> list[Pick]:
    """Each of the policy's settings, summed up over the tuning days (rows)."""
    by_setting: dict[tuple[str, float, float], list[DayRow]] = {}
    for r in rows:
        if r.policy == policy:
            by_setting.setdefault(r.knobs, []).append(r)
    return [
        Pick(
            knobs,
            days[0].setting,
            all(r.attainment >= target for r in days),
            min(r.attainment for r in days),
            sum(r.replica_hours_day for r in days) / len(days),
        )
        for knobs, days in by_setting.items()
    ]


def pick(rows: Sequence[DayRow], policy: str, target: float) -> Pick | None:
    """The cheapest setting that meets the target on every tuning day; if none does, the one whose
    worst day comes closest (its `meets` False); None: the policy has no rows."""
    picks = candidates(rows, policy, target)
    if not picks:
        return None
    ok = [p for p in picks if p.meets]
    if ok:
        return min(ok, key=lambda p: p.hours)
    return max(picks, key=lambda p: p.worst)


# The `--shaped-*` flags: the DayWorkloadConfig field each sets, its default (the 11-28 shaped
# day) and its help.
SHAPE_FLAGS = {
    "shaped_peak_to_trough": ("peak_to_trough", 4.0, "peak rate / trough rate"),
    "shaped_long_share_peak": ("long_share_peak", 0.3, "long documents' share at the peak"),
    "shaped_long_share_trough": ("long_share_trough", 0.3, "...and at the trough"),
    "shaped_burst_at": ("burst_at", 0.3, "burst start, a fraction of the day"),
    "shaped_burst_len": ("burst_len", 0.05, "a fraction of the day"),
    "shaped_burst_factor": ("burst_factor", 1.5, "the rate times this in the burst"),
}


def shape_of(a: argparse.Namespace, k: int) -> dict[str, float]:
    """The k-th shaped seed's day fields: each `--shaped-*` flag gives one value for every shaped
    seed, or one per seed (so several shapes are judged in one run)."""
    n = len(a.shaped_seeds or ())
    out = {}
    for flag, (name, _, _) in SHAPE_FLAGS.items():
        values = getattr(a, flag)
        values = values if isinstance(values, list) else [values]
        if len(values) not in (1, n):
            raise ValueError(f"{name}: one value, or one per shaped seed ({n}), got {len(values)}")
        out[name] = values[0] if len(values) == 1 else values[k]
    return out


def shaped_day(cfg: DayPlanConfig, a: argparse.Namespace, k: int) -> DayPlanConfig:
    """The k-th shaped day: the command line's `--shaped-*` flags over the tuning days' shape."""
    # Field names as values, from the command line's edge: replace() checks them all again.
    values: dict[str, Any] = {"seed": a.shaped_seeds[k], **shape_of(a, k)}
    day = replace(cfg.day, **values)
    return replace(cfg, day=day, shape=SHAPED)


def evaluation_days(cfg: DayPlanConfig, a: argparse.Namespace) -> list[DayPlanConfig]:
    days = [replace(cfg, day=replace(cfg.day, seed=s)) for s in a.eval_seeds or ()]
    return days + [shaped_day(cfg, a, k) for k in range(len(a.shaped_seeds or ()))]


def describe_shapes(a: argparse.Namespace) -> str:
    """Each shaped seed with its shape, for the run's header."""
    parts = []
    for k, seed in enumerate(a.shaped_seeds or ()):
        v = shape_of(a, k)
        parts.append(
            f"{seed} (peak:trough {v['peak_to_trough']:g}, long share {v['long_share_peak']:g} / "
            f"{v['long_share_trough']:g}, x{v['burst_factor']:g} burst at {v['burst_at']:g} of "
            f"the day for {v['burst_len']:g})"
        )
    return "; ".join(parts) or "none"


def check_seeds(a: argparse.Namespace) -> None:
    """Tuning and evaluation days apart: a seed used for tuning is refused as an evaluation day."""
    tune, judge = list(a.tune_seeds or ()), [*(a.eval_seeds or ()), *(a.shaped_seeds or ())]
    if not 1 <= len(tune) <= MAX_SEEDS:
        raise ValueError(f"tune_seeds: 1 to {MAX_SEEDS} seeds, got {len(tune)}")
    if not 1 <= len(judge) <= MAX_SEEDS:
        raise ValueError(
            f"eval_seeds: 1 to {MAX_SEEDS} seeds (with shaped_seeds), got {len(judge)}"
        )
    shared = sorted(set(tune) & set(judge))
    if shared:
        raise ValueError(f"eval_seeds: seeds {shared} are tuning days too (tune_seeds)")


def run_protocol(
    cfg: DayPlanConfig,
    a: argparse.Namespace,
    settings: Sequence[tuple[str, float, float]],
) -> tuple[list[DayRow], list[Pick], list[DayRow]]:
    """Tuning rows, each policy's pick, and the evaluation rows of the picks."""
    show = lambda r: print("done:", r.cells(), flush=True)  # noqa: E731
    tuning = sweep(cfg, a.tune_seeds, settings, a.jobs, show)
    policies = dict.fromkeys(kind for kind, _, _ in settings)
    picks = [p for kind in policies if (p := pick(tuning, kind, cfg.target)) is not None]
    evaluation = sweep_days(evaluation_days(cfg, a), [p.knobs for p in picks], a.jobs, show)
    return tuning, picks, evaluation


def tuning_table(tuning: Sequence[DayRow], picks: Sequence[Pick], target: float) -> str:
    chosen = {p.knobs for p in picks}
    lines = [
        f"| policy | setting | replica-hours per day (mean) | worst attainment | every day >= "
        f"{target:.0%} | picked |",
        "| --- | --- | ---: | ---: | --- | --- |",
    ]
    for policy in dict.fromkeys(r.policy for r in tuning):
        for c in sorted(candidates(tuning, policy, target), key=lambda c: c.knobs):
            lines.append(
                f"| {policy} | {c.setting} | {c.hours:.1f} | {c.worst:.2%} | "
                f"{'yes' if c.meets else 'no'} | {'**picked**' if c.knobs in chosen else ''} |"
            )
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class Verdict:
    """The evaluation days against the issue's bar: llm over the target every day, its saving over
    the ongoing policy in replica-hours (all days together), and its count changes per day over
    the ongoing policy's (the worst day)."""

    llm_worst: float
    ongoing_worst: float
    saving: float
    changes_ratio: float

    def line(self, target: float) -> str:
        return (
            f"evaluation days: llm worst-day attainment {self.llm_worst:.2%} "
            f"({'meets' if self.llm_worst >= target else 'misses'} {target:.0%}), ongoing "
            f"{self.ongoing_worst:.2%}; llm needs {self.saving:.1%} fewer replica-hours; its "
            f"count changes at most {self.changes_ratio:.2f}x the ongoing policy's on any day"
        )


def verdict(evaluation: Sequence[DayRow]) -> Verdict | None:
    """None unless both policies replayed the same evaluation days."""
    llm = {r.day: r for r in evaluation if r.policy == "llm"}
    ongoing = {r.day: r for r in evaluation if r.policy == "ongoing"}
    if not llm or llm.keys() != ongoing.keys():
        return None
    hours = sum(r.replica_hours_day for r in llm.values())
    base = sum(r.replica_hours_day for r in ongoing.values())
    return Verdict(
        llm_worst=min(r.attainment for r in llm.values()),
        ongoing_worst=min(r.attainment for r in ongoing.values()),
        saving=1 - hours / base if base else 0.0,
        changes_ratio=max(llm[d].changes / max(1, ongoing[d].changes) for d in llm),
    )


def evaluation_table(evaluation: Sequence[DayRow]) -> str:
    """Per evaluation day: each picked setting's cost, attainment and count changes."""
    lines = [
        "| day | ongoing replica-hours | attainment | changes | llm replica-hours | attainment | "
        "changes | llm saves |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for day in dict.fromkeys(r.day for r in evaluation):
        cells = [day]
        rows = {r.policy: r for r in evaluation if r.day == day}
        for kind in ("ongoing", "llm"):
            r = rows.get(kind)
            cells += (
                [f"{r.replica_hours_day:.1f}", f"{r.attainment:.2%}", str(r.changes)]
                if r is not None
                else ["", "", ""]
            )
        if len(rows) == 2:
            cells.append(
                f"{1 - rows['llm'].replica_hours_day / rows['ongoing'].replica_hours_day:.1%}"
            )
        else:
            cells.append("n/a")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _saving(rows: dict[str, DayRow]) -> str:
    if len(rows) < 2:
        return "n/a"
    return f"{1 - rows['llm'].replica_hours_day / rows['ongoing'].replica_hours_day:.1%}"


def print_protocol(
    tuning: Sequence[DayRow], picks: Sequence[Pick], evaluation: Sequence[DayRow], target: float
) -> None:
    print("\n## Tuning days (settings chosen here, not reported as results)\n")
    print(tuning_table(tuning, picks, target))
    for p in picks:
        if not p.meets:
            print(
                f"\n{p.knobs[0]}: no setting meets {target:.0%} on every tuning day; evaluated "
                f"the closest ({p.setting}, worst day {p.worst:.2%})"
            )
    print("\n## Evaluation days (never used for tuning)\n")
    print(HEADER.replace("| seed |", "| day |", 1))
    for r in evaluation:
        print(r.cells().replace(f"| {r.seed} |", f"| {r.day} |", 1))
    print()
    for r in evaluation:
        print(f"day {r.day} {r.policy} {r.setting}: changes by reason {r.reasons}")
    print()
    print(evaluation_table(evaluation))
    result = verdict(evaluation)
    if result is not None:
        print()
        print(result.line(target))


# ---- the command line (sim/__main__.py's `plan` hands over when --autoscale is given) ----------
def add_arguments(p: argparse.ArgumentParser) -> None:
    plan.add_arguments(p)
    g = p.add_argument_group(
        "tuning and evaluation days apart (--tune-seeds with --eval-seeds and/or --shaped-seeds)"
    )
    g.add_argument(
        "--tune-seeds", type=int, nargs="+", help="days each policy's setting is picked on"
    )
    g.add_argument(
        "--eval-seeds", type=int, nargs="+", help="days of the same shape the picks are judged on"
    )
    g.add_argument(
        "--shaped-seeds", type=int, nargs="+", help="days of the other shape (--shaped-*) judged on"
    )
    # Each takes one value for every shaped seed, or one per shaped seed.
    for flag, (_, default, text) in SHAPE_FLAGS.items():
        option = "--" + flag.replace("_", "-")
        g.add_argument(option, type=float, nargs="+", default=[default], help=text)


def cmd_plan_day(a: argparse.Namespace) -> None:
    """Without --tune-seeds, every setting on every day (`sim.autoscale_plan`); with it, the
    protocol above."""
    if a.tune_seeds is None and a.eval_seeds is None and a.shaped_seeds is None:
        plan.cmd_plan_day(a)
        return
    check_seeds(a)
    cfg = plan.config_of(a)
    settings = plan.settings_of(a)
    for kind, knob, headroom in settings:  # refused here, before any worker starts
        cfg.policy(kind, knob, headroom)
    evaluation_days(cfg, a)  # a bad --shaped-* value is refused here too
    print(plan.describe(cfg, a), flush=True)
    print(
        f"# tuning days {a.tune_seeds}; evaluation days {a.eval_seeds or []}; shaped days "
        f"{describe_shapes(a)}",
        flush=True,
    )
    tuning, picks, evaluation = run_protocol(cfg, a, settings)
    print_protocol(tuning, picks, evaluation, cfg.target)
