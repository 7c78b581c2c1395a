"""Microseconds per scheduler step (schedule + update_from_output) with N running decode requests.

Workload (as issue 2 fixes it): N requests with distinct 512-token prompts, block size 16, 40,000
GPU blocks, every request in steady decode; the model is replaced by a pre-built runner output so
only the scheduler is timed. For scale: vLLM's V1 scheduler driven the same way on this machine
class took about 2,450 us per step at 256 running requests (9.6 us per request); issue 55 measured
13.59 us in one run beside ours (pass a same-run figure as --vllm-us).

    python bench/scheduler_overhead.py [--steps 60] [--repeats 5] [--vllm-us 9.6]

A/B against another tree (a `git archive` of an earlier commit unpacked in a folder): both trees'
`build` and `time_steps` run in alternating subprocesses, so a shared machine's load falls on
both alike; the medians and their ratio are printed:

    python bench/scheduler_overhead.py --baseline /tmp/base [--rounds 6] [--sizes 256]

With --instructions the A/B counts instructions under valgrind's cachegrind instead of timing: a
shared machine's load does not move them (cache misses are not in them), so a change of a few
percent shows in one run. Each count is a process that builds the scheduler and runs --steps
decode steps, less the same process with none:

    python bench/scheduler_overhead.py --baseline /tmp/base --instructions [--sizes 256]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from scheduler import (
    EngineRequest,
    ModelRunnerOutput,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)

PROMPT_LEN = 512
VLLM_US_PER_REQ_AT_256 = 9.6
TARGET_US_PER_REQ = 3.0


def build(num_running: int, prefix_caching: bool) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_batched_tokens=max(8192, num_running),
        max_num_seqs=num_running,
        block_size=16,
        num_gpu_blocks=40_000,
        max_model_len=PROMPT_LEN + 4096,
        enable_prefix_caching=prefix_caching,
    )
    sched = Scheduler(cfg)
    params = SamplingParams(max_tokens=4096, ignore_eos=True)
    for i in range(num_running):
        prompt = [(i * 7919 + j) % 49_000 for j in range(PROMPT_LEN)]
        sched.add_request(Request(EngineRequest(f"req-{i}", prompt, params, eos_token_ids=(0,))))
    # Drive every request through its prefill into steady decode.
    while True:
        out = sched.schedule()
        ids = [n.req_id for n in out.scheduled_new_reqs] + out.scheduled_cached_reqs.req_ids
        reqs = sched.requests
        sampled = [[1] if reqs[r].num_computed_tokens >= reqs[r].num_tokens else [] for r in ids]
        sched.update_from_output(out, ModelRunnerOutput(ids, sampled))
        if len(ids) == num_running and all(out.num_scheduled_tokens[r] == 1 for r in ids):
            return sched


def time_steps(sched: Scheduler, steps: int) -> float:
    """Mean microseconds of CPU time per schedule() + update_from_output() over `steps` decode
    steps (process time: on a shared machine, other processes' load does not count)."""
    ids = [r.request_id for r in sched.running]
    runner_out = ModelRunnerOutput(ids, [[1]] * len(ids))
    gc.collect()
    gc.disable()
    try:
        start = time.process_time()
        for _ in range(steps):
            out = sched.schedule()
            sched.update_from_output(out, runner_out)
        elapsed = time.process_time() - start
    finally:
        gc.enable()
    assert out.total_num_scheduled_tokens == len(ids), "not every request was in decode"
    return elapsed / steps * 1e6


# A/B: what each subprocess runs, with one tree's packages and that tree's own `build` and
# `time_steps` (so an older tree is timed as its bench timed it); prints JSON medians.
_CHILD = """
import json, statistics, sys
tree, steps, sizes = sys.argv[1], int(sys.argv[2]), [int(n) for n in sys.argv[3:]]
sys.path[:0] = [tree, tree + "/bench"]
import scheduler, scheduler_overhead as bench
assert scheduler.__file__.startswith(tree) and bench.__file__.startswith(tree), scheduler.__file__
out = {}
for n in sizes:
    for prefix in (True, False):
        runs = [bench.time_steps(bench.build(n, prefix), steps) / n for _ in range(3)]
        out[f"{n} {'on' if prefix else 'off'}"] = statistics.median(runs)
print(json.dumps(out))
"""


def compare(baseline: str, sizes: list[int], steps: int, rounds: int) -> None:
    """This tree against `baseline`, alternating subprocesses (3 timings each), medians."""
    trees = {"baseline": str(Path(baseline).resolve()), "this tree": str(Path(__file__).parents[1])}
    runs: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
    for r in range(rounds):
        for name in list(trees)[:: 1 if r % 2 == 0 else -1]:
            cmd = [sys.executable, "-c", _CHILD, trees[name], str(steps), *map(str, sizes)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=trees[name])
            for key, us in json.loads(out.stdout).items():
                runs[name].setdefault(key, []).append(us)
    print(f"load average {os.getloadavg()}; {rounds} rounds; us of CPU per request-step (median)")
    print(f"{'running prefix':>15} {'baseline':>9} {'this tree':>10} {'ratio':>6}  runs")
    for key in runs["baseline"]:
        base, new = (statistics.median(runs[name][key]) for name in trees)
        spread = [[round(x, 2) for x in runs[name][key]] for name in trees]
        print(f"{key:>15} {base:>9.2f} {new:>10.2f} {new / base:>6.3f}  {spread}")


# Under cachegrind: one tree's build, then `steps` decode steps (the same loop as time_steps).
_STEPS_CHILD = """
import sys
tree, n, steps, prefix = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "on"
sys.path[:0] = [tree, tree + "/bench"]
import scheduler_overhead as bench
from scheduler import ModelRunnerOutput
sched = bench.build(n, prefix)
ids = [r.request_id for r in sched.running]
runner_out = ModelRunnerOutput(ids, [[1]] * len(ids))
for _ in range(steps):
    sched.update_from_output(sched.schedule(), runner_out)
"""


def instructions(tree: str, n: int, prefix: bool, steps: int) -> float:
    """Instructions per request-step of `tree` with n running (valgrind's cachegrind)."""
    counts = []
    for k in (0, steps):
        cmd = ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null"]
        cmd += [sys.executable, "-c", _STEPS_CHILD, tree, str(n), str(k), "on" if prefix else "off"]
        env = {**os.environ, "PYTHONHASHSEED": "0"}  # the same dict layouts in every process
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=tree, env=env)
        found = re.search(r"I\s+refs:\s+([\d,]+)", out.stderr)
        if found is None:
            raise RuntimeError(f"cachegrind printed no instruction count: {out.stderr[-400:]}")
        counts.append(int(found.group(1).replace(",", "")))
    return (counts[1] - counts[0]) / steps / n


