"""Autoscaling on LLM signals against Serve's ongoing-request policy, in the fleet simulator.

A day-shaped arrival curve (10x peak to trough, chat by day, long documents taking a larger share
by night) on the H100 profile, replayed through `sim.autoscale.AutoscaleSim` once per policy
setting. Each policy is tuned to the same SLO the same way: its knob is swept, and the cheapest
setting whose SLO attainment (requests whose TTFT and ITL p90 both meet the SLO) reaches the target
is its tuned point. Both share the control loop: decision period, look-back, replica start delay,
upscale and downscale delays.

The day is time-compressed (`--day-s`, 86,400 is real time): the arrival curve runs `86400 / day_s`
times faster than a real day; request physics (step times) and the control loop's constants are
not compressed, so the compressed day is harder on both policies than a real one (the load moves
faster relative to the start delay and the delays).

    python bench/autoscale_sim.py --day-s 900 --peak-rate 30 --blocks 512 --jobs 2

Prints one row per setting, then the tuned comparison; never passes or fails on the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

# Run as a script from anywhere, with no install (the simulator needs only the standard library).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from router.autoscaling import AutoscalingPolicyConfig, SignalTargets, SloTargets
from scheduler import SchedulerConfig
from sim.autoscale import (
    AutoscaleConfig,
    AutoscaleSim,
    DayWorkloadConfig,
    LLMSignalsPolicy,
    OngoingRequestsPolicy,
    day_workload,
)
from sim.cost import load_profile
from sim.fleet import SimConfig


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--profile", default="h100")
    p.add_argument("--day-s", type=float, default=1200.0, help="the day's simulated length")
    p.add_argument("--peak-rate", type=float, default=100.0, help="requests per second at peak")
    p.add_argument("--peak-to-trough", type=float, default=10.0)
    p.add_argument("--long-share-peak", type=float, default=0.1)
    p.add_argument("--long-share-trough", type=float, default=0.5)
    p.add_argument("--blocks", type=int, default=256, help="KV blocks per replica")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--slo-ttft", type=float, default=1.0)
    p.add_argument("--slo-itl", type=float, default=0.1)
    p.add_argument("--target", type=float, default=0.99, help="SLO attainment to tune for")
    p.add_argument("--start-delay", type=float, default=30.0)
    p.add_argument("--decision-period", type=float, default=5.0)
    p.add_argument("--look-back", type=float, default=10.0)
    p.add_argument("--upscale-delay", type=float, default=0.0)
    p.add_argument("--downscale-delay", type=float, default=60.0)
    p.add_argument("--max-replicas", type=int, default=64)
    p.add_argument("--initial-replicas", type=int, default=2)
    p.add_argument("--ongoing-targets", type=float, nargs="+", default=[2, 2.25, 2.5, 2.75, 3, 4])
    p.add_argument("--kv-targets", type=float, nargs="+", default=[0.6, 0.7, 0.8, 0.9])
    p.add_argument(
        "--headrooms", type=float, nargs="+", default=[0.7], help="llm: downscale_headroom"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=2)
    return p.parse_args()


def _run(a: argparse.Namespace, kind: str, knob: float, headroom: float) -> dict[str, Any]:
    workload = day_workload(
        DayWorkloadConfig(
            day_s=a.day_s,
            peak_rate=a.peak_rate,
            peak_to_trough=a.peak_to_trough,
            long_share_peak=a.long_share_peak,
            long_share_trough=a.long_share_trough,
            seed=a.seed,
        )
    )
    bounds = {"min_replicas": 1, "max_replicas": a.max_replicas}
    delays = {"upscale_delay_s": a.upscale_delay, "downscale_delay_s": a.downscale_delay}
    policy: LLMSignalsPolicy | OngoingRequestsPolicy
    if kind == "ongoing":
        policy = OngoingRequestsPolicy(target_ongoing_requests=knob, **bounds, **delays)
    else:
        targets = SignalTargets(
            kv_cache_usage=knob, batch_fraction=knob, downscale_headroom=headroom
        )
        slo = SloTargets(ttft_p90_s=a.slo_ttft, itl_p90_s=a.slo_itl)
        policy = LLMSignalsPolicy(
            AutoscalingPolicyConfig(**bounds, **delays, slo=slo, targets=targets)
        )
    sim = AutoscaleSim(
        SimConfig(
            scheduler=SchedulerConfig(
                num_gpu_blocks=a.blocks,
                max_num_seqs=a.max_num_seqs,
                max_model_len=a.blocks * 16,
            ),
            keep_itl=False,
        ),
        load_profile(a.profile),
        policy,
        AutoscaleConfig(
            decision_period_s=a.decision_period,
            look_back_s=a.look_back,
            start_delay_s=a.start_delay,
            initial_replicas=a.initial_replicas,
        ),
    )
    t0 = time.perf_counter()
    out = sim.run_day(workload)
    summary = out.result.summary(a.slo_ttft, a.slo_itl)
    return {
        "policy": kind,
        "knob": knob,
        "headroom": headroom,
        "requests": len(workload),
        # Scaled to a real day: the compressed day's replica-hours times the compression.
        "replica_hours_day": out.replica_hours * 86400 / a.day_s,
        "attainment": out.slo_attainment(a.slo_ttft, a.slo_itl),
        "ttft_p90_s": summary["ttft_p90_s"],
        "itl_p90_s": summary["itl_p90_s"],
        "peak_replicas": max(billed for _, _, billed in out.timeline),
        "changes": sum(out.decisions.values()),
        "reasons": dict(out.decisions.most_common()),
        "wall_s": time.perf_counter() - t0,
    }


def _row(r: dict[str, Any]) -> str:
    if r["policy"] == "ongoing":
        knob = f"target_ongoing_requests {r['knob']:g}"
    else:
        knob = f"kv/batch target {r['knob']:g}, headroom {r['headroom']:g}"
    return (
        f"| {r['policy']} | {knob} | {r['replica_hours_day']:.1f} | "
        f"{r['attainment'] * 100:.2f}% | {r['ttft_p90_s']:.3f} | {r['itl_p90_s'] * 1000:.1f} | "
        f"{r['peak_replicas']} | {r['changes']} | {r['wall_s']:.0f} |"
    )


def main() -> None:
    a = _args()
    print(
        f"# autoscaling, simulated: profile {a.profile}, day compressed to {a.day_s:g} s "
        f"({86400 / a.day_s:g}x), peak {a.peak_rate:g} req/s, peak:trough {a.peak_to_trough:g}, "
        f"long share {a.long_share_peak:g} at peak / {a.long_share_trough:g} at trough, "
        f"{a.blocks} KV blocks and max_num_seqs {a.max_num_seqs} per replica; SLO TTFT "
        f"{a.slo_ttft:g} s and ITL p90 {a.slo_itl * 1000:g} ms per request, target "
        f"{a.target:.0%}; start delay {a.start_delay:g} s, decisions every "
        f"{a.decision_period:g} s over {a.look_back:g} s, upscale/downscale delay "
        f"{a.upscale_delay:g}/{a.downscale_delay:g} s"
    )
    print("llm policy's other targets:", dataclasses.asdict(SignalTargets()), flush=True)
    jobs = [("ongoing", t, 0.0) for t in a.ongoing_targets]
    jobs += [("llm", k, h) for k in a.kv_targets for h in a.headrooms]
    rows = []
    with ProcessPoolExecutor(max_workers=a.jobs) as pool:
        for future in as_completed([pool.submit(_run, a, *job) for job in jobs]):
            rows.append(future.result())
            print("done:", _row(rows[-1]), flush=True)
    rows.sort(key=lambda r: (r["policy"] != "ongoing", r["knob"], r["headroom"]))
    print(
        "\n| policy | setting | replica-hours per day | SLO attainment | TTFT p90 (s) | "
        "ITL p90 (ms) | peak replicas | count changes | wall (s) |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(_row(r))
    print()
    for r in rows:
        print(r["policy"], r["knob"], r["headroom"], "changes by reason:", r["reasons"])
    tuned: dict[str, dict[str, Any]] = {}
    for kind in ("ongoing", "llm"):
        ok = [r for r in rows if r["policy"] == kind and r["attainment"] >= a.target]
        if ok:
            tuned[kind] = min(ok, key=lambda r: r["replica_hours_day"])
        print(f"tuned {kind}:", _row(tuned[kind]) if ok else "none meets the target")
    if len(tuned) == 2:
        saving = 1 - tuned["llm"]["replica_hours_day"] / tuned["ongoing"]["replica_hours_day"]
        print(
            f"llm signals use {saving:.1%} fewer replica-hours than ongoing requests, both >= "
            f"{a.target:.0%} SLO attainment"
        )


if __name__ == "__main__":
    main()
