"""Speculation step by step: what a verify step costs against a plain one, and the ceiling.

Runs the plain and the n-gram engine (the embedded SmolLM2-135M, `--quantization`, default
`auto`: its Q4_1 blocks through the int8 kernel and the layer driver) on bench/spec_bench.py's
copy prompt (`rewrite`, batch 1, greedy), `--repeats` times each, interleaved, and times every
engine step by the thread's CPU time (`--cpu-threads`, default 1, so that one thread's time is
the whole step's; steadier than the wall clock on a shared machine). For the best run of each:
the steps by kind (prefill, one-row, verify with its rows and emitted tokens), a verify step's
median cost against a plain decode step's, and the speedup the n-gram engine would reach if its
verify steps cost 1.2x, 1.1x or exactly a plain step, everything else as measured: the ceiling
that the workload's share of copyable tokens sets at this k.

    python bench/spec_steps.py [--num-tokens 4] [--max-tokens 96] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.spec_bench import chat_prompts, rewrite_prompts
from engine.llm import LLM
from scheduler import SamplingParams
from workers.layers.backends.cpu_driver import LayerDriver

Step = tuple[float, int, int]  # thread CPU ms, the layer driver's rows (0: none), tokens emitted
driver_rows: list[int] = []


def count_driver_rows() -> None:
    call = LayerDriver.__call__

    def counted(self, x, positions, meta):  # type: ignore[no-untyped-def]
        driver_rows.append(x.shape[0])
        return call(self, x, positions, meta)

    LayerDriver.__call__ = counted  # type: ignore[method-assign]


def trace(llm: LLM) -> list[Step]:
    """Wrap the engine's step; the list it appends one Step to per call."""
    log: list[Step] = []
    step = llm.engine.step

    def traced():  # type: ignore[no-untyped-def]
        driver_rows.clear()
        t = time.thread_time_ns()
        out = step()
        ms = (time.thread_time_ns() - t) / 1e6
        rows = driver_rows[0] if driver_rows else 0
        log.append((ms, rows, sum(len(o.new_token_ids) for o in out)))
        return out

    llm.engine.step = traced  # type: ignore[method-assign]
    return log


def best_runs(engines: dict[str, LLM], repeats: int, params: SamplingParams) -> dict[str, tuple]:
    """Per engine, the (CPU ms, steps, tokens) of its cheapest run; the engines alternate."""
    logs = {name: trace(llm) for name, llm in engines.items()}
    best: dict[str, tuple] = {}
    for _ in range(repeats):
        for name, llm in engines.items():
            logs[name].clear()
            tokens = llm.chat(rewrite_prompts(1), params, use_tqdm=False)[0].token_ids
            total = sum(s[0] for s in logs[name])
            if name not in best or total < best[name][0]:
                best[name] = (total, list(logs[name]), tokens)
    return best


def report(best: dict[str, tuple]) -> None:
    plain_ms, plain_steps, plain_tokens = best["plain"]
    spec_ms, steps, spec_tokens = best["spec"]
    p = statistics.median(s[0] for s in plain_steps if s[1] == 1)
    verify = [s for s in steps if s[1] > 1]
    one = [s for s in steps if s[1] == 1]
    v = statistics.median(s[0] for s in verify) if verify else float("nan")
    print(f"tokens identical: {plain_tokens == spec_tokens}")
    print(f"plain: {len(plain_steps)} steps, {plain_ms:.1f} ms; decode step median {p:.2f} ms")
    print(
        f"n-gram: {len(steps)} steps, {spec_ms:.1f} ms: {len(steps) - len(one) - len(verify)} "
        f"prefill, {len(one)} one-row, {len(verify)} verify (rows {[s[1] for s in verify]}, "
        f"tokens {[s[2] for s in verify]})"
    )
    print(f"verify step median {v:.2f} ms = {v / p:.2f}x a plain decode step")
    if one:  # the same kind of step as plain's: a gap here is noise or the proposer's cost
        print(f"its one-row steps median {statistics.median(s[0] for s in one):.2f} ms")
    print(f"speedup by CPU time: {plain_ms / spec_ms:.2f}x")
    rest = spec_ms - sum(s[0] for s in verify)
    for cost in (v / p, 1.2, 1.1, 1.0):
        ceiling = plain_ms / (rest + len(verify) * cost * p)
        print(f"  if a verify step cost {cost:.2f}x a plain one: {ceiling:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--num-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpu-threads", type=int, default=1)
    args = parser.parse_args()
    common = dict(
        model="default",
        device="cpu",
        load_progress=False,
        quantization=args.quantization,
        cpu_threads=args.cpu_threads,
    )
    spec = {"method": "ngram", "num_tokens": args.num_tokens, "ngram_min": 2}
    engines = {"plain": LLM(**common), "spec": LLM(**common, speculative=spec)}
    count_driver_rows()
    for llm in engines.values():  # warm-up: allocator, kernels
        llm.chat(chat_prompts(2), SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    best = best_runs(engines, args.repeats, params)
    print(
        f"SmolLM2-135M, quantization {args.quantization}, copy prompt, batch 1, k "
        f"{args.num_tokens}, {args.cpu_threads} thread(s), thread CPU time, best of "
        f"{args.repeats}; load average {os.getloadavg()[0]:.1f}"
    )
    report(best)
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
