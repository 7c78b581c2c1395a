"""Structured-output cost: decode step time of 32 JSON-schema constrained requests vs the same batch
unconstrained (same process, alternating rounds), and grammar compile time cold and cached.

The schema forces at least 40 array items, so every constrained request runs all max_tokens steps
and the batch stays at 32 rows throughout. Step time is the median of the engine's decode steps.

    python bench/structured_bench.py [--rounds 3] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from engine.llm import LLM
from scheduler import SamplingParams
from scheduler.structured_output import StructuredOutput
from workers.model_files import load_tokenizer
from workers.structured import GrammarCompiler

BATCH = 32
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "kind": {"enum": ["reading", "forecast"]},
        "values": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 999},
            "minItems": 40,
            "maxItems": 60,
        },
    },
    "required": ["id", "kind", "values"],
    "additionalProperties": False,
}


def timed_steps(llm: LLM, params: SamplingParams) -> list[float]:
    """Run one batch; the wall time of every engine step after the first (the prefill)."""
    times: list[float] = []
    step = llm.engine.step

    def timed() -> list:
        t0 = time.perf_counter()
        result = step()
        times.append(time.perf_counter() - t0)
        return result

    llm.engine.step = timed
    try:
        prompts = [f"Sensor {i} readings as JSON:" for i in range(BATCH)]
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        del llm.engine.step
    return times[2:-1]  # drop the prefill and the final (finishing) step


def compile_times(model_dir: str, vocab_size: int) -> dict[str, float]:
    tokenizer = load_tokenizer(model_dir)
    compiler = GrammarCompiler(lambda: tokenizer, vocab_size)
    t0 = time.perf_counter()
    compiler.matcher(StructuredOutput("json_object"))
    tokenizer_s = time.perf_counter() - t0
    constraint = StructuredOutput.json_schema(SCHEMA)
    t0 = time.perf_counter()
    compiler.matcher(constraint)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiler.matcher(constraint)
    cached = time.perf_counter() - t0
    return {
        "tokenizer_init_s": tokenizer_s,
        "compile_cold_ms": cold * 1e3,
        "compile_cached_ms": cached * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    llm = LLM("default", device="cpu", load_progress=False, quantization="none")  # recorded: fp32
    free = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(
        max_tokens=args.max_tokens, temperature=0.0, structured=StructuredOutput.json_schema(SCHEMA)
    )
    timed_steps(llm, constrained)  # warm-up: tokenizer and grammar compile are not step costs
    medians = {"unconstrained": [], "constrained": []}
    for _ in range(args.rounds):
        medians["unconstrained"].append(statistics.median(timed_steps(llm, free)))
        medians["constrained"].append(statistics.median(timed_steps(llm, constrained)))
    free_ms = statistics.median(medians["unconstrained"]) * 1e3
    cons_ms = statistics.median(medians["constrained"]) * 1e3
    result = {
        "batch": BATCH,
        "step_ms_unconstrained": round(free_ms, 2),
        "step_ms_constrained": round(cons_ms, 2),
        "overhead_pct": round(100 * (cons_ms / free_ms - 1), 1),
        **{
            k: round(v, 3)
            for k, v in compile_times(
                llm.engine.model_dir, llm.engine.model_info.vocab_size
            ).items()
        },
    }
    print(json.dumps(result, indent=2))
    llm.shutdown()


if __name__ == "__main__":
    main()
