"""The simulator against real runs: bench/offline_throughput.py's batch and bench/router_bench.py's
workload.

    python bench/sim_validate.py offline [--profile cpu] [--measure --threads 2 --steps-out FILE]
    python bench/sim_validate.py router [--profile cpu-1t] [--host-cores 2 --background-cores 0.5]

`offline` simulates the 64-request batch (its exact prompt and output lengths, sim/traces/
offline_batch.json) on one replica; with --measure it also runs the real engine on the same
lengths here (torch loads then only) and times each step, so the step counts, the total time and
the per-step error of the profile come from one machine state. `router` rebuilds the router
benchmark's exact arrival sequence (same seed and draws) and simulates its two replicas.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

# Run as a script from anywhere (the GPU machine has the tree, not an install).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from router.config import RoutingConfig
from scheduler import SchedulerConfig
from sim.cost import load_profile
from sim.fleet import FleetSim
from sim.fleet_config import HostConfig, SimConfig
from sim.workload import SimRequest

OFFLINE_TRACE = Path(__file__).resolve().parents[1] / "sim" / "traces" / "offline_batch.json"
# The offline engine's pool: kv_cache_memory_gb (2 GiB) of fp32 SmolLM2 KV, 46,080 B per token, in
# 16-token blocks.
OFFLINE_SCHEDULER = SchedulerConfig(
    num_gpu_blocks=2912,
    num_cpu_blocks=0,
    max_num_seqs=64,
    max_num_batched_tokens=2048,
    max_model_len=8192,
)


def offline_lengths() -> tuple[list[int], list[int]]:
    data = json.loads(OFFLINE_TRACE.read_text())
    return data["prompt_lens"], data["output_lens"]


def offline_workload() -> list[SimRequest]:
    """The bench's 64 requests, all at t=0 in its order (generate() adds them before the first
    step)."""
    prompts, outputs = offline_lengths()
    return [SimRequest(f"r{i}", 0.0, p, o) for i, (p, o) in enumerate(zip(prompts, outputs))]


def simulate_offline(profile: str = "cpu") -> dict:
    result = FleetSim(
        SimConfig(num_replicas=1, scheduler=OFFLINE_SCHEDULER), load_profile(profile)
    ).run(offline_workload())
    tokens = sum(r.num_output_tokens for r in result.records)
    return {
        "steps": result.replicas[0].num_steps,
        "seconds": result.end_s,
        "output_tokens": tokens,
        "output_tok_s": tokens / result.end_s,
    }


def measure_offline(threads: int | None, dtype: str = "float32") -> dict:
    """The real engine (default model, CPU) on the batch's lengths: every step timed as the
    simulator counts it."""
    from calibrate import StepTimer

    from engine.config import EngineConfig
    from engine.core import EngineCore
    from sim.fit import samples_to_json

    sched = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048)
    engine = EngineCore(
        EngineConfig(
            model="default",
            dtype=dtype,
            device="cpu",
            cpu_threads=threads,
            load_progress=False,
            quantization="none",  # the simulator's shipped profiles are the fp32 path's
            scheduler=sched,
        )
    )
    timer = StepTimer(engine, seed=1)
    prompts, outputs = offline_lengths()
    for p, o in zip(prompts[:2], outputs[:2]):  # warm-up, as the bench does
        timer.add(p, o)
    timer.drain()
    for p, o in zip(prompts, outputs):
        timer.add(p, o)
    t0 = time.perf_counter()
    steps = timer.drain()
    wall = time.perf_counter() - t0
    pool = engine.num_gpu_blocks
    engine.shutdown()
    return {
        "steps": len(steps),
        "seconds": wall,
        "step_seconds": sum(s.seconds for s in steps),
        "output_tokens": sum(outputs),
        "output_tok_s": sum(outputs) / wall,
        "num_gpu_blocks": pool,
        "samples": samples_to_json(steps),
    }


def router_bench_workload(
    tenants: int = 12,
    prefix_tokens: int = 256,
    question_tokens: int = 16,
    max_tokens: int = 16,
    requests: int = 120,
    rate: float = 1.0,
    seed: int = 0,
    vocab_low: int = 200,
    vocab_high: int = 40_000,
) -> list[SimRequest]:
    """bench/router_bench.py's Workload.build: the same random draws, so the same arrivals and
    tenants."""
    rng = random.Random(seed)
    for _ in range(tenants * prefix_tokens):  # the system prompts (their tokens are the sim's own)
        rng.randrange(vocab_low, vocab_high)
    at, out = 0.0, []
    for i in range(requests):
        at += rng.expovariate(rate)
        tenant = rng.randrange(tenants)
        for _ in range(question_tokens):
            rng.randrange(vocab_low, vocab_high)
        out.append(
            SimRequest(
                f"r{i}",
                at,
                prefix_tokens + question_tokens,
                max_tokens,
                prefix_group=f"t{tenant}",
                prefix_len=prefix_tokens,
                tenant=f"tenant-{tenant}",
            )
        )
    return out


# Median TTFT the full Serve stack adds over an in-process engine at low load
# (bench/serve_bench.py on the quiet 2-core machine, 2026-11-21: 417.6 -> 431.4 ms).
SERVE_BENCH_OVERHEAD_S = 0.0132
MEASURED_ROUTER_BENCH = Path(__file__).resolve().parent / "results" / "router_bench.json"


def router_bench_config(
    router: str, host: HostConfig, block_size: int = 16, serving_overhead_s: float = 0.0
) -> SimConfig:
    """Two replicas as the bench sizes them: 120 blocks, 16 sequences, 288-token context."""
    blocks = (12 // 2 + 1) * (256 // block_size) + 4 * (
        math.ceil(288 / block_size) - 256 // block_size
    )
    sched = SchedulerConfig(
        num_gpu_blocks=blocks,
        num_cpu_blocks=0,
        max_num_seqs=16,
        max_model_len=288,
        block_size=block_size,
    )
    return SimConfig(
        num_replicas=2,
        scheduler=sched,
        host=host,
        serving_overhead_s=serving_overhead_s,
        routing=RoutingConfig(router_policy=router, imbalance_threshold=4.0, seed=0),
    )


def simulate_router_bench(
    profile: str,
    host: HostConfig,
    routers=("prefix_affinity", "round_robin", "power_of_two"),
    serving_overhead_s: float = 0.0,
) -> list[dict]:
    wl = router_bench_workload()
    rows = []
    for router in routers:
        cfg = router_bench_config(router, host, serving_overhead_s=serving_overhead_s)
        result = FleetSim(cfg, load_profile(profile)).run(wl)
        row = result.summary()
        row["router"] = router
        row["busy_share"] = sum(r.busy_s for r in result.replicas) / (2 * result.end_s)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python bench/sim_validate.py")
    sub = parser.add_subparsers(dest="what", required=True)
    off = sub.add_parser("offline")
    off.add_argument("--profile", nargs="+", default=["cpu"])
    off.add_argument("--measure", action="store_true", help="also run the real engine here (torch)")
    off.add_argument("--threads", type=int, default=2)
    off.add_argument("--steps-out", help="JSON path for the measured steps")
    off.add_argument(
        "--calibrate",
        metavar="PROFILE_PATH",
        help="first fit a profile here on a quick grid (same process, same machine state), write "
        "it to this path and simulate with it too",
    )
    rb = sub.add_parser("router")
    rb.add_argument("--profile", default="cpu")
    rb.add_argument(
        "--host-cores", type=float, default=0.0, help="cores of the one host (0: no sharing)"
    )
    rb.add_argument("--cores-per-replica", type=float, default=1.0)
    rb.add_argument("--background-cores", type=float, nargs="+", default=[0.0])
    rb.add_argument(
        "--measured",
        default=str(MEASURED_ROUTER_BENCH),
        help="bench/router_bench.py's results JSON to compare with ('' for none)",
    )
    rb.add_argument(
        "--serving-overhead",
        type=float,
        default=SERVE_BENCH_OVERHEAD_S,
        help="seconds each request spends in the Serve stack outside the engine (default: "
        "bench/serve_bench.py's quiet-machine median TTFT overhead; 0 leaves it out)",
    )
    a = parser.parse_args(argv)
    try:
        if a.what == "offline":
            _offline(a)
        else:
            _router(a)
    except ValueError as exc:  # a bad profile or host setting: name it, no traceback
        parser.exit(2, f"error: {exc}\n")


def measured_router_bench(path: Path = MEASURED_ROUTER_BENCH) -> dict[str, dict]:
    """The real benchmark's figures by router, from the results file bench/router_bench.py
    writes."""
    try:
        return {r["router"]: r for r in json.loads(path.read_text())["results"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"measured results {str(path)!r}: {exc}") from None


def _router(a: argparse.Namespace) -> None:
    measured = measured_router_bench(Path(a.measured)) if a.measured else {}
    for bg in a.background_cores:
        host = HostConfig(
            replicas_per_host=2,
            cores=a.host_cores,
            cores_per_replica=a.cores_per_replica,
            background_cores=bg,
        )
        for row in simulate_router_bench(a.profile, host, serving_overhead_s=a.serving_overhead):
            print(
                f"{a.profile} host {a.host_cores} cores, background {bg}, overhead "
                f"{a.serving_overhead * 1e3:.1f} ms: "
                f"{row['router']:16s} "
                f"hit {row['hit_rate']:.3f} ttft p50 {row['ttft_p50_s']:.3f} p90 "
                f"{row['ttft_p90_s']:.3f} "
                f"out tok/s {row['output_tok_s']:.1f} busy {row['busy_share']:.2f} steps "
                f"{row['steps']}"
            )
            real = measured.get(row["router"])
            if real is not None:
                print(
                    f"    measured: hit {real['hit_rate']:.3f} "
                    f"({100 * (row['hit_rate'] - real['hit_rate']):+.1f} points)"
                    f" ttft p50 {real['ttft_p50_s']:.3f} "
                    f"({_err(row['ttft_p50_s'], real['ttft_p50_s'])})"
                    f" p90 {real['ttft_p90_s']:.3f} ({_err(row['ttft_p90_s'], real['ttft_p90_s'])})"
                    f" out tok/s {real['output_tok_s']:.1f} "
                    f"({_err(row['output_tok_s'], real['output_tok_s'])})"
                )


def _err(simulated: float, measured: float) -> str:
    return f"{100 * (simulated / measured - 1):+.1f}%" if measured else "n/a"


# A smaller CPU grid than calibrate's default, for fitting and measuring in one run (one machine
# state).
QUICK_CPU_GRID = dict(
    prefill=((16, 1), (64, 1), (256, 1), (1024, 1), (2048, 1), (256, 4)),
    decode=((1, 32), (1, 288), (16, 32), (16, 288), (64, 64)),
    heldout_prefill=((128, 1), (512, 2)),
    heldout_decode=((4, 200), (32, 100)),
)


def _calibrate_here(a: argparse.Namespace) -> str:
    """Fit a profile on the quick grid now, in this process; returns its path."""
    from calibrate import CalibrationConfig, calibrate, profile_json

    cal = calibrate(CalibrationConfig(threads=a.threads, workload_requests=12, **QUICK_CPU_GRID))
    print(cal.report())
    path = Path(a.calibrate)
    path.write_text(json.dumps(profile_json(cal.profile), indent=1) + "\n")
    return str(path)


def _offline(a: argparse.Namespace) -> None:
    from sim.fit import prediction_error, samples_from_json

    measured = None
    if a.calibrate:
        a.profile.append(_calibrate_here(a))
    if a.measure:
        measured = measure_offline(a.threads)
        if a.steps_out:
            Path(a.steps_out).write_text(json.dumps(measured) + "\n")
        print(
            f"measured here: {measured['steps']} steps, {measured['seconds']:.2f} s "
            f"({measured['output_tok_s']:.1f} useful tok/s), pool {measured['num_gpu_blocks']} "
            "blocks"
        )
    for name in a.profile:
        sim = simulate_offline(name)
        line = (
            f"simulated ({name}): {sim['steps']} steps, {sim['seconds']:.2f} s "
            f"({sim['output_tok_s']:.1f} useful tok/s)"
        )
        if measured is not None:
            err = prediction_error(load_profile(name), samples_from_json(measured["samples"]))
            line += f"; per-step error on the measured steps: {err}"
        print(line)


if __name__ == "__main__":
    main()
