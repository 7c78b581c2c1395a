"""Async scheduling on vs off: offline throughput of the same workload, both in this process.

Two engines over the same model (the embedded SmolLM2-135M unless --model), one with
async_scheduling off and one with it on, run the same greedy workload in alternation (after one
warm-up round each), so drift of the machine hits both. Prints output tokens per second of each
round, the medians, the ratio on/off, and whether every request's tokens matched (a difference
at a near-tie of the fp32 logits is counted apart: the two modes batch neighbours differently).

    python bench/async_scheduling.py [--model default] [--device cpu] [--requests 64]
        [--max-tokens 64] [--rounds 3] [--max-num-seqs 64]
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.llm import LLM, GenerationOutput
from scheduler import SamplingParams

NEAR_TIE = 1e-3


def workload(n: int, max_tokens: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(2024)
    prompts = [[rng.randrange(100, 20000) for _ in range(rng.randint(16, 128))] for _ in range(n)]
    params = [
        SamplingParams(
            max_tokens=rng.randint(max_tokens // 2, max_tokens),
            temperature=0.0,
            ignore_eos=True,
            logprobs=2,
        )
        for _ in range(n)
    ]
    return prompts, params


def timed(llm: LLM, prompts, params) -> tuple[float, list[GenerationOutput]]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / elapsed, outs


def compare(ref: list[GenerationOutput], other: list[GenerationOutput]) -> str:
    """How many requests match; a divergence counts as a near-tie when the reference's top two
    logprobs at that position are within NEAR_TIE (fp32 rows move in the last bits with the
    batch they share a matmul with, and the two modes batch differently)."""
    same = ties = 0
    for a, b in zip(ref, other):
        if a.token_ids == b.token_ids:
            same += 1
            continue
        at = next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
        top = a.logprobs[at] if a.logprobs else []
        ties += len(top) >= 3 and top[1][1] - top[2][1] < NEAR_TIE
    return (
        f"{same}/{len(ref)} identical, {ties} diverge at a near-tie, {len(ref) - same - ties} other"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=4096,
        help="CUDA: each engine's KV blocks (both engines live in this process, and "
        "gpu_memory_utilization counts everything the process holds)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    prompts, params = workload(args.requests, args.max_tokens)
    cuda = args.device == "cuda"
    engines = {
        on: LLM(
            args.model,
            device=args.device,
            load_progress=False,
            quantization="none",  # the recorded figures are the fp32 path's
            async_scheduling=on,
            max_num_seqs=args.max_num_seqs,
            **({"num_gpu_blocks": args.num_gpu_blocks} if cuda else {}),
        )
        for on in (False, True)
    }
    tokens = {}
    for on, llm in engines.items():  # warm-up: first shapes, allocator
        _, tokens[on] = timed(llm, prompts[:8], params[:8])
    rates: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):
        for on, llm in engines.items():
            rate, tokens[on] = timed(llm, prompts, params)
            rates[on].append(rate)
    print(
        f"{args.model} on {args.device}: {args.requests} requests, "
        f"max_tokens <= {args.max_tokens}, max_num_seqs {args.max_num_seqs}, {args.rounds} rounds"
    )
    for on in (False, True):
        shown = ", ".join(f"{r:.1f}" for r in rates[on])
        print(f"  async_scheduling={str(on).lower():5}: {shown} tok/s")
    off, on_ = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"  median: off {off:.1f} tok/s, on {on_:.1f} tok/s, ratio on/off {on_ / off:.3f}")
    print(f"  tokens on vs off: {compare(tokens[False], tokens[True])}")
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
