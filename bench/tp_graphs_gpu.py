"""Decode steps with the tensor-parallel collectives captured in CUDA graphs (issue 29, item 3).

On one GPU a TP group of one rank still runs every all-reduce through NCCL, so it times what a TP
rank's graphs hold: the decode step at batch 1, 8 and 64 on a random Llama-3.2-1B-shaped
checkpoint (bf16, written here) for

- TP=1 without a process group, CUDA graphs and eager (`enforce_eager`);
- an NCCL group of one rank (the model's all-reduces go through NCCL), graphs with the collectives
  captured, and eager;

and checks that greedy tokens are the same in all four. `--smoke` runs the same code on CPU with a
tiny model and a gloo group of one (which never captures: graphs are reported off), in seconds.

    python bench/tp_graphs_gpu.py [--smoke] [--batches 1,8,64] [--steps 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_bench import copy_bandwidth, make_llm, release, step_read_bytes, time_decode_steps
from scheduler import SamplingParams
from tests.random_checkpoint import SHAPES, TINY_FAMILIES, random_prompts, write_random_checkpoint
from workers.distributed import destroy_distributed, free_port, init_distributed


@dataclass
class Mode:
    """One way of running the decode step."""

    name: str
    group: bool  # a torch.distributed group of one rank (NCCL on CUDA, gloo on CPU)
    eager: bool
    graphs: bool = False  # whether the runner captured graphs
    collectives_per_graph: int = 0  # TP collectives inside each captured graph
    steps: dict[int, tuple[float, float]] = field(default_factory=dict)  # batch: (step, fwd) ms
    tokens: list[list[int]] = field(default_factory=list)
    error: str | None = None  # what failed, so the other modes still run and report


def run_mode(mode: Mode, path: str, vocab: int, args: argparse.Namespace, device: str) -> None:
    """Build one LLM for the mode, check greedy tokens, then time each batch size on it."""
    largest = max(args.batches)
    blocks_per_request = -(-(args.context + args.steps + 40) // 16)
    if mode.group:
        init_distributed(0, 1, f"127.0.0.1:{free_port()}", device, timeout_s=120)
    try:
        llm = make_llm(
            path,
            device=device,
            dtype=args.dtype,
            enforce_eager=mode.eager,
            max_num_seqs=max(largest, 8),
            max_num_batched_tokens=16384,
            max_model_len=16 * blocks_per_request,
            num_gpu_blocks=largest * blocks_per_request + 64,
        )
        try:
            graphs = llm.engine.executor.runner.graphs
            mode.graphs = graphs is not None
            if graphs is not None:
                mode.collectives_per_graph = min(graphs.collectives.values())
            prompts = random_prompts(args.check_prompts, vocab, 16, 64, seed=7)
            params = SamplingParams(max_tokens=args.check_tokens, temperature=0.0, ignore_eos=True)
            outs = llm.generate(prompts, params, use_tqdm=False)
            mode.tokens = [list(o.token_ids) for o in outs]
            for batch in args.batches:
                mode.steps[batch] = time_decode_steps(llm, vocab, batch, args.context, args.steps)
                step, fwd = mode.steps[batch]
                print(
                    f"  {mode.name:28s} batch {batch:3d}: step {step:8.3f} ms, "
                    f"forward {fwd:8.3f} ms",
                    flush=True,
                )
        finally:
            release(llm)
    finally:
        if mode.group:
            destroy_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, gloo, seconds")
    parser.add_argument("--batches", default=None, help="comma-separated (default 1,8,64)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per batch")
    parser.add_argument("--context", type=int, default=None, help="prompt tokens per request")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or --smoke for the CPU run)")
    device = "cpu" if smoke else "cuda"
    args.batches = [int(b) for b in (args.batches or ("1,4" if smoke else "1,8,64")).split(",")]
    args.steps = args.steps or (4 if smoke else 40)
    args.context = args.context or (24 if smoke else 512)
    args.dtype = "float32" if smoke else "bfloat16"
    args.check_prompts, args.check_tokens = (3, 6) if smoke else (8, 24)
    group_name = "gloo" if smoke else "NCCL"
    modes = [
        Mode("TP=1, graphs", group=False, eager=False),
        Mode("TP=1, eager", group=False, eager=True),
        Mode(f"{group_name} world 1, graphs", group=True, eager=False),
        Mode(f"{group_name} world 1, eager", group=True, eager=True),
    ]
    t0 = time.perf_counter()
    bandwidth = None if smoke else copy_bandwidth()
    floors: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if smoke:
            checkpoint = write_random_checkpoint(TINY_FAMILIES["llama"], tmp, seed=1)
            shape = "tiny Llama"
        else:
            checkpoint = write_random_checkpoint(SHAPES["llama3-1b"], tmp, device="cuda")
            shape = "Llama-3.2-1B shape"
        gpu = torch.cuda.get_device_name(0) if not smoke else "CPU"
        print(
            f"{shape}, {args.dtype}, {gpu}, torch {torch.__version__}; checkpoint written in "
            f"{time.perf_counter() - t0:.0f}s",
            flush=True,
        )
        if bandwidth is not None:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(checkpoint.path)
            # the timed steps sit 5..5 + steps tokens past the prompt
            mean_context = args.context + 5 + args.steps // 2
            for batch in args.batches:
                floors[batch] = sum(step_read_bytes(config, batch, mean_context)) / bandwidth * 1e3
            print(f"copy bandwidth (read + written): {bandwidth / 1e12:.2f} TB/s")
        for mode in modes:
            try:
                run_mode(mode, checkpoint.path, checkpoint.vocab_size, args, device)
            except Exception as exc:  # report it and time the other modes
                traceback.print_exc()
                mode.error = f"{type(exc).__name__}: {exc}"

    ok = True
    print(
        f"\nDecode step, context {args.context}, {args.steps} timed steps: engine step ms "
        "(forward ms)"
    )
    print(
        "| batch | " + " | ".join(m.name for m in modes) + " | graphs speedup, TP=1 | graphs "
        f"speedup, {group_name} world 1 | floor ms (weights + KV at copy bandwidth) | floor / "
        f"step, TP=1 graphs | floor / step, {group_name} graphs |"
    )
    print("| --- " * (len(modes) + 6) + "|")
    for batch in args.batches:
        cells = [
            f"{m.steps[batch][0]:.3f} ({m.steps[batch][1]:.3f})" if batch in m.steps else "failed"
            for m in modes
        ]
        speedups = [
            f"{modes[i + 1].steps[batch][0] / modes[i].steps[batch][0]:.2f}x"
            if batch in modes[i].steps and batch in modes[i + 1].steps
            else "-"
            for i in (0, 2)
        ]
        floor = floors.get(batch)
        shares = [
            f"{floor / m.steps[batch][0]:.0%}" if floor and batch in m.steps else "-"
            for m in (modes[0], modes[2])
        ]
        floor_cell = f"{floor:.3f}" if floor else "-"
        print(f"| {batch} | " + " | ".join(cells + speedups + [floor_cell] + shares) + " |")
    for m in modes:
        if m.error is not None:
            print(f"{m.name}: FAILED: {m.error}")
            ok = False
            continue
        print(
            f"{m.name}: graphs {'on' if m.graphs else 'off'}"
            + (f", {m.collectives_per_graph} TP collectives captured per graph" if m.graphs else "")
        )
    reference = modes[1]
    for m in modes:
        same = m.tokens == reference.tokens
        ok &= same
        print(f"tokens equal ({m.name} vs {reference.name}): {same}")
    expected_graphs = not smoke
    captured = modes[2].graphs and modes[2].collectives_per_graph > 0
    print(
        f"collectives captured in the {group_name} world-1 graphs: {captured} "
        f"(expected {expected_graphs})"
    )
    ok &= captured == expected_graphs and modes[0].graphs == expected_graphs
    print(f"RESULT: {'PASS' if ok else 'FAIL'} in {time.perf_counter() - t0:.0f}s")
    if args.json:
        with open(args.json, "w") as f:
            result = {"device": gpu, "floor_ms": floors, "modes": [asdict(m) for m in modes]}
            json.dump(result, f, indent=1)
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
