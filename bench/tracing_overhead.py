"""CPU time per engine step with tracing off vs on (every request traced), and what the replica
then spends turning one request's record into spans.

The engine is a real EngineCore on a random two-layer Llama; its executor answers each step with
one token per request without running the model (`--model` runs it), so the step's own work
(schedule, update, the tracer's hooks) is what is timed. Off, the tracer is never called (one
truth test a step); on, every running request is watched, as for a sampled request. Timed with
process_time over many steps, off and on interleaved round by round, so the machine's load falls
on both alike.

    python -m bench.tracing_overhead [--requests 64] [--steps 400] [--rounds 5] [--model]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.executor import LocalExecutor
from scheduler import EngineRequest, ModelRunnerOutput, SamplingParams, SchedulerOutput
from workers.runner import RunnerConfig

PROMPT_LEN = 64


class OneTokenExecutor(LocalExecutor):
    """The local executor for the KV pool; each step samples token 1 for every request that
    reached the end of what it must compute, without running the model."""

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        ids = list(out.num_scheduled_tokens)
        return ModelRunnerOutput(ids, [[1] for _ in ids])


def build(model_dir: str, requests: int, run_model: bool) -> EngineCore:
    def factory(config: EngineConfig, runner_config: RunnerConfig) -> LocalExecutor:
        cls = LocalExecutor if run_model else OneTokenExecutor
        return cls(runner_config)

    config = EngineConfig.from_kwargs(
        model=model_dir,
        device="cpu",
        load_progress=False,
        num_gpu_blocks=requests * 40,
        max_model_len=512,
        max_num_seqs=requests,
        max_num_batched_tokens=requests * PROMPT_LEN,
    )
    return EngineCore(config, factory)


def start(engine: EngineCore, tag: str, requests: int, traced: bool) -> list[str]:
    """`requests` requests in steady decode (their prefill done), watched by the tracer or not."""
    params = SamplingParams(max_tokens=440, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(requests)]
    for i, rid in enumerate(ids):
        if traced:
            engine.tracer.watch(rid, time.time_ns())
        prompt = [(i * 7919 + j) % 1000 + 3 for j in range(PROMPT_LEN)]
        engine.add_request(EngineRequest(rid, prompt, params))
    engine.step()  # every prompt in one step
    return ids


def time_steps(engine: EngineCore, steps: int) -> float:
    """Mean CPU microseconds per step over `steps` decode steps."""
    gc.collect()
    began = time.process_time()
    for _ in range(steps):
        engine.step()
    return (time.process_time() - began) / steps * 1e6


def round_trip(engine: EngineCore, args: argparse.Namespace, r: int, traced: bool) -> float:
    ids = start(engine, f"r{r}-{int(traced)}", args.requests, traced)
    per_step = time_steps(engine, args.steps)
    engine.abort_requests(ids)
    for rid in ids:
        engine.tracer.pop(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return per_step


def span_cost(engine: EngineCore, args: argparse.Namespace) -> float:
    """CPU microseconds the replica spends building one finished request's spans (off the
    engine thread; spans go to a discarding exporter)."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from cluster.tracing import (
        ReplicaSide,
        TraceContext,
        TracingConfig,
        record_replica,
        use_exporter,
    )

    class Discard(SpanExporter):
        def export(self, spans):  # type: ignore[no-untyped-def]
            return SpanExportResult.SUCCESS

    config = TracingConfig(otlp_endpoint="http://127.0.0.1:9/v1/traces")
    use_exporter(config, Discard())
    trace = TraceContext(f"00-{'a' * 32}-{'b' * 16}-01", config)
    ids = start(engine, "spans", 1, traced=True)
    for _ in range(64):
        engine.step()
    engine.abort_requests(ids)
    record = engine.tracer.pop(ids[0])
    assert record is not None
    side = ReplicaSide("r", ids[0], PROMPT_LEN, 64, "whole", "tiers")
    began = time.process_time()
    for _ in range(200):
        record_replica(trace, side, record, time.time_ns())
    return (time.process_time() - began) / 200 * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", action="store_true", help="run the tiny model in each step")
    args = parser.parse_args()
    from tests.random_checkpoint import TINY_SERVED_LLAMA, write_random_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_checkpoint(TINY_SERVED_LLAMA, tmp).path
        engine = build(model_dir, args.requests, args.model)
        round_trip(engine, args, -1, traced=True)  # warm-up
        off, on = [], []
        for r in range(args.rounds):
            off.append(round_trip(engine, args, r, traced=False))
            on.append(round_trip(engine, args, r, traced=True))
        spans_us = span_cost(engine, args)
        engine.shutdown()
    report(args, off, on, spans_us)


def report(args: argparse.Namespace, off: list[float], on: list[float], spans_us: float) -> None:
    what = "tiny model" if args.model else "engine only (model not run)"
    print(f"{what}: {args.requests} decoding requests, {args.steps} steps x {args.rounds} rounds")
    print("CPU us per step, each round:")
    print("  off: " + " ".join(f"{x:.0f}" for x in off))
    print("  on:  " + " ".join(f"{x:.0f}" for x in on))
    med_off, med_on = statistics.median(off), statistics.median(on)
    print(f"median: off {med_off:.0f} us, on {med_on:.0f} us, on/off {med_on / med_off:.3f}")
    per_req = (med_on - med_off) / args.requests
    print(f"traced: {per_req:.2f} us per traced request per step")
    print(f"spans of one finished request (replica, off the engine thread): {spans_us:.0f} us")


if __name__ == "__main__":
    main()
