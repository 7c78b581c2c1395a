"""The pipeline bubble: each stage's idle fraction at steady decode, from per-stage timestamps,
with pipeline micro-batches (one step in flight per stage) and without (one step at a time).

An engine with pipeline_parallel_size stages (one spawned process per rank, CPU by default) runs a
batch of requests through their prefill, then `--steps` decode tokens per request (engine steps
x micro-batches). Every rank
records, per step, when it entered and left the step and how long it sat blocked on another stage
(receiving the previous stage's hidden states, or handing its own to the next). A stage's busy
time is a step's span less those waits; its idle fraction is 1 - busy / the window (its first
measured step's start to its last one's end), so time with no step to run counts as idle too.
Micro-batching off is the engine with one step in flight (engine.core.micro_batches patched to
1: a bench's switch, not a setting). Both runs share the machine's load; compare them within one
invocation.

Beside the idle fraction, each rank's busy milliseconds and thread CPU milliseconds per step, and
the idle the stages' imbalance alone forces on it (1 - its CPU time / the busiest stage's): with
a step in flight per stage the busiest stage sets the pace, so a lighter stage idles at least
that much whatever the engine does. CPU time, because on a shared machine a busy span also holds
the time a rank waited for a core (a blocked receive spends none). From the same figures, the
pipeline_layer_split that would even the stages out, and the LM head and sampling's weight in
layers as measured against the figure the default split uses (without `--split` the engine
splits by that figure: workers/pipeline_cost.py). The engine's turnaround is timed in the
engine process: from a step's output collected to the next step posted (update and schedule
between).

    python bench/pipeline_bubble.py [--model default] [--stages 2] [--requests 16]
        [--prompt-len 32] [--steps 48] [--threads 1] [--quantization auto] [--split 19,11]
        [--micro-batches both|on|off]
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


Span = tuple[float, float, float, float]  # (start, end, waited, thread CPU seconds) of a step


@dataclass(slots=True)
class StageClock:
    """One rank's step spans and the seconds it waited inside each."""

    spans: list[Span] = field(default_factory=list)
    waited: float = 0.0
    since: float = 0.0  # spans that started before the last reset are not measured


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
    pipeline.send_hidden = waiting(pipeline.send_hidden)  # blocks until the next stage takes it
    step = runner.execute_model

    def timed_step(out: Any) -> Any:
        _CLOCK.waited, t0, cpu = 0.0, time.perf_counter(), time.thread_time()
        result = step(out)
        _CLOCK.spans.append((t0, time.perf_counter(), _CLOCK.waited, time.thread_time() - cpu))
        return result

    runner.execute_model = timed_step
    return os.getpid()


def reset(runner: Any) -> None:
    """Called between engine steps, while steps may still be in flight on the ranks."""
    _CLOCK.since = time.perf_counter()


def read(runner: Any) -> list[Span]:
    return [span for span in _CLOCK.spans if span[0] >= _CLOCK.since]


def stage_layers(runner: Any) -> int:
    """In a rank's process: the decoder layers its stage holds."""
    from workers.pipeline import current_stage

    stage = current_stage()
    assert stage.end is not None  # fixed before the model was built
    return stage.end - stage.start


def model_costs(runner: Any) -> tuple[float, int]:
    """In a rank's process: what the default split weighs (workers/pipeline_cost.py): a mean
    layer (its weights and LAYER_OVERHEAD) and the last stage's head and sampling, in weights
    read per step."""
    from transformers import AutoConfig

    from workers.pipeline_cost import decode_costs

    costs = decode_costs(AutoConfig.from_pretrained(runner.config.model_dir).get_text_config())
    return sum(costs.layers) / len(costs.layers), costs.last


def suggested_split(cpu_s: list[float], layers: list[int]) -> tuple[list[int], float, float]:
    """The library's cheapest split (workers/pipeline_split.py) over measured costs instead of
    weights: a layer costing what one of stage 0's does (it holds layers and an embedding lookup)
    and the last stage's surplus being its LM head and sampling. Also returns (a layer's seconds,
    the surplus's)."""
    from workers.pipeline_split import StageCosts, cheapest_split

    per_layer = cpu_s[0] / layers[0]
    head = max(0.0, cpu_s[-1] - per_layer * layers[-1])
    micros = StageCosts((round(per_layer * 1e6),) * sum(layers), last=round(head * 1e6))
    return cheapest_split(micros, len(layers)), per_layer, head


@dataclass(frozen=True, slots=True)
class StageFigures:
    idle: float  # fraction of the window
    step_s: float  # the window / its steps
    busy_s: float  # mean per step: the span less its waits for other stages
    cpu_s: float  # mean thread CPU time per step


def stage_figures(spans: list[Span]) -> StageFigures:
    window = spans[-1][1] - spans[0][0]
    busy = sum(end - start - waited for start, end, waited, _ in spans)
    cpu = sum(span[3] for span in spans)
    n = len(spans)
    return StageFigures(1 - busy / window, window / n, busy / n, cpu / n)


