"""Speculative decoding (n-gram) against plain decoding on the embedded SmolLM2-135M, CPU.

Workloads (chat-templated, greedy, ignore_eos):
- `rewrite`: repeat or lightly edit a provided passage or piece of code (the output copies its
  prompt: what prompt lookup is for), at batch 1 and batch 8;
- `chat`: open questions whose answers do not copy the prompt, at batch 1 and batch 8 (greedy: a
  135M model's greedy answers often repeat themselves, which prompt lookup finds);
- `chat-sampled`: the same questions sampled (temperature 1.0, top-p 0.95, a seed per request, so
  both engines must give the same tokens): output that repeats little, where adaptive skipping
  must keep speculation from costing time.
Both engines live in this process and run each workload in turn, alternating plain and speculative
runs `--repeats` times; the best run of each counts (a shared machine's load only slows a run).
Reported: output tokens/s each way by wall clock and by the process's CPU time (steadier on a
loaded machine), their ratios, the share of proposed tokens accepted, the mean accepted length per
verify row, and whether the greedy tokens are identical.

    python bench/spec_bench.py [--max-tokens 96] [--repeats 3] [--num-tokens 4] [--cpu-threads 1]
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from engine.llm import LLM
from scheduler import SamplingParams

PASSAGES = [
    "Ray is an open-source framework for scaling Python applications. It provides a small set "
    "of primitives, tasks, actors and objects, on which libraries for data processing, training, "
    "tuning and serving are built. A Ray cluster has a head node and any number of worker nodes.",
    "The river rose through the night, and by morning the lower streets of the town were under "
    "water. The bakers carried their flour to the upper floors, the children watched from the "
    "bridge, and the old ferryman said he had seen it twice before, both times in spring.",
    "Speculative decoding proposes several tokens cheaply and checks them with one forward pass "
    "of the large model. Every proposed token that the model agrees with is kept, so the output "
    "is exactly what the model alone would have written, only sooner.",
    "A paged KV cache stores keys and values in fixed-size blocks. Each sequence has a block "
    "table that maps its positions to blocks, so memory is allocated on demand and freed at once "
    "when the sequence finishes, and blocks holding a shared prefix can be shared.",
]
CODE = [
    "def total(xs):\n    s = 0\n    for x in xs:\n        s = s + x\n    return s\n\n\n"
    "def mean(xs):\n    s = total(xs)\n    n = len(xs)\n    return s / n\n",
    "class Counter:\n    def __init__(self):\n        self.n = 0\n\n    def add(self, k):\n"
    "        self.n = self.n + k\n        return self.n\n\n    def reset(self):\n"
    "        self.n = 0\n",
    "def clamp(value, low, high):\n    if value < low:\n        return low\n"
    "    if value > high:\n        return high\n    return value\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print('even', i)\n    else:\n"
    "        print('odd', i)\n",
]
QUESTIONS = [
    "Write a short poem about the first snow of winter.",
    "Why is the sky blue? Explain it to a ten-year-old.",
    "Give me three ideas for a weekend trip near the mountains.",
    "What are the pros and cons of working from home?",
    "Invent a new board game and describe how to play it.",
    "Describe the taste of a lemon to someone who has never had one.",
    "What would a city on the ocean floor need to survive?",
    "Tell a short story about a robot who learns to paint.",
]


def rewrite_prompts(n: int) -> list[list[dict]]:
    asks = []
    for i in range(n):
        if i % 2 == 0:
            text = PASSAGES[(i // 2) % len(PASSAGES)]
            ask = f"Repeat the following passage word for word.\n\n{text}"
        else:
            code = CODE[(i // 2) % len(CODE)]
            ask = f"Rename the function arguments to longer names in this code:\n\n{code}"
        asks.append([{"role": "user", "content": ask}])
    return asks


def chat_prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(n)]


def sampled(n: int, max_tokens: int) -> list[SamplingParams]:
    return [
        SamplingParams(
            max_tokens=max_tokens, temperature=1.0, top_p=0.95, seed=1000 + i, ignore_eos=True
        )
        for i in range(n)
    ]


def run(
    llm: LLM, convs: list[list[dict]], params: SamplingParams | list[SamplingParams]
) -> tuple[tuple[float, float], list, tuple]:
    before = llm.engine.stats()
    t, cpu = time.perf_counter(), time.process_time()
    outs = llm.chat(convs, params, use_tqdm=False)
    elapsed = (time.perf_counter() - t, time.process_time() - cpu)
    after = llm.engine.stats()
    spec = (
        after.num_spec_proposed_tokens - before.num_spec_proposed_tokens,
        after.num_spec_accepted_tokens - before.num_spec_accepted_tokens,
        after.num_spec_verify_rows - before.num_spec_verify_rows,
    )
    return elapsed, [o.token_ids for o in outs], spec


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--cpu-threads", type=int, default=None, help="torch threads (1 on a shared machine)"
    )
    parser.add_argument("--num-tokens", type=int, default=4, help="speculative.num_tokens")
    parser.add_argument("--ngram-min", type=int, default=2, help="speculative.ngram_min")
    parser.add_argument("--max-batch-size", type=int, default=4, help="speculative.max_batch_size")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--workloads", default="rewrite,chat,chat-sampled")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    common = dict(model="default", device="cpu", load_progress=False, cpu_threads=args.cpu_threads)
    plain = LLM(**common)
    spec = LLM(
        **common,
        speculative={
            "num_tokens": args.num_tokens,
            "ngram_min": args.ngram_min,
            "max_batch_size": args.max_batch_size,
        },
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for llm in (plain, spec):  # warm-up: allocator, kernels
        llm.chat(chat_prompts(2), SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    print(
        f"SmolLM2-135M float32, CPU, torch threads {torch.get_num_threads()}, max_tokens "
        f"{args.max_tokens}, greedy unless sampled; speculative: ngram num_tokens "
        f"{args.num_tokens} (ngram {args.ngram_min}-4, min_acceptance_rate 0.4, max_batch_size "
        f"{args.max_batch_size}); best of {args.repeats}; load average {os.getloadavg()[0]:.1f}"
    )
    print(
        "| workload | batch | plain tok/s | spec tok/s | speedup | speedup (CPU time) | "
        "acceptance | mean accepted length | identical |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    makers = {"rewrite": rewrite_prompts, "chat": chat_prompts, "chat-sampled": chat_prompts}
    for name in args.workloads.split(","):
        for batch in map(int, args.batches.split(",")):
            convs = makers[name](batch)
            how = sampled(batch, args.max_tokens) if name == "chat-sampled" else params
            best = {"plain": [float("inf")] * 2, "spec": [float("inf")] * 2}
            tokens: dict[str, list] = {}
            proposed = accepted = rows = 0
            for _ in range(args.repeats):
                for key, llm in (("plain", plain), ("spec", spec)):
                    elapsed, tokens[key], (p, a, r) = run(llm, convs, how)
                    best[key] = [min(b, e) for b, e in zip(best[key], elapsed)]
                    proposed, accepted, rows = proposed + p, accepted + a, rows + r
            total = sum(len(t) for t in tokens["plain"])
            plain_rate, spec_rate = total / best["plain"][0], total / best["spec"][0]
            cpu_ratio = best["plain"][1] / best["spec"][1]
            acceptance = accepted / proposed if proposed else 0.0
            mean_len = accepted / rows if rows else 0.0
            same = sum(a == b for a, b in zip(tokens["plain"], tokens["spec"]))
            print(
                f"| {name} | {batch} | {plain_rate:.1f} | {spec_rate:.1f} | "
                f"{spec_rate / plain_rate:.2f}x | {cpu_ratio:.2f}x | "
                f"{acceptance:.2f} ({accepted}/{proposed}) | "
                f"{mean_len:.2f} ({rows} rows) | {same}/{batch} |",
                flush=True,
            )
    plain.shutdown()
    spec.shutdown()


if __name__ == "__main__":
    main()
