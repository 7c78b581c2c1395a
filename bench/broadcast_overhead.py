"""Control-plane cost per engine step: schedule, broadcast to the TP workers, collect rank 0's
output.

The workers run a no-op model (one token per scheduled request, no forward), so what is timed is
the scheduler plus the executor's round trip, at TP = 1, 2 and 4, over each step transport (the
TCP step channel, a Ray Compiled Graph, plain actor calls); an empty compiled-graph round trip (no
scheduler, no payload) gives the floor that Ray's own channels set on this machine. The same run
measures a SmolLM2-135M decode step at batch 32 in-process and
prints each overhead as a fraction of it. Figures only; nothing here passes or fails on timing.

    RAY_AUTH_MODE=disabled python bench/broadcast_overhead.py [--steps 500] [--tp 1,2,4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray
import torch

from cluster.ray_executor import (
    RayExecutor,
    RayWorker,
)
from engine.config import EngineConfig
from engine.executor import LocalExecutor
from scheduler import (
    EngineRequest,
    ModelRunnerOutput,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from scheduler.outputs import SchedulerOutput
from workers.model_files import resolve_model
from workers.options import STEP_TRANSPORTS

BATCH = 32
PROMPT_LEN = 64
MAX_MODEL_LEN = 2048


class NoModelWorker(RayWorker):
    """A rank without a model: answers each step with one token per scheduled request."""

    def load_model(self) -> None:
        pass

    def determine_num_blocks(self) -> int:
        return 1 << 16

    def init_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        pass

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        if self.rank != 0:
            return None
        req_ids = list(scheduler_output.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids, [[7] for _ in req_ids])


class Echo:
    """An actor that answers at once: the floor of a compiled-graph round trip on this machine."""

    def step(self, payload: int) -> int:
        return payload


def empty_round_trip(tp: int, num_steps: int) -> list[float]:
    """Seconds per compiled-graph round trip to tp idle actors, with no scheduler and no payload."""
    from ray.dag import InputNode, MultiOutputNode

    actors = [ray.remote(num_cpus=1)(Echo).remote() for _ in range(tp)]
    ray.get([a.step.remote(0) for a in actors])  # started before the graph is compiled
    with InputNode() as inp:
        dag = MultiOutputNode([a.step.bind(inp) for a in actors]).experimental_compile()
    times = []
    try:
        for i in range(num_steps + 20):
            t0 = time.perf_counter()
            ray.get(dag.execute(i), timeout=60)
            if i >= 20:
                times.append(time.perf_counter() - t0)
    finally:
        dag.teardown()
        for a in actors:
            ray.kill(a)
    return times


def decode_scheduler(num_steps: int) -> Scheduler:
    """BATCH requests whose prompts are already prefilled after one step; then pure decode."""
    config = SchedulerConfig(
        num_gpu_blocks=BATCH * (MAX_MODEL_LEN // 16),
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=BATCH,
        max_num_batched_tokens=BATCH * PROMPT_LEN,
    )
    scheduler = Scheduler(config)
    params = SamplingParams(max_tokens=num_steps + 16, temperature=0.0, ignore_eos=True)
    for i in range(BATCH):
        prompt = [(13 * i + j) % 1000 + 3 for j in range(PROMPT_LEN)]
        scheduler.add_request(Request(EngineRequest(f"r{i}", prompt, params)))
    return scheduler


def time_steps(execute, num_steps: int, warmup: int = 20) -> list[float]:
    """Seconds per step of schedule -> execute -> update_from_output, after the prefill and a
    warm-up."""
    scheduler = decode_scheduler(num_steps + warmup)
    times = []
    for i in range(num_steps + warmup + 1):
        t0 = time.perf_counter()
        step = scheduler.schedule()
        scheduler.update_from_output(step, execute(step))
        if i > warmup:
            times.append(time.perf_counter() - t0)
    return times


def in_process_noop(step: SchedulerOutput) -> ModelRunnerOutput:
    req_ids = list(step.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids, [[7] for _ in req_ids])


def smollm2_decode_step(num_steps: int, threads: int) -> list[float]:
    """A real SmolLM2-135M step at batch 32 (decode), in-process, float32 on CPU."""
    torch.set_num_threads(threads)
    config = EngineConfig(
        device="cpu", load_progress=False, kv_cache_memory_gb=0.5, quantization="none"
    ).runner_config(resolve_model("default"), MAX_MODEL_LEN)
    executor = LocalExecutor(config)
    executor.init_kv_cache(BATCH * (MAX_MODEL_LEN // 16), 0)
    try:
        return time_steps(executor.execute_model, num_steps, warmup=3)
    finally:
        executor.shutdown()


def summary(times: list[float]) -> dict[str, float]:
    us = sorted(t * 1e6 for t in times)
    return {
        "median_us": statistics.median(us),
        "p90_us": us[int(0.9 * (len(us) - 1))],
        "mean_us": statistics.fmean(us),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500, help="timed steps per configuration")
    parser.add_argument("--tp", default="1,2,4", help="tensor-parallel sizes to time")
    parser.add_argument("--model-steps", type=int, default=10, help="timed SmolLM2 decode steps")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the SmolLM2 step")
    parser.add_argument(
        "--transports", default=",".join(STEP_TRANSPORTS), help="step transports to time"
    )
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    tps = [int(t) for t in args.tp.split(",")]

    ray.init(
        num_cpus=max(8, 2 * max(tps)),
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
    )
    config = EngineConfig(device="cpu", load_progress=False, quantization="none").runner_config(
        resolve_model("default"), 4096
    )
    results = {"in-process (scheduler only)": summary(time_steps(in_process_noop, args.steps))}
    for tp in tps:
        results[f"TP={tp} empty graph round trip"] = summary(empty_round_trip(tp, args.steps))
        for transport in args.transports.split(","):
            executor = RayExecutor(config, tp, step_transport=transport, worker_cls=NoModelWorker)
            try:
                executor.init_kv_cache(1, 0)
                times = time_steps(executor.execute_model, args.steps)
            finally:
                executor.shutdown()
            results[f"TP={tp} {transport.replace('_', ' ')}"] = summary(times)
    ray.shutdown()
    model = summary(smollm2_decode_step(args.model_steps, args.threads))

    base = results["in-process (scheduler only)"]["median_us"]
    print(
        f"machine: {os.cpu_count()} cores; batch {BATCH} decode requests; {args.steps} timed "
        "steps each"
    )
    print(
        f"SmolLM2-135M decode step at batch {BATCH} (in-process, {args.threads} thread(s)): "
        f"median {model['median_us'] / 1e3:.1f} ms"
    )
    print(
        f"{'configuration':32s} {'median us':>10s} {'p90 us':>10s} {'minus sched':>12s} "
        f"{'of SmolLM2 step':>16s}"
    )
    for name, r in results.items():
        extra = r["median_us"] - base if "empty" not in name else float("nan")
        print(
            f"{name:32s} {r['median_us']:10.0f} {r['p90_us']:10.0f} {extra:12.0f} "
            f"{r['median_us'] / model['median_us']:15.2%}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "steps": results,
                    "smollm2_decode_step": model,
                    "batch": BATCH,
                    "cores": os.cpu_count(),
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
