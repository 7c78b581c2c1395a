"""Two offline engines on one tiny model that differ in a single setting, built once per preemption
mode: the shape of every "this setting gives the same tokens" test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from engine.llm import LLM

# A pool small enough that a dozen requests preempt each other.
SMALL_POOL = dict(num_gpu_blocks=12, max_model_len=12 * 16, max_num_batched_tokens=64)

MakePair = Callable[..., tuple[LLM, LLM]]


def paired_engines(model: str, setting: str, values: tuple[Any, Any]) -> Iterator[MakePair]:
    """Yield make(mode) -> (engine with values[0], engine with values[1]) for `setting`, each pair
    built on first use; every engine is shut down after the last test."""
    made: dict[str, tuple[LLM, LLM]] = {}

    def make(mode: str = "recompute") -> tuple[LLM, LLM]:
        if mode not in made:
            kwargs: dict[str, Any] = dict(SMALL_POOL, preemption_mode=mode)
            if mode == "swap":
                kwargs["num_cpu_blocks"] = 200
            first, second = (
                LLM(model, device="cpu", load_progress=False, **{setting: v}, **kwargs)
                for v in values
            )
            made[mode] = (first, second)
        return made[mode]

    yield make
    for pair in made.values():
        for llm in pair:
            llm.shutdown()
