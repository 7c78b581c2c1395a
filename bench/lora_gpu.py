"""LoRA rows on a GPU (issue 54, item 4): the decode step with adapters against the base model's,
on one engine, at batch 1, 8 and 32, and whether those steps replayed the CUDA graphs.

A random-weight Llama-3.2-1B checkpoint (bf16, written here or reused from --model) with
--adapters rank-16 adapters on all seven projections (bench/lora_bench.py's PEFT files, random
weights); the batch decodes either with no adapter or spread evenly over the adapters, in
alternating rounds (bench/lora_bench.py's step timing). Today LoRA rows run eagerly, so the
lora / base ratio is what putting them in the graphs would win back; the graph replays per step
(from the runner's DecodeGraphs counters when it has them) say which path each ran.

Needs torch, triton and transformers only (no Ray, flash-attn, gguf or FastAPI).

    python bench/lora_gpu.py [--model DIR] [--batches 1 8 32] [--adapters 4] [--json out.json]
    python bench/lora_gpu.py --smoke      # CPU, a tiny shape, end to end
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lora_bench import decode_step_s, write_adapter
from bench.quant_gpu import SMOKE
from bench.step_llm import step_llm
from tests.random_checkpoint import SHAPES, random_prompts, write_random_checkpoint

RANK = 16


def make_llm(path: str, args, lora_root: str):
    return step_llm(
        path,
        device=args.device,
        dtype="bfloat16" if args.device == "cuda" else "float32",
        batch=max(args.batches),
        request_tokens=args.context + args.steps + 16,
        budget=max(2048, args.context),
        max_loras=args.adapters,
        max_lora_rank=RANK,
        lora_root=lora_root,
    )


def graph_replays(llm) -> int | None:
    """Graph replays so far, where the runner counts them (None: no graphs or no counter)."""
    graphs = getattr(llm.engine.executor.runner, "graphs", None)
    return getattr(graphs, "replays", None) if graphs is not None else None


def time_batch(llm, vocab: int, batch: int, names: list[str], args) -> dict:
    """Median step ms of the base batch and the adapter batch, alternating --rounds rounds."""
    prompts = random_prompts(batch, vocab, args.context, args.context, seed=batch)
    loras = [names[i % len(names)] for i in range(batch)]
    base, lora, replays = [], [], {}
    for r in range(args.rounds):
        for tag, which, out in (("base", [None] * batch, base), ("lora", loras, lora)):
            before = graph_replays(llm)
            out += decode_step_s(llm.engine, prompts, which, args.steps, f"{tag}{batch}-{r}")
            after = graph_replays(llm)
            if before is not None and after is not None:
                replays[tag] = (after - before) / args.steps
    row = dict(batch=batch, base_ms=statistics.median(base) * 1e3)
    row |= dict(lora_ms=statistics.median(lora) * 1e3, replays_per_step=replays)
    return row | {"lora_over_base": row["lora_ms"] / row["base_ms"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, a tiny shape")
    parser.add_argument("--model", default=None, help="a bf16 checkpoint to reuse")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    spec = SHAPES["llama3-1b"]
    if args.smoke:
        args.device, spec, args.batches, args.context, args.steps = "cpu", SMOKE, [1, 4], 32, 3
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke on CPU")
    else:
        args.device = "cuda"
    with tempfile.TemporaryDirectory() as root:
        path = args.model if args.model and os.path.exists(f"{args.model}/config.json") else None
        path = path or write_random_checkpoint(spec, f"{root}/model", device=args.device).path
        config = AutoConfig.from_pretrained(path)
        names = [f"gpu-{i}" for i in range(args.adapters)]
        llm = make_llm(path, args, root)
        for i, name in enumerate(names):
            llm.engine.add_lora(name, write_adapter(f"{root}/{name}", config, RANK, i))
        rows = []
        for batch in args.batches:
            rows.append(time_batch(llm, config.vocab_size, batch, names, args))
            r = rows[-1]
            print(
                f"batch {batch}: base {r['base_ms']:.3f} ms, {args.adapters} adapters "
                f"{r['lora_ms']:.3f} ms ({r['lora_over_base']:.2f}x); graph replays per step "
                f"{r['replays_per_step'] or 'not counted'}",
                flush=True,
            )
        llm.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps({"rank": RANK, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
