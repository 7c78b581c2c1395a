"""Where a batch-1 decode step's time goes in the engine, outside and inside the forward.

Runs the offline LLM on the embedded SmolLM2-135M (`--quantization`, default `auto`: the Q4_1
blocks through the int8 kernel and, on decode steps, the C++ layer driver), one prompt of 16
tokens, `--max-tokens` greedy tokens, `--repeats` times after a warm-up, one torch thread. Each
part is the thread CPU time of one method (nested: a part includes the parts it calls), summed
over the decode steps only (steps that called the layer driver; with the driver off, steps
without a prefill) and divided by their count.

    python bench/engine_step_parts.py [--max-tokens 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from collections.abc import Callable

import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.core import EngineCore
from engine.llm import LLM
from scheduler import SamplingParams
from scheduler.scheduler import Scheduler
from workers.layers.attention import AttentionMetadata
from workers.layers.backends.cpu_driver import LayerDriver
from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from workers.models.llama import LlamaModel
from workers.runner import ModelRunner
from workers.step_state import BlockTableRows

PARTS: list[tuple[type, str]] = [
    (EngineCore, "step"),
    (Scheduler, "schedule"),
    (Scheduler, "update_from_output"),
    (ModelRunner, "execute_model"),
    (ModelRunner, "_update_states"),
    (ModelRunner, "_build_batch"),
    (ModelRunner, "_forward"),
    (ModelRunner, "_eager_forward"),
    (BlockTableRows, "select"),
    (AttentionMetadata, "from_tables"),
    (LlamaModel, "forward"),
    (VocabParallelEmbedding, "forward"),
    (LayerDriver, "__call__"),
    (ParallelLMHead, "compute_logits"),
    (ModelRunner, "_sample"),
]
step: Counter = Counter()  # the current step's parts
total: Counter = Counter()  # over the decode steps


def timed(owner: type, name: str) -> None:
    original: Callable = getattr(owner, name)
    key = f"{owner.__name__}.{name}"

    def wrapper(*args: object, **kwargs: object) -> object:
        t = time.thread_time_ns()
        out = original(*args, **kwargs)
        step[key] += time.thread_time_ns() - t
        return out

    setattr(owner, name, wrapper)


def count_step(original: Callable) -> Callable:
    """EngineCore.step, its parts added to `total` when it was a decode step."""

    def wrapper(*args: object, **kwargs: object) -> object:
        step.clear()
        out = original(*args, **kwargs)
        decode = "LayerDriver.__call__" in step if driver_on else step["prefill"] == 0
        if decode:
            total.update(step)
            total["steps"] += 1
        return out

    return wrapper


driver_on = os.environ.get("RAYLM_CPU_DRIVER", "") != "0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    llm = LLM(quantization=args.quantization, device="cpu", kv_cache_memory_gb=0.25)
    for owner, name in PARTS:
        timed(owner, name)
    EngineCore.step = count_step(EngineCore.step)  # type: ignore[method-assign]
    mark_prefills()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    prompt = [[5 + i for i in range(16)]]
    llm.generate(prompt, params, use_tqdm=False)
    total.clear()
    for _ in range(args.repeats):
        llm.generate(prompt, params, use_tqdm=False)
    n = total.pop("steps")
    print(
        f"SmolLM2-135M, quantization {args.quantization}, layer driver "
        f"{'on' if driver_on else 'off'}, batch 1, 1 thread: thread CPU us per decode step over "
        f"{n} steps; load average {os.getloadavg()[0]:.1f}\n"
    )
    print("| part | us |\n| --- | ---: |")
    for part, ns in sorted(total.items(), key=lambda kv: -kv[1]):
        if part != "prefill":
            print(f"| {part} | {ns / n / 1e3:.0f} |")


def mark_prefills() -> None:
    """Count, in the step's parts, the metadata built for a step with a prefill chunk."""
    original = AttentionMetadata.__post_init__

    def wrapper(self: AttentionMetadata) -> None:
        original(self)
        step["prefill"] += self.num_decodes != self.num_reqs

    AttentionMetadata.__post_init__ = wrapper  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
