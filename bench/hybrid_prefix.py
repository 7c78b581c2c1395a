"""Time to first token of a hybrid model's prompt computed cold against the same prompt after a
prefix hit that restores a recurrent-state checkpoint (scheduler/state_checkpoints.py).

The model is bench/hybrid_step.py's (SmolLM2-wide, 8 layers: Qwen3-Next's DeltaNet and gated
attention, or Granite-4 hybrid's Mamba-2 and attention with `--family granite`), random weights,
written once to a temporary directory and served by the offline engine on CPU. Each round sends a
new `--prompt`-token prompt (cold: nothing cached), then that prompt followed by `--tail` new
tokens (a follow-up turn: its hit is the first prompt's last checkpointed block), one output token
each. Printed: tokens each computed, medians, and the hit's time over the cold one.

    python -m bench.hybrid_prefix [--family qwen3_next|granite] [--prompt 1024] [--tail 32]
        [--chunk 512] [--rounds 5] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from bench.hybrid_step import GRANITE, HYBRID, INTERMEDIATE, LAYERS
from bench.moe_step import WIDTH
from engine.llm import LLM
from scheduler import SamplingParams
from tests.random_checkpoint import ModelSpec, write_random_checkpoint


def write_model(family: str, path: str) -> None:
    shape = {**WIDTH, "num_hidden_layers": LAYERS, "intermediate_size": INTERMEDIATE}
    if family == "granite":
        spec = ModelSpec("GraniteMoeHybridConfig", {**shape, **GRANITE}, matrix_std=0.02)
    else:
        fields = {**shape, **HYBRID, "partial_rotary_factor": 0.25}
        spec = ModelSpec("Qwen3NextConfig", fields, matrix_std=0.02)
    write_random_checkpoint(spec, path)


def timed(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token, and the prompt tokens the engine computed."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    return time.perf_counter() - t0, len(prompt) - out.num_cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=("qwen3_next", "granite"), default="qwen3_next")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--tail", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as path:
        write_model(args.family, path)
        llm = LLM(
            model=path,
            dtype="float32",
            device="cpu",
            load_progress=False,
            max_num_batched_tokens=args.chunk,
            max_model_len=args.prompt + args.tail + 16,
            kv_cache_memory_gb=1.0,
        )
        cold, warm = [], []
        for r in range(args.rounds):
            prompt = [(r * 7919 + 31 * i) % 40000 + 100 for i in range(args.prompt)]
            tail = [(r * 104729 + 17 * i) % 40000 + 100 for i in range(args.tail)]
            cold.append(timed(llm, prompt))
            warm.append(timed(llm, prompt + tail))
        llm.shutdown()
    c = statistics.median(t for t, _ in cold)
    w = statistics.median(t for t, _ in warm)
    print(
        f"{args.family}: {LAYERS} layers, {torch.get_num_threads()} threads, chunks of "
        f"{args.chunk}, {args.rounds} rounds (median)\n"
        f"  cold   {args.prompt} tokens computed ({cold[0][1]}): {c * 1e3:.0f} ms to first token\n"
        f"  hit    {args.prompt + args.tail} tokens, {warm[0][1]} computed: {w * 1e3:.0f} ms\n"
        f"  hit / cold: {w / c:.3f}"
    )


if __name__ == "__main__":
    main()