class Turnaround:
    """In the engine process: each collected step's end, each posted step's start."""

    def __init__(self, executor: Any) -> None:
        self.collected: list[float] = []
        self.posted: list[float] = []
        collect, post = executor.collect_step, executor.post_step

        def timed_collect() -> Any:
            result = collect()
            self.collected.append(time.perf_counter())
            return result

        def timed_post(out: Any) -> None:
            self.posted.append(time.perf_counter())
            post(out)

        executor.collect_step, executor.post_step = timed_collect, timed_post

    def median_s(self) -> float:
        """Median of: a step collected -> the first post after it."""
        gaps = []
        for done in self.collected:
            later = [p for p in self.posted if p > done]
            if later:
                gaps.append(later[0] - done)
        return statistics.median(gaps) if gaps else math.nan

    def hops_s(self, first: list[Span], last: list[Span]) -> tuple[float, float]:
        """Medians of the hand-offs around the engine (perf_counter is the system's monotonic
        clock, shared by the processes): the last stage done with a step -> its output collected,
        and a step posted -> stage 0 starting it, where stage 0 had nothing to run when it came."""
        answered = []
        for done in self.collected:
            ends = [span[1] for span in last if span[1] <= done]
            if ends:
                answered.append(done - ends[-1])
        started = []
        for before, span in itertools.pairwise(first):
            posts = [p for p in self.posted if before[1] <= p <= span[0]]
            if posts:
                started.append(span[0] - posts[-1])
        return _median(answered), _median(started)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def measure(args: argparse.Namespace, micro_batched: bool) -> None:
    """One engine, its warm-up, `--steps` measured steps; prints throughput and each rank's idle
    fraction."""
    import engine.core
    from engine.llm import LLM
    from engine.pipeline_config import micro_batches
    from scheduler import EngineRequest, SamplingParams

    engine.core.micro_batches = micro_batches if micro_batched else (lambda config: 1)
    llm = LLM(
        model=args.model,
        device="cpu",
        load_progress=False,
        pipeline_parallel_size=args.stages,
        cpu_threads=args.threads,
        quantization=args.quantization,
        pipeline_layer_split=[int(n) for n in args.split.split(",")] if args.split else None,
        max_model_len=args.prompt_len + args.steps + 32,
    )
    core = llm.engine
    load_before = os.getloadavg()[0]
    try:
        pids = core.executor.call_ranks(install)
        params = SamplingParams(max_tokens=args.steps + 16, temperature=0.0, ignore_eos=True)
        for i in range(args.requests):
            prompt = [100 + (7 * i + 13 * j) % 20000 for j in range(args.prompt_len)]
            core.add_request(EngineRequest(f"r{i}", prompt, params))
        for _ in range(4 * args.stages):  # the prefills and the first decodes
            core.step()
        core.executor.call_ranks(reset)
        turnaround = Turnaround(core.executor)
        depth = args.stages if micro_batched else 1
        # An engine step runs one micro-batch (1/depth of the requests): depth x the steps makes
        # the same number of tokens in both runs.
        t0, tokens = time.perf_counter(), 0
        for _ in range(args.steps * depth):
            tokens += sum(len(out.new_token_ids) for out in core.step())
        wall = time.perf_counter() - t0
        spans = core.executor.call_ranks(read)
        layers = core.executor.call_ranks(stage_layers)
        layer_weights, head_weights = core.executor.call_ranks(model_costs)[-1]
    finally:
        llm.shutdown()
    steps = args.steps * depth
    print(f"micro_batches={depth}: {steps} engine steps, {tokens} tokens in {wall:.3f}s")
    print(f"  {tokens / wall:.1f} tokens/s, {wall / steps * 1e3:.1f} ms per engine step")
    answered, started = turnaround.hops_s(spans[0], spans[-1])
    print(
        f"  engine turnaround (collected -> next posted) median {turnaround.median_s() * 1e3:.2f} "
        f"ms; last stage done -> collected {answered * 1e3:.2f} ms; posted -> idle stage 0 "
        f"starts {started * 1e3:.2f} ms"
    )
    print(f"  load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    figures = [stage_figures(rank_spans) for rank_spans in spans]
    busiest = max(f.cpu_s for f in figures)
    print("  rank stage pid    idle_fraction  mean_step_ms  busy_ms  cpu_ms  imbalance_idle")
    for rank, (pid, f) in enumerate(zip(pids, figures, strict=True)):
        print(
            f"  {rank:4d} {rank:5d} {pid:6d} {f.idle:14.3f} {f.step_s * 1e3:13.1f} "
            f"{f.busy_s * 1e3:8.1f} {f.cpu_s * 1e3:7.1f} {1 - f.cpu_s / busiest:15.3f}"
        )
    split, per_layer, head = suggested_split([f.cpu_s for f in figures], layers)
    print(
        f"  layers {','.join(map(str, layers))}: a layer {per_layer * 1e3:.2f} ms, the last "
        f"stage's head and sampling {head * 1e3:.1f} ms (CPU); even at --split "
        f"{','.join(map(str, split))}"
    )
    print(
        f"  the head and sampling weigh {head / per_layer:.1f} layers measured (CPU), "
        f"{head_weights / layer_weights:.1f} in the default split's figures (pipeline_cost.py)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--quantization", default="auto", help="EngineConfig.quantization")
    parser.add_argument(
        "--split", default=None, help="pipeline_layer_split, e.g. 17,13 (default: by cost)"
    )
    parser.add_argument("--micro-batches", choices=("both", "on", "off"), default="both")
    args = parser.parse_args()
    print(
        f"model={args.model} stages={args.stages} requests={args.requests} "
        f"prompt_len={args.prompt_len} steps={args.steps} threads/rank={args.threads} "
        f"split={args.split or 'default'} quantization={args.quantization} "
        f"cpus={os.cpu_count()}"
    )
    runs = {"both": (False, True), "on": (True,), "off": (False,)}[args.micro_batches]
    for micro_batched in runs:
        measure(args, micro_batched)
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
