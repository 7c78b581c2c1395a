"""The batch-1 decode step against its CUDA-graph replay and the copy-bandwidth floor (issue 54,
items 1-3), with async scheduling off and on, per weight format.

On a random-weight Llama-3.2-1B checkpoint (bf16, written here or reused from --models), one
engine per (format, async mode) first decodes a few greedy prompts (the tokens of every async mode
of a format must be identical), then times pure decode steps at each of --batches:
- `step`: the engine step's wall time (schedule, forward, sample, update; CUDA graphs, as served);
- `replay`: one replay of the captured decode graph of that batch, alone (GPU time);
- `floor`: the bytes a step must read (every linear in its format, the LM head, the KV) at the
  device copy bandwidth measured in the same run.
Printed per row: step / replay (issue 54's target <= 1.15), floor / replay (>= 0.70), and per
format the step against bf16's (FP8 <= 0.6x, INT4 <= 0.4x) and async on against off.

Needs torch and transformers only (no Ray, flash-attn, gguf or FastAPI); reuses
bench/quant_gpu.py's engine, step timing and weight bytes and bench/gpu_step_profile.py's replay.

    python bench/step_floor_gpu.py                                # bf16, async off and on, batch 1
    python bench/step_floor_gpu.py --formats bf16 fp8 int4 --async-modes off
    python bench/step_floor_gpu.py --smoke                        # CPU, a tiny shape, end to end
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_step_profile import forward_ms
from bench.quant_gpu import SMOKE, GiB, _warm_steps, copy_bandwidth, decode_ms, make_llm, step_bytes
from scheduler import SamplingParams
from tests.random_checkpoint import SHAPES, ModelSpec, random_prompts, write_random_checkpoint

PARITY_PROMPTS = 4


@dataclass(slots=True)
class Row:
    """One (format, async mode, batch) measurement."""

    format: str
    async_scheduling: bool  # as the engine resolved it, not as asked
    batch: int
    step_ms: float
    replay_ms: float | None  # None: no graph (CPU or eager)
    floor_ms: float
    step_over_replay: float | None
    floor_share_of_replay: float | None
    floor_share_of_step: float


def write_models(spec: ModelSpec, root: str, device: str, formats: list[str]) -> dict[str, str]:
    """The bf16 checkpoint (FP8 quantizes it at load) and, if asked for, its GPTQ INT4 version;
    a checkpoint already in `root` (an earlier step of bench/gpu_session.sh) is reused."""
    from tests.random_quantized import write_gptq_fast

    float_dir, int4_dir = f"{root}/bf16", f"{root}/int4"
    if not os.path.exists(f"{float_dir}/config.json"):
        write_random_checkpoint(spec, float_dir, device=device)
    if "int4" in formats and not os.path.exists(f"{int4_dir}/config.json"):
        write_gptq_fast(float_dir, int4_dir, 128, device)
    return {"bf16": float_dir, "fp8": float_dir, "int4": int4_dir}


def greedy_tokens(llm, vocab: int, max_tokens: int) -> list[list[int]]:
    prompts = random_prompts(PARITY_PROMPTS, vocab, 16, 64, seed=7)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def measure(llm, fmt: str, config, batch: int, args, bandwidth: float) -> Row:
    vocab = config.vocab_size
    step = decode_ms(llm, vocab, batch, args.context, args.steps, args.device)
    replay = forward_ms(llm, batch, args.device)
    mean_context = args.context + _warm_steps(batch, args.context) + args.steps // 2
    weights, kv = step_bytes(llm.engine.executor.runner.model, batch, mean_context, config)
    floor = (weights + kv) / bandwidth * 1e3
    return Row(
        format=fmt,
        async_scheduling=llm.engine.config.uses_async_scheduling(),
        batch=batch,
        step_ms=step,
        replay_ms=replay,
        floor_ms=floor,
        step_over_replay=step / replay if replay else None,
        floor_share_of_replay=floor / replay if replay else None,
        floor_share_of_step=floor / step,
    )


def run_engine(path: str, fmt: str, mode: str, args, bandwidth: float) -> tuple[list[Row], list]:
    """One engine: its greedy tokens, then one row per batch size."""
    config = AutoConfig.from_pretrained(path)
    llm = make_llm(
        path,
        fmt,
        args.device,
        max(args.batches),
        args.context,
        args.steps + args.parity_tokens,
        async_scheduling=mode == "on",
    )
    try:
        tokens = greedy_tokens(llm, config.vocab_size, args.parity_tokens)
        rows = [measure(llm, fmt, config, b, args, bandwidth) for b in args.batches]
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return rows, tokens


def print_row(r: Row) -> None:
    replay = "-" if r.replay_ms is None else f"{r.replay_ms:.3f}"
    ratio = "-" if r.step_over_replay is None else f"{r.step_over_replay:.2f}x"
    share = "-" if r.floor_share_of_replay is None else f"{r.floor_share_of_replay:.0%}"
    print(
        f"| {r.format} | {'on' if r.async_scheduling else 'off'} | {r.batch} | {r.step_ms:.3f} | "
        f"{replay} | {r.floor_ms:.3f} | {ratio} | {share} | {r.floor_share_of_step:.0%} |",
        flush=True,
    )


def ratios(rows: list[Row]) -> dict[str, float]:
    """Async on / off per (format, batch), and each format's step / bf16's (same async mode)."""
    by = {(r.format, r.async_scheduling, r.batch): r.step_ms for r in rows}
    out = {}
    for (fmt, on, batch), ms in by.items():
        if on and (fmt, False, batch) in by:
            out[f"{fmt}_b{batch}_async_on_over_off"] = ms / by[(fmt, False, batch)]
        if fmt != "bf16" and ("bf16", on, batch) in by:
            mode = "on" if on else "off"
            out[f"{fmt}_b{batch}_async_{mode}_over_bf16"] = ms / by[("bf16", on, batch)]
    return out


@dataclass(slots=True)
class Results:
    """What the run found so far; written out after every engine, so that a run killed by its
    timeout (an engine that hangs) still leaves the engines before it."""

    bandwidth_gbs: float
    path: str | None
    rows: list[Row] = field(default_factory=list)
    tokens_identical_across_async: dict[str, bool] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # "fmt async mode": traceback

    def save(self) -> None:
        if self.path:
            out = {k: v for k, v in asdict(self).items() if k != "path"}
            out["ratios"] = ratios(self.rows)
            Path(self.path).write_text(json.dumps(out, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, a tiny shape")
    parser.add_argument("--formats", nargs="+", default=["bf16"], choices=["bf16", "fp8", "int4"])
    parser.add_argument("--async-modes", nargs="+", default=["off", "on"], choices=["off", "on"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--parity-tokens", type=int, default=32, help="greedy tokens a prompt")
    parser.add_argument("--models", default=None, help="checkpoint folder, reused if present")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.smoke:
        args.device, spec, args.context, args.steps, args.parity_tokens = "cpu", SMOKE, 32, 4, 8
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --smoke on CPU")
        args.device, spec = "cuda", SHAPES["llama3-1b"]
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_models(spec, args.models or tmp, args.device, args.formats)
        size = 2 * GiB if args.device == "cuda" else 64 << 20
        bandwidth = copy_bandwidth(args.device, size)
        print(f"copy bandwidth: {bandwidth / 1e9:.0f} GB/s (read + written)", flush=True)
        print(
            "| format | async | batch | step ms | replay ms | floor ms | step/replay | "
            "floor/replay | floor/step |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
        )
        results = Results(bandwidth / 1e9, args.json)
        run_all(paths, args, bandwidth, results)
    for key, value in ratios(results.rows).items():
        print(f"{key}: {value:.2f}x")
    print(f"greedy tokens identical, async off vs on: {results.tokens_identical_across_async}")
    if results.errors:
        raise SystemExit(f"{len(results.errors)} engine(s) failed: {', '.join(results.errors)}")


def run_all(paths: dict[str, str], args, bandwidth: float, results: Results) -> None:
    """Every (format, async mode) engine in turn; per format, whether all modes' tokens agree.
    An engine that fails (async scheduling has never run on a GPU) is recorded in the errors and
    the others still run."""
    for fmt in args.formats:
        tokens = []
        for mode in args.async_modes:
            try:
                rows, mode_tokens = run_engine(paths[fmt], fmt, mode, args, bandwidth)
            except Exception:
                error = results.errors[f"{fmt} async {mode}"] = traceback.format_exc(limit=4)
                print(f"{fmt} async {mode}: FAILED\n{error}", flush=True)
                results.save()
                continue
            for r in rows:
                print_row(r)
            results.rows += rows
            tokens.append(mode_tokens)
            if len(tokens) > 1:
                same = all(t == tokens[0] for t in tokens[1:])
                results.tokens_identical_across_async[fmt] = same
            results.save()


if __name__ == "__main__":
    main()
