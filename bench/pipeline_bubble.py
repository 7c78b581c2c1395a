"""The pipeline bubble: each stage's idle fraction at steady decode, from per-stage timestamps.

An engine with pipeline_parallel_size stages (one spawned process per rank, CPU by default) runs a
batch of requests through their prefill, then `--steps` decode steps. Every rank records, per
step, when it entered and left the step and how long it sat blocked waiting for another stage
(the previous stage's hidden states, or, on rank 0, the last stage's sampled tokens). A stage's
busy time is a step's span less its waits; its idle fraction is 1 - busy / the window (first
step's start to last step's end), so the engine's own time between steps counts as idle too.

Micro-batching (several batches in flight so the stages overlap) is not built yet: this prints
the figure it has to beat, one batch in flight.

    python bench/pipeline_bubble.py [--model default] [--stages 2] [--requests 16]
        [--prompt-len 32] [--steps 48] [--threads 1] [--quantization auto] [--split 19,11]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(slots=True)
class StageClock:
    """One rank's step spans and the seconds it waited inside each."""

    spans: list[tuple[float, float, float]] = field(default_factory=list)  # (start, end, waited)
    waited: float = 0.0


_CLOCK = StageClock()


def install(runner: Any) -> int:
    """In a rank's process: time its steps and its waits for other stages (a bench's patch of
    the rank's own modules; nothing in the library keeps timestamps)."""
    import workers.pipeline as pipeline

    def waiting(fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _CLOCK.waited += time.perf_counter() - t0

        return timed

    pipeline.recv_hidden = waiting(pipeline.recv_hidden)
    step = runner.execute_model

    def timed_step(out: Any) -> Any:
        _CLOCK.waited, t0 = 0.0, time.perf_counter()
        result = step(out)
        _CLOCK.spans.append((t0, time.perf_counter(), _CLOCK.waited))
        return result

    runner.execute_model = timed_step
    return os.getpid()


def reset(runner: Any) -> None:
    _CLOCK.spans.clear()


def read(runner: Any) -> list[tuple[float, float, float]]:
    return list(_CLOCK.spans)


def idle_fraction(spans: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(idle fraction over the window, mean step span in seconds)."""
    window = spans[-1][1] - spans[0][0]
    busy = sum(end - start - waited for start, end, waited in spans)
    return 1 - busy / window, window / len(spans)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--quantization", default="auto", help="EngineConfig.quantization")
    parser.add_argument("--split", default=None, help="pipeline_layer_split, e.g. 19,11")
    args = parser.parse_args()

    from engine.llm import LLM
    from scheduler import EngineRequest, SamplingParams

    llm = LLM(
        model=args.model,
        device="cpu",
        load_progress=False,
        pipeline_parallel_size=args.stages,
        cpu_threads=args.threads,
        quantization=args.quantization,
        pipeline_layer_split=[int(n) for n in args.split.split(",")] if args.split else None,
        max_model_len=args.prompt_len + args.steps + 16,
    )
    engine = llm.engine
    try:
        pids = engine.executor.call_ranks(install)
        params = SamplingParams(max_tokens=args.steps + 8, temperature=0.0, ignore_eos=True)
        for i in range(args.requests):
            prompt = [100 + (7 * i + 13 * j) % 20000 for j in range(args.prompt_len)]
            engine.add_request(EngineRequest(f"r{i}", prompt, params))
        for _ in range(4):  # the prefills and the first decodes
            engine.step()
        engine.executor.call_ranks(reset)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        wall = time.perf_counter() - t0
        spans = engine.executor.call_ranks(read)
    finally:
        llm.shutdown()
    print(
        f"model={args.model} stages={args.stages} requests={args.requests} "
        f"prompt_len={args.prompt_len} decode_steps={args.steps} threads/rank={args.threads} "
        f"split={args.split or 'balanced'} quantization={args.quantization} "
        f"cpus={os.cpu_count()} micro_batches=1 (micro-batching not built)"
    )
    print(f"engine wall {wall:.3f}s, {wall / args.steps * 1e3:.1f} ms/step")
    print("rank stage pid    idle_fraction  mean_step_ms")
    for rank, (pid, rank_spans) in enumerate(zip(pids, spans, strict=True)):
        idle, step_s = idle_fraction(rank_spans)
        print(f"{rank:4d} {rank:5d} {pid:6d} {idle:14.3f} {step_s * 1e3:13.1f}")


if __name__ == "__main__":
    main()
