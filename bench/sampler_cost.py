"""The sampled step's cost per row: top-k / top-p from candidate sets against the full sort.

`Sampler.sample` over a [batch, 49,152] logits batch (SmolLM2's vocabulary), batch 1, 8 and 32,
two settings: top-p 0.95 with a seed per request (spec_bench's sampled chat) and top-k 40 with
top-p 0.9, unseeded. "before" empties the candidate sizes, so the filter sorts every row as it did
before workers/sampling_top.py; "after" is the sampler as shipped. The two alternate call by call
(interleaved A/B) and the median of each is printed in microseconds per row, by wall clock and by
the thread's CPU time (steadier on a shared machine), with the ratios and the load average
(`uptime`) at the start and the end. Rows are random logits at four spreads, so that the nucleus
ranges from a few tokens to about 1,500 (the sizes are printed); both arms draw the same tokens
(checked).

    python bench/sampler_cost.py [--repeats 15] [--batches 1,8,32] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import workers.sampler as sampler_module
from scheduler.sampling_params import SamplingParams
from workers.sampler import Sampler, SamplingState
from workers.sampling_top import CANDIDATE_SIZES, apply_top_k_top_p

VOCAB = 49_152
SPREADS = (4.0, 5.0, 7.0, 9.0)  # logit standard deviations: nuclei of ~1,500 to ~5 tokens
SETTINGS = {
    "top-p 0.95, seeded": dict(temperature=1.0, top_p=0.95),
    "top-k 40 + top-p 0.9": dict(temperature=0.8, top_k=40, top_p=0.9),
}


def make_logits(batch: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    spread = torch.tensor([SPREADS[i % len(SPREADS)] for i in range(batch)])[:, None]
    return torch.randn(batch, VOCAB, generator=gen) * spread


def make_states(batch: int, params: dict, seeded: bool) -> list[SamplingState]:
    device = torch.device("cpu")
    return [
        SamplingState.create(
            SamplingParams(**params, seed=1000 + i if seeded else None), [1, 2, 3], device
        )
        for i in range(batch)
    ]


def timed_draw(logits: torch.Tensor, states: list[SamplingState], sizes: tuple) -> tuple:
    """One Sampler.sample with the given candidate sizes: ((wall, thread CPU) seconds, tokens)."""
    sampler_module.CANDIDATE_SIZES = sizes
    torch.manual_seed(0)  # unseeded rows: the same batched noise in both arms
    start, cpu = time.perf_counter(), time.thread_time()
    tokens = Sampler().sample(logits, states).token_ids
    return (time.perf_counter() - start, time.thread_time() - cpu), tokens


def nucleus_sizes(logits: torch.Tensor, params: dict) -> list[int]:
    k = params.get("top_k", VOCAB)
    kept = apply_top_k_top_p(
        logits / params["temperature"],
        torch.tensor([k] * len(logits)),
        torch.tensor([params["top_p"]] * len(logits)),
    )
    return torch.isfinite(kept).sum(dim=-1).tolist()


def measure(batch: int, params: dict, seeded: bool, repeats: int) -> dict:
    logits = make_logits(batch, seed=batch)
    states = make_states(batch, params, seeded)
    times: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
    for _ in range(repeats):
        before, tokens_before = timed_draw(logits, states, ())
        after, tokens_after = timed_draw(logits, states, CANDIDATE_SIZES)
        if tokens_before != tokens_after:
            raise AssertionError(f"batch {batch}: the two arms drew different tokens")
        times["before"].append(before)
        times["after"].append(after)
    sampler_module.CANDIDATE_SIZES = CANDIDATE_SIZES
    us = {
        (arm, clock): statistics.median(t[clock] for t in ts) / batch * 1e6
        for arm, ts in times.items()
        for clock in (0, 1)
    }
    return dict(us=us, nucleus=nucleus_sizes(logits, params))


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"start: {uptime()}")
    print(
        f"vocabulary {VOCAB}, torch threads {args.threads}, candidate sizes {CANDIDATE_SIZES}, "
        f"median of {args.repeats} interleaved calls per arm"
    )
    print(
        "| setting | batch | before us/row | after us/row | before/after | before CPU us/row | "
        "after CPU us/row | before/after (CPU) | nucleus sizes |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, params in SETTINGS.items():
        for batch in map(int, args.batches.split(",")):
            r = measure(batch, params, "seeded" in name, args.repeats)
            sizes = r["nucleus"][: len(SPREADS)]
            us = r["us"]
            cells = [
                f"{us['before', c]:.0f} | {us['after', c]:.0f} | "
                f"{us['before', c] / us['after', c]:.2f}x"
                for c in (0, 1)
            ]
            print(f"| {name} | {batch} | {' | '.join(cells)} | {sizes} |", flush=True)
    print(f"end: {uptime()}")


if __name__ == "__main__":
    main()
