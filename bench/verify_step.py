"""What a verify step costs against a plain decode step, part by part, on the default model.

Builds a ModelRunner on the embedded SmolLM2-135M (`--quantization`, default `gguf`: the Q4_1
blocks through the int8 kernel), one request `--context` tokens long, and runs the step that
decodes its last token (1 row) and the verify steps that run it with k proposed tokens (k + 1
rows, laid out as decode rows, as served) for each k of `--ks`, each step twice: its layers one
op at a time from Python, and in one call of the C++ layer driver (cpu_driver.py). Each part is
timed by the thread's CPU time (steadier than the wall clock on a shared machine): the quantized
linears by weight shape, the LM head, the paged attention kernel, the layer driver's call (all
of those ops inside it), the rest of the forward (norms, rotary, cache writes, embedding,
Python) and the step as a whole; the minimum over `--repeats` steps of each part, one torch
thread (CPU time of a second thread would not show up here).

    python bench/verify_step.py [--ks 1,4,8] [--context 175] [--repeats 40]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections import Counter
from collections.abc import Callable

import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.step_profile import build_runner
from workers.layers.backends.cpu_driver import LayerDriver, driver_off
from workers.layers.backends.torch_ref import TorchBackend
from workers.layers.quantized import GGUFWeight
from workers.models.llama import LlamaForCausalLM
from workers.runner import ModelRunner
from workers.step_state import Batch, add_to_batch

spent: Counter = Counter()


def timed(owner: type, name: str, key: Callable[[tuple], str]) -> None:
    """Count the thread CPU time of owner.name's calls under key(args)."""
    original = getattr(owner, name)

    def wrapper(*args: object, **kwargs: object) -> object:
        t = time.thread_time_ns()
        out = original(*args, **kwargs)
        spent[key(args)] += time.thread_time_ns() - t
        return out

    setattr(owner, name, wrapper)


def linear_key(args: tuple) -> str:
    n, k = args[0].shape
    return "LM head" if n > 16 * k else f"linear {n}x{k}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", default="gguf")
    parser.add_argument("--ks", default="1,4,8", help="proposed tokens per verify step")
    parser.add_argument("--context", type=int, default=175)
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    runner, plain = build_runner(
        "float32", 1, (args.context, args.context), quantization=args.quantization
    )
    timed(GGUFWeight, "matmul", linear_key)
    timed(TorchBackend, "_paged", lambda a: "paged attention")
    timed(LlamaForCausalLM, "forward", lambda a: "forward")
    timed(LayerDriver, "__call__", lambda a: "layer driver")
    rid = plain.req_ids[0]
    steps = {1: plain}
    for k in map(int, args.ks.split(",")):
        steps[k + 1] = Batch()
        add_to_batch(steps[k + 1], rid, runner.requests[rid], k + 1, [5] * k)
    modes: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
        "Python layers": driver_off,
        "layer driver": contextlib.nullcontext,
    }
    best: dict[tuple[str, int], Counter] = {(m, rows): Counter() for m in modes for rows in steps}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for (mode, rows), counts in best.items():  # interleaved: all see the same load
                with modes[mode]():
                    step_parts(runner, steps[rows], counts)
    print(
        f"SmolLM2-135M, quantization {args.quantization}, context {args.context}, 1 thread, "
        f"min thread CPU ms over {args.repeats} steps; load average {os.getloadavg()[0]:.1f}\n"
    )
    for mode in modes:
        print_table(mode, {rows: best[mode, rows] for rows in steps})


def step_parts(runner: ModelRunner, batch: Batch, best: Counter) -> None:
    """One step's parts into `best` (the minimum so far of each)."""
    spent.clear()
    t = time.thread_time_ns()
    runner._forward(batch)
    spent["step"] = time.thread_time_ns() - t
    spent["rest of the forward"] = spent["forward"] - sum(
        v for k, v in spent.items() if k.startswith(("linear", "paged", "layer driver"))
    )
    for part, ns in spent.items():
        best[part] = min(best.get(part, ns), ns)


def print_table(mode: str, best: dict[int, Counter]) -> None:
    """Rows: parts; columns: rows per step, each as ms and its ratio to the 1-row step."""
    print(f"{mode}:\n\n| part | " + " | ".join(f"{rows} rows" for rows in best) + " |")
    print("| --- " * (len(best) + 1) + "|")
    one = best[1]
    for part in [p for p in one if p != "forward"]:
        cells = [f"{c[part] / 1e6:.2f} ({c[part] / max(one[part], 1):.2f}x)" for c in best.values()]
        print(f"| {part} | " + " | ".join(cells) + " |")
    print()


if __name__ == "__main__":
    main()
