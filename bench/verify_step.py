"""What a verify step costs against a plain decode step, part by part, on the default model.

Builds a ModelRunner on the embedded SmolLM2-135M (`--quantization`, default `gguf`: the Q4_1
blocks through the int8 kernel), one request `--context` tokens long, and runs the step that
decodes its last token (1 row) and the verify steps that run it with k proposed tokens (k + 1
rows, laid out as decode rows, as served) for each k of `--ks`. Each part is timed by the thread's
CPU time (steadier than the wall clock on a shared machine): the quantized linears by weight
shape, the LM head, the paged attention kernel, the rest of the forward (norms, rotary, cache
writes, Python) and the step as a whole; the minimum over `--repeats` steps of each part, one
torch thread (CPU time of a second thread would not show up here).

    python bench/verify_step.py [--ks 1,4,8] [--context 175] [--repeats 40]
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

from bench.step_profile import build_runner
from workers.layers.backends.torch_ref import TorchBackend
from workers.layers.quantized import GGUFWeight
from workers.models.llama import LlamaForCausalLM
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
    rid = plain.req_ids[0]
    steps = {1: plain}
    for k in map(int, args.ks.split(",")):
        steps[k + 1] = Batch()
        add_to_batch(steps[k + 1], rid, runner.requests[rid], k + 1, [5] * k)
    best: dict[int, Counter] = {rows: Counter() for rows in steps}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for rows, batch in steps.items():  # interleaved: every size sees the same load
                spent.clear()
                t = time.thread_time_ns()
                runner._forward(batch)
                spent["step"] = time.thread_time_ns() - t
                spent["rest of the forward"] = spent["forward"] - sum(
                    v for k, v in spent.items() if k.startswith(("linear", "paged"))
                )
                for part, ns in spent.items():
                    best[rows][part] = min(best[rows].get(part, ns), ns)
    parts = [p for p in best[1] if p != "forward"]
    print(
        f"SmolLM2-135M, quantization {args.quantization}, context {args.context}, 1 thread, "
        f"min thread CPU ms over {args.repeats} steps; load average {os.getloadavg()[0]:.1f}\n"
    )
    print("| part | " + " | ".join(f"{rows} rows" for rows in steps) + " |")
    print("| --- " * (len(steps) + 1) + "|")
    for part in parts:
        cells = [
            f"{best[r][part] / 1e6:.2f} ({best[r][part] / max(best[1][part], 1):.2f}x)"
            for r in steps
        ]
        print(f"| {part} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
