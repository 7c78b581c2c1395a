"""The step-time cost of `batch_invariant` (docs/batch_invariance.md): decode at batch 1, 8 and 32
and one 512-token prefill, with the mode off and on, in the same run, and the on/off ratios.

    .venv/bin/python bench/batch_invariant.py [--quantization auto|none] [--repeats 3]

A decode figure is a generation of 33 tokens after a 16-token prompt divided by its 33 steps (the
prompt's one step included); a prefill figure is one 512-token prompt and one token. Each figure
is the best of --repeats runs (the machine is shared: the best run is the least disturbed).
"""

from __future__ import annotations

import argparse
import random
import time

from engine.llm import LLM
from scheduler import SamplingParams

DECODE_BATCHES = (1, 8, 32)
DECODE_TOKENS = 33
PREFILL_LEN = 512


def best_seconds(llm: LLM, prompts: list[list[int]], max_tokens: int, repeats: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
        times.append(time.perf_counter() - start)
    return min(times)


def measure(on: bool, quantization: str, repeats: int) -> dict[str, float]:
    """ms per step of each workload with the mode `on`."""
    rng = random.Random(0)
    llm = LLM(
        model="default",
        quantization=quantization,
        device="cpu",
        load_progress=False,
        enable_prefix_caching=False,  # every repeat computes its prompt
        max_num_batched_tokens=PREFILL_LEN,
        batch_invariant=on,
    )
    figures = {}
    try:
        for b in DECODE_BATCHES:
            prompts = [[rng.randrange(3, 40000) for _ in range(16)] for _ in range(b)]
            seconds = best_seconds(llm, prompts, DECODE_TOKENS, repeats)
            figures[f"decode batch {b}"] = seconds / DECODE_TOKENS * 1000
        prompt = [[rng.randrange(3, 40000) for _ in range(PREFILL_LEN)]]
        figures[f"prefill {PREFILL_LEN}"] = best_seconds(llm, prompt, 1, repeats) * 1000
    finally:
        llm.shutdown()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", default="auto", choices=("auto", "none"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    off = measure(False, args.quantization, args.repeats)
    on = measure(True, args.quantization, args.repeats)
    print(f"SmolLM2-135M, quantization={args.quantization}, ms per step (best of {args.repeats})")
    print(f"{'workload':<16} {'off':>9} {'on':>9} {'on/off':>7}")
    for name in off:
        print(f"{name:<16} {off[name]:9.2f} {on[name]:9.2f} {on[name] / off[name]:7.2f}")


if __name__ == "__main__":
    main()
