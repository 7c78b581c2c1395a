"""`python -m sim run|plan|calibrate`: simulate a fleet, size one for SLOs, or fit a device profile."""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

from scheduler import SchedulerConfig
from sim.cost import PROFILE_DIR, load_profile
from sim.plots import plot_rows as _plot
from sim.fleet import FleetSim, SimConfig
from sim.policies import POLICIES, RoutingConfig
from sim.workload import WorkloadConfig, load_trace, synthetic_workload


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default="cpu", help="profile name under sim/profiles or a JSON path")
    p.add_argument("--trace", help="JSONL trace instead of the synthetic workload")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--rate", type=float, default=1.0, help="requests per second")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--tenants", type=int, default=12)
    p.add_argument("--system-prompt-len", type=int, default=256)
    p.add_argument("--question-len", type=_range, default=(16, 16), help="LO,HI tokens")
    p.add_argument("--output-len", type=_range, default=(16, 16), help="LO,HI tokens")
    p.add_argument("--router", choices=POLICIES, nargs="+", default=["prefix_affinity"])
    p.add_argument("--policy", default="fcfs", help="scheduler policy: fcfs | priority | fair")
    p.add_argument("--blocks", type=int, default=1024, help="KV blocks per replica")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--stats-delay", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft", type=float, default=1.0, help="seconds")
    p.add_argument("--slo-itl", type=float, default=0.5, help="seconds")
    p.add_argument("--until", type=float, default=math.inf,
                   help="stop at this simulated second; requests still in flight are left out")
    p.add_argument("--plot", help="PNG path")


def _workload(a: argparse.Namespace):
    if a.trace:
        return load_trace(a.trace)
    return synthetic_workload(WorkloadConfig(
        num_requests=a.requests, rate=a.rate, burstiness=a.burstiness, tenants=a.tenants,
        system_prompt_len=a.system_prompt_len, question_len=a.question_len, output_len=a.output_len, seed=a.seed))


def _simulate(a: argparse.Namespace, replicas: int, router: str, workload) -> dict:
    sched = SchedulerConfig(num_gpu_blocks=a.blocks, max_num_seqs=a.max_num_seqs, policy=a.policy,
                            max_num_batched_tokens=a.max_num_batched_tokens,
                            max_model_len=min(4096, a.blocks * 16))
    cfg = SimConfig(num_replicas=replicas, scheduler=sched, stats_delay_s=a.stats_delay,
                    routing=RoutingConfig(router_policy=router, seed=a.seed))
    t0 = time.perf_counter()
    result = FleetSim(cfg, load_profile(a.profile)).run(workload, until_s=a.until)
    wall = time.perf_counter() - t0
    row = result.summary(a.slo_ttft, a.slo_itl)
    row.update(replicas=replicas, router=router, wall_s=wall, sim_per_wall=row["sim_end_s"] / wall if wall else 0)
    return row


_COLUMNS = ("router", "replicas", "requests", "hit_rate", "ttft_p50_s", "ttft_p90_s", "itl_p90_s",
            "output_tok_s", "goodput_rps", "steps", "sim_per_wall")


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


def cmd_plan(a: argparse.Namespace) -> None:
    """Smallest replica count whose TTFT p90 and ITL p90 meet the SLOs (bisection; load is monotone)."""
    workload = _workload(a)
    rows: list[dict] = []

    def ok(n: int) -> bool:
        row = _simulate(a, n, a.router[0], workload)
        rows.append(row)
        return row["ttft_p90_s"] <= a.slo_ttft and row["itl_p90_s"] <= a.slo_itl

    hi = 1
    while not ok(hi):
        if hi >= a.max_replicas:
            _print_table(rows)
            print(f"no fleet of <= {a.max_replicas} replicas meets the SLOs")
            return
        hi = min(hi * 2, a.max_replicas)
    lo = hi // 2  # known to fail (or 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    rows.sort(key=lambda r: r["replicas"])
    _print_table(rows)
    print(f"plan: {hi} replicas meet TTFT p90 <= {a.slo_ttft}s and ITL p90 <= {a.slo_itl}s at {a.rate} req/s")
    if a.plot:
        _plot(a.plot, rows, "replicas", ("ttft_p90_s", "itl_p90_s"), f"plan at {a.rate} req/s")


