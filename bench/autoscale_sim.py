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
`python -m sim plan --autoscale llm ongoing` runs the same replays (sim/autoscale_plan.py) from the
simulator's command line, over several seeds at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

# Run as a script from anywhere, with no install (the simulator needs only the standard library).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from router.autoscaling import SignalTargets, SloTargets
from scheduler import SchedulerConfig
from sim.autoscale import AutoscaleConfig, DayWorkloadConfig
from sim.autoscale_plan import HEADER, DayPlanConfig, saving, sweep, tuned


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
    cfg = DayPlanConfig(
        day=DayWorkloadConfig(
            day_s=a.day_s,
            peak_rate=a.peak_rate,
            peak_to_trough=a.peak_to_trough,
            long_share_peak=a.long_share_peak,
            long_share_trough=a.long_share_trough,
            seed=a.seed,
        ),
        scheduler=SchedulerConfig(
            num_gpu_blocks=a.blocks, max_num_seqs=a.max_num_seqs, max_model_len=a.blocks * 16
        ),
        loop=AutoscaleConfig(
            decision_period_s=a.decision_period,
            look_back_s=a.look_back,
            start_delay_s=a.start_delay,
            initial_replicas=a.initial_replicas,
        ),
        profile=a.profile,
        slo=SloTargets(ttft_p90_s=a.slo_ttft, itl_p90_s=a.slo_itl),
        target=a.target,
        max_replicas=a.max_replicas,
        upscale_delay_s=a.upscale_delay,
        downscale_delay_s=a.downscale_delay,
    )
    settings = [("ongoing", t, 0.0) for t in a.ongoing_targets]
    settings += [("llm", k, h) for k in a.kv_targets for h in a.headrooms]
    rows = sweep(cfg, [a.seed], settings, a.jobs, lambda r: print("done:", r.cells(), flush=True))
    print()
    print(HEADER)
    for r in rows:
        print(r.cells())
    print()
    for r in rows:
        print(r.policy, r.knob, r.headroom, "changes by reason:", r.reasons)
    for kind in ("ongoing", "llm"):
        best = tuned(rows, kind, a.target)
        print(f"tuned {kind}:", best.cells() if best is not None else "none meets the target")
    cut = saving(rows, a.target)
    if cut is not None:
        print(
            f"llm signals use {cut:.1%} fewer replica-hours than ongoing requests, both >= "
            f"{a.target:.0%} SLO attainment"
        )


if __name__ == "__main__":
    main()
