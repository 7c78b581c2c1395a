"""Where a backed-off n-gram engine's steps go, phase by phase, against plain engines.

spec_bench's sampled chat (temperature 1, top-p 0.95, a seed per request, batch 1) on three engines
in one process: plain, n-gram (the adaptive policy backs it off after its first verify step) and
plain again, created in that order (`--spec-first`: n-gram first) and run in turn `--repeats`
times. Every engine step is split into the scheduler's `_schedule` and `_update`, and the runner's
`_forward` and `_sample` (which holds the n-gram proposals, made after sampling); printed are the
median thread CPU time of each over the decode steps that verified nothing, the verify steps' own
CPU time, and the load average. Two plain engines show what the order or placement of identical
engines does to the forward, which is what a single plain/n-gram pair cannot separate from the cost
of speculation.

    python bench/spec_step_phases.py [--repeats 4] [--max-tokens 96] [--spec-first]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from spec_bench import chat_prompts, sampled

from engine.llm import LLM

SPEC = {"method": "ngram", "num_tokens": 4, "max_batch_size": 4, "ngram_min": 2}
PHASES = ("schedule", "forward", "sample", "update", "step")


def timed(into: list[float], fn: Callable) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        out = fn(*args, **kwargs)
        into.append(time.thread_time() - start)
        return out

    return run


def instrument(llm: LLM) -> dict[str, list[float]]:
    """Per-phase CPU times of every later step; "verify" marks the steps that ran verify rows."""
    times: dict[str, list[float]] = {name: [] for name in (*PHASES, "verify")}
    engine, runner = llm.engine, llm.engine.executor.runner  # type: ignore[attr-defined]
    engine._schedule = timed(times["schedule"], engine._schedule)  # type: ignore[method-assign]
    engine._update = timed(times["update"], engine._update)  # type: ignore[method-assign]
    runner._forward = timed(times["forward"], runner._forward)
    runner._sample = timed(times["sample"], runner._sample)
    step = timed(times["step"], engine.step)

    def marked() -> Any:
        rows = engine.stats().num_spec_verify_rows
        out = step()
        times["verify"].append(float(engine.stats().num_spec_verify_rows > rows))
        return out

    engine.step = marked  # type: ignore[method-assign]
    return times


def summary(times: dict[str, list[float]]) -> str:
    verify = times["verify"]
    plain = {p: [t for t, v in zip(times[p], verify) if not v] for p in PHASES}
    cells = [f"{statistics.median(plain[p]) * 1e3:.3f}" for p in PHASES]
    verify_ms = [f"{t * 1e3:.1f}" for t, v in zip(times["step"], verify) if v]
    return f"{' | '.join(cells)} | {len(plain['step'])} | {', '.join(verify_ms) or '-'}"


def make_engine(speculative: bool) -> LLM:
    return LLM(
        model="default",
        device="cpu",
        load_progress=False,
        cpu_threads=1,
        speculative=SPEC if speculative else None,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--spec-first", action="store_true")
    args = parser.parse_args()
    order = ["ngram", "plain", "plain 2"] if args.spec_first else ["plain", "ngram", "plain 2"]
    engines = {name: make_engine(name == "ngram") for name in order}
    times = {}
    for name, llm in engines.items():
        llm.chat(chat_prompts(2), sampled(2, 8), use_tqdm=False)  # warm-up
        times[name] = instrument(llm)
    print(f"load average at the start: {os.getloadavg()[0]:.1f}")
    for _ in range(args.repeats):
        for llm in engines.values():
            llm.chat(chat_prompts(1), sampled(1, args.max_tokens), use_tqdm=False)
    print(
        "| engine (creation order) | schedule ms | forward ms | sample ms | update ms | step ms | "
        "decode steps | verify steps' ms |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in order:
        print(f"| {name} | {summary(times[name])} |")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