def _shape(text: str) -> tuple[int, int]:
    a, sep, b = text.partition(":")
    try:
        return int(a), int(b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B integers, got {text!r}") from None


def cmd_calibrate(a: argparse.Namespace) -> None:
    """Time real engine steps (or refit saved ones), fit a profile, print its held-out error, write it."""
    from sim.fit import samples_from_json

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if a.from_samples:
        if not a.output:
            raise ValueError("output: --from-samples needs --output (the device's default profile is not replaced)")
        data = json.loads(Path(a.from_samples).read_text())
        cal = _refit(data, samples_from_json)
    elif a.random_shape:
        import tempfile

        from tests.random_checkpoint import write_random_checkpoint  # torch, transformers: loaded here only

        with tempfile.TemporaryDirectory() as tmp:
            ckpt = write_random_checkpoint(a.random_shape, str(Path(tmp) / a.random_shape))
            cal = _calibrate(a, ckpt.path, label=f"{a.random_shape}-random")
    else:
        cal = _calibrate(a, a.model, label="")
    profile = profile_json(cal.profile)
    out = Path(a.output or PROFILE_DIR / f"{a.device}.json")
    out.write_text(json.dumps(profile, indent=1) + "\n")
    if a.samples:
        Path(a.samples).write_text(json.dumps(_samples_json(cal), indent=1) + "\n")
    print(json.dumps(profile, indent=1))
    print(cal.report())
    print(f"written to {out}")


def _calibrate(a: argparse.Namespace, model: str, label: str):
    from sim.calibrate import CalibrationConfig, calibrate  # torch loads here only

    cfg = CalibrationConfig(model=model, device=a.device, dtype=a.dtype, threads=a.threads, repeats=a.repeats,
                            prefill=tuple(a.prefill_shapes or ()), decode=tuple(a.decode_shapes or ()),
                            heldout_prefill=tuple(a.heldout_prefill_shapes or ()),
                            heldout_decode=tuple(a.heldout_decode_shapes or ()), budget=a.budget,
                            workload_requests=a.mixed_requests, label=label)
    return calibrate(cfg)


def _samples_json(cal) -> dict:
    from sim.fit import samples_to_json

    p = cal.profile
    return {"name": p.name, "num_params": p.num_params, "weight_bytes": p.weight_bytes, "source": p.source,
            "fit": samples_to_json(cal.fit_samples),
            "heldout": {k: samples_to_json(v) for k, v in cal.heldout.items()}}


def _refit(data: dict, parse):
    """A Calibration refitted from a --samples file (no torch needed)."""
    from sim.calibrate import Calibration
    from sim.fit import fit_coefficients

    if not isinstance(data, dict):
        raise ValueError("samples file: expected a JSON object")
    for key in ("name", "num_params", "weight_bytes", "fit", "heldout"):
        if key not in data:
            raise ValueError(f"samples file, field {key!r}: missing")
    fit = parse(data["fit"])
    source = data.get("source", "").split("; held-out error")[0] + " (refitted from saved samples)"
    profile = fit_coefficients(fit).to_cost_model(data["name"], data["num_params"], data["weight_bytes"], source)
    return Calibration(profile, fit, {k: parse(v) for k, v in data["heldout"].items()})


def profile_json(model) -> dict:
    import dataclasses

    return dataclasses.asdict(model)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sim")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="simulate a fleet and print its figures")
    _add_common(run)
    run.add_argument("--replicas", type=int, nargs="+", default=[2])
    plan = sub.add_parser("plan", help="smallest replica count meeting the SLOs")
    _add_common(plan)
    plan.add_argument("--max-replicas", type=int, default=4096)
    cal = sub.add_parser("calibrate", help="time real engine steps here and fit a profile")
    cal.add_argument("--model", default="default", help='"default" (the embedded SmolLM2) or an HF directory')
    cal.add_argument("--random-shape", help="calibrate a random-weight checkpoint of this shape "
                     "(tests/random_checkpoint.py SHAPES, e.g. smollm2-135m), written to a temporary directory")
    cal.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    cal.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    cal.add_argument("--threads", type=int, help="CPU: torch threads (default: what the process has)")
    cal.add_argument("--repeats", type=int, default=3, help="timed steps per shape (the fit takes the median)")
    cal.add_argument("--budget", type=int, default=0, help="max_num_batched_tokens (default: 2048 cpu, 8192 cuda)")
    cal.add_argument("--mixed-requests", type=int, default=24, help="requests in the held-out mixed batch")
    for kind, meta in (("prefill", "TOKENS:SEQS"), ("decode", "BATCH:CONTEXT")):
        cal.add_argument(f"--{kind}-shapes", type=_shape, nargs="+", metavar=meta, help="fitted (default: a grid)")
        cal.add_argument(f"--heldout-{kind}-shapes", type=_shape, nargs="+", metavar=meta, help="held out")
    cal.add_argument("--output", help="profile JSON path (default sim/profiles/<device>.json)")
    cal.add_argument("--samples", help="also write the timed steps here (JSON), to refit with --from-samples")
    cal.add_argument("--from-samples", help="refit a --samples file instead of timing (no torch needed)")
    a = parser.parse_args(argv)
    try:
        {"run": cmd_run, "plan": cmd_plan, "calibrate": cmd_calibrate}[a.command](a)
    except ValueError as exc:
        parser.exit(2, f"error: {exc}\n")


if __name__ == "__main__":
    main()
