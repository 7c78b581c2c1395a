"""A decoding neighbour's inter-token latency beside bulk work, offline on one engine.

Three runs on the same engine, each timing the neighbour's gaps between tokens (one token a step)
while it decodes `--neighbour-tokens` tokens:
- solo: nothing else runs;
- beside a 1,900-token prompt with prompt_logprobs=20 (issue 45, finding 3);
- beside an embeddings request of 128 inputs x 2,000 tokens (finding 4); it is aborted once the
  neighbour is done (only the neighbour's latency is measured).
With --no-bulk-share the bulk share is lifted (bulk_tokens_per_step past any budget), which
is how the scheduler behaved before it. Prints medians, p90s and the longest gap, and each as a
ratio to solo, in wall time and in this process's CPU time (all its threads): on a shared
machine the CPU figures are the ones other processes' load does not distort. Figures, never
pass/fail: they depend on the machine.

    python bench/neighbour_latency.py [--model default] [--neighbour-tokens 32] [--no-bulk-share]
                                      [--inputs 128] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

import torch

import scheduler.bulk_budget as bulk_budget
from engine.llm import LLM
from scheduler.request import EngineRequest
from scheduler.sampling_params import SamplingParams

Gaps = dict[str, list[float]]  # "wall" and "cpu" seconds between the neighbour's tokens


def gaps_beside(llm: LLM, bulk: list[EngineRequest], tokens: int) -> Gaps:
    """The neighbour's gaps between consecutive tokens while `bulk` is in the engine."""
    engine = llm.engine
    params = SamplingParams(max_tokens=tokens + 1, temperature=0, ignore_eos=True)
    engine.add_request(EngineRequest("neighbour", list(range(200, 264)), params))
    while not any(o.request_id == "neighbour" and o.new_token_ids for o in engine.step()):
        pass  # its prefill: from its first token on it decodes
    for r in bulk:
        engine.add_request(r)
    gaps: Gaps = {"wall": [], "cpu": []}
    last, done = (time.perf_counter(), time.process_time()), False
    while not done:
        for out in engine.step():
            if out.request_id == "neighbour" and out.new_token_ids:
                now = (time.perf_counter(), time.process_time())
                gaps["wall"].append(now[0] - last[0])
                gaps["cpu"].append(now[1] - last[1])
                last, done = now, out.finished
    engine.abort_requests([r.request_id for r in bulk])
    while engine.has_unfinished_requests():
        engine.step()
    return gaps


def summary(name: str, gaps: Gaps, solo: Gaps | None) -> str:
    lines = []
    for clock in ("wall", "cpu"):
        ms = sorted(g * 1e3 for g in gaps[clock])
        median, p90, worst = statistics.median(ms), ms[int(0.9 * (len(ms) - 1))], ms[-1]
        line = f"{name:<34} {clock:>4} median {median:8.1f} ms  p90 {p90:8.1f}  max {worst:8.1f}"
        if solo is not None:
            base = sorted(g * 1e3 for g in solo[clock])
            ratios = (median / statistics.median(base), p90 / base[int(0.9 * (len(base) - 1))])
            line += f"  ({ratios[0]:.2f}x / {ratios[1]:.2f}x solo median / p90)"
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--neighbour-tokens", type=int, default=32)
    parser.add_argument("--inputs", type=int, default=128, help="embedding inputs")
    parser.add_argument("--no-bulk-share", action="store_true")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0: torch's default); 1 keeps "
        "OpenMP threads from spinning on a busy machine, which inflates the CPU figures",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # --no-bulk-share: a share as large as any budget, so bulk work is never held back.
    lifted = {"bulk_tokens_per_step": 1 << 40} if args.no_bulk_share else {}
    rng = random.Random(45)
    with LLM(args.model, load_progress=False, **lifted) as llm:
        vocab = llm.engine.model_info.vocab_size

        def prompt(n: int) -> list[int]:
            return [rng.randrange(100, vocab - 1) for _ in range(n)]

        sched = llm.engine.config.scheduler
        budget = sched.max_num_batched_tokens
        share = bulk_budget.bulk_share(budget, sched.bulk_tokens_per_step)
        print(f"model {args.model}, max_num_batched_tokens {budget}, bulk share {share}")
        for thread in threading.enumerate():  # the grammar warm-up would count as CPU time
            if thread.name == "grammar-warm":
                thread.join()
        gaps_beside(llm, [], 4)  # warm-up
        solo = gaps_beside(llm, [], args.neighbour_tokens)
        print(summary("solo", solo, None))
        scored = SamplingParams(max_tokens=1, prompt_logprobs=20)
        plp = gaps_beside(llm, [EngineRequest("plp", prompt(1900), scored)], args.neighbour_tokens)
        print(summary("beside prompt_logprobs 1,900 x 20", plp, solo))
        pooled = SamplingParams(max_tokens=1, pooling="mean")
        inputs = [EngineRequest(f"e{i}", prompt(2000), pooled) for i in range(args.inputs)]
        emb = gaps_beside(llm, inputs, args.neighbour_tokens)
        print(summary(f"beside embeddings {args.inputs} x 2,000", emb, solo))


if __name__ == "__main__":
    main()