def compare_instructions(baseline: str, sizes: list[int], steps: int) -> None:
    """This tree against `baseline` by cachegrind's instruction counts."""
    trees = [str(Path(baseline).resolve()), str(Path(__file__).parents[1])]
    print("instructions per request-step (cachegrind)")
    print(f"{'running prefix':>15} {'baseline':>9} {'this tree':>10} {'ratio':>6}")
    for n in sizes:
        for prefix in (True, False):
            base, new = (instructions(tree, n, prefix, steps) for tree in trees)
            key = f"{n} {'on' if prefix else 'off'}"
            print(f"{key:>15} {base:>9.0f} {new:>10.0f} {new / base:>6.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="decode steps per timing")
    parser.add_argument(
        "--repeats", type=int, default=5, help="timings per configuration (median quoted)"
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 256, 1024])
    parser.add_argument("--vllm-us", type=float, default=VLLM_US_PER_REQ_AT_256)
    parser.add_argument("--baseline", help="a tree to compare with (A/B, see above)")
    parser.add_argument("--rounds", type=int, default=6, help="A/B: subprocesses per tree")
    parser.add_argument(
        "--instructions", action="store_true", help="A/B: count instructions (needs valgrind)"
    )
    args = parser.parse_args()
    if args.baseline and args.instructions:
        return compare_instructions(args.baseline, args.sizes, args.steps)
    if args.baseline:
        return compare(args.baseline, args.sizes, args.steps, args.rounds)

    vllm = args.vllm_us
    print(
        f"{'running':>8} {'prefix cache':>12} {'us/step':>10} {'us/request':>11} "
        f"{f'vs vLLM {vllm} us/req':>19}"
    )
    per_req: dict[tuple[int, bool], float] = {}
    for n in args.sizes:
        for prefix in (True, False):
            runs = []
            for _ in range(args.repeats):
                sched = build(n, prefix)
                runs.append(time_steps(sched, args.steps))
            us = statistics.median(runs)
            per_req[(n, prefix)] = us / n
            print(
                f"{n:>8} {'on' if prefix else 'off':>12} {us:>10.1f} {us / n:>11.2f} "
                f"{vllm / (us / n):>18.1f}x"
            )
    small, large = min(args.sizes), max(args.sizes)
    growth = per_req[(large, True)] / per_req[(small, True)]
    print(
        f"\nper-request cost at {large} / at {small} running (prefix cache on): {growth:.2f} "
        f"(1.0 = linear growth of step cost)"
    )
    met = all(
        per_req[(n, p)] <= TARGET_US_PER_REQ for n in args.sizes if n >= 256 for p in (True, False)
    )
    print(
        f"target <= {TARGET_US_PER_REQ} us per running request at 256 and 1024: "
        f"{'met' if met else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
