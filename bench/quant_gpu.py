"""Quantized decode on a GPU: bf16, FP8 (on the fly) and INT4 (GPTQ, group 128) decode steps at
batch 1, 8 and 64, each against its own bandwidth floor.

Per shape (Llama 3.2 1B; an 8B shape cut to --layers-8b layers, random weights written here) one
engine per format serves `batch` requests of --context-token prompts; the timed steps are pure
decode steps (CUDA graphs, as served). The floor is the bytes a step must read (every linear in its
format, the LM head, the KV of every request) at the device copy bandwidth measured in the same run
(bytes read + written per second, as bench/gpu_bench.py measures it). First, each quantized
kernel is checked against a float de-quantization of the same weight (max relative error).

Needs torch and transformers only (no Ray, flash-attn, gguf or FastAPI).

    python bench/quant_gpu.py                 # CUDA, about 2-3 minutes on an H100
    python bench/quant_gpu.py --smoke         # CPU: a tiny shape, checks the script end to end
    python bench/quant_gpu.py --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.step_llm import step_llm
from scheduler import SamplingParams
from scheduler.request import EngineRequest
from tests.random_checkpoint import (
    SHAPES,
    ModelSpec,
    random_prompts,
    write_random_checkpoint,
)
from tests.random_quantized import write_gptq_fast

GiB = 1 << 30
FORMATS = ("bf16", "fp8", "int4")

LLAMA_8B = dataclasses.replace(
    SHAPES["llama3-1b"],
    fields={
        **SHAPES["llama3-1b"].fields,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "head_dim": 128,
        "tie_word_embeddings": False,
    },
    head_std=4.0 / 4096**0.5,
)
# A tiny Llama whose linears hold whole INT4 groups of 128 and 16-row blocks (the CPU kernel).
SMOKE = ModelSpec(
    "LlamaConfig",
    dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    ),
    matrix_std=0.05,
    head_std=0.3,
    dtype=torch.bfloat16,
)


def copy_bandwidth(device: str, num_bytes: int) -> float:
    """Device copy rate, bytes read plus bytes written per second."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    t = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    _sync(device)
    return 2 * num_bytes * 10 / (time.perf_counter() - t)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def check_kernels(device: str, dtype: torch.dtype) -> dict:
    """Max relative error of each quantized kernel against the float product of its de-quantized
    weight (FP8: of its de-quantized operands, activations included)."""
    from workers.layers.fp8 import check_device, quantize_rows, quantize_weight
    from workers.layers.int4 import Int4Weight, pack_nibbles

    gen = torch.Generator(device=device).manual_seed(0)
    n, k, rows = 1024, 2048, 8
    x = torch.randn(rows, k, device=device, generator=gen).to(dtype)
    w = torch.randn(n, k, device=device, generator=gen) * 0.02
    check_device(torch.device(device))
    fp8 = quantize_weight(w)
    xq, xs = quantize_rows(x)
    ref = (xq.float() * xs) @ fp8.dequantize().t()
    out = {"fp8": _rel(fp8.matmul(x.repeat(4, 1)), ref.repeat(4, 1))}  # 32 rows: W8A8
    out["fp8_weight_only"] = _rel(fp8.matmul(x), x.float() @ fp8.dequantize().t())
    groups = k // 128
    int4 = Int4Weight(
        pack_nibbles(torch.randint(0, 16, (n, k), device=device, generator=gen)),
        torch.rand(n, groups, device=device, generator=gen) * 0.01,
        torch.randint(0, 16, (n, groups), device=device, generator=gen).to(torch.uint8),
        128,
    )
    ref = x.float() @ int4.dequantize().t()
    int4.prepare(dtype)
    out["int4"] = _rel(int4.matmul(x), ref)
    out["int4_kernel"] = type(int4.kernel).__name__ if int4.kernel is not None else "reference"
    return out


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max())


def write_models(spec: ModelSpec, root: str, device: str) -> dict[str, str]:
    """The bf16 checkpoint (FP8 quantizes it at load) and its GPTQ INT4 version."""
    float_dir, int4_dir = f"{root}/bf16", f"{root}/int4"
    write_random_checkpoint(spec, float_dir, device=device)
    write_gptq_fast(float_dir, int4_dir, 128, device)
    return {"bf16": float_dir, "fp8": float_dir, "int4": int4_dir}


def make_llm(path: str, fmt: str, device: str, batch: int, context: int, steps: int, **extra):
    return step_llm(
        path,
        device=device,
        dtype="bfloat16" if device == "cuda" else "float32",
        batch=batch,
        request_tokens=context + steps + _warm_steps(batch, context) + 8,
        budget=_budget(context),
        quantization="fp8" if fmt == "fp8" else "auto",
        **extra,
    )


def _warm_steps(batch: int, context: int) -> int:
    """Steps before the timed ones: the prefill chunks, then two decode steps."""
    return -(-batch * context // _budget(context)) + 2


def _budget(context: int) -> int:
    return max(2048, context)


def decode_ms(
    llm, vocab: int, batch: int, context: int, steps: int, device: str, after_warm=None
) -> float:
    """Mean wall time of a pure decode step with `batch` requests of `context` tokens (every
    request still running through the timed steps). `after_warm(engine)`, if given, runs between
    the warm-up and the timed steps (a profiler's steps)."""
    engine = llm.engine
    prompts = random_prompts(batch, vocab, context, context, seed=batch)
    warm = _warm_steps(batch, context)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=warm + steps + 4, ignore_eos=True)
        engine.add_request(EngineRequest(f"b{batch}-{i}", prompt, params))
    for _ in range(warm):
        engine.step()
    if after_warm is not None:
        after_warm(engine)
    _sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(device)
    ms = (time.perf_counter() - t) / steps * 1e3
    while engine.has_unfinished_requests():
        engine.step()
    return ms


def step_bytes(model, batch: int, context: int, config) -> tuple[int, int]:
    """(weight bytes, KV bytes) one decode step reads: every linear in its format, the LM head."""
    from workers.layers.linear import CpuPackedWeight

    weights = 0
    for module in model.modules():
        if isinstance(module, CpuPackedWeight):
            kept = getattr(module.weight, "quant", None)
            weights += kept.nbytes() if kept is not None else _tensor_bytes(module.weight)
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * d * 2 * batch * context
    return weights, kv


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def bench_shape(name, spec, args, bandwidth) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(dir=args.tmp) as root:
        t = time.perf_counter()
        paths = write_models(spec, root, args.device)
        print(f"{name}: checkpoints written in {time.perf_counter() - t:.0f}s", flush=True)
        for fmt in FORMATS:
            llm = make_llm(
                paths[fmt], fmt, args.device, max(args.batches), args.context, args.steps
            )
            config = AutoConfig.from_pretrained(paths[fmt])
            for batch in args.batches:
                ms = decode_ms(llm, config.vocab_size, batch, args.context, args.steps, args.device)
                mean_context = args.context + _warm_steps(batch, args.context) + args.steps // 2
                # No local for the model: its layers hold the KV pool past the engine's shutdown.
                model = llm.engine.executor.runner.model
                weights, kv = step_bytes(model, batch, mean_context, config)
                del model
                floor = (weights + kv) / bandwidth * 1e3
                row = dict(shape=name, format=fmt, batch=batch, step_ms=ms, floor_ms=floor)
                row |= dict(weights_gb=weights / 1e9, kv_gb=kv / 1e9, floor_share=floor / ms)
                rows.append(row)
                print(
                    f"  {fmt:5s} batch {batch:3d}: step {ms:8.3f} ms, floor {floor:7.3f} ms "
                    f"({row['weights_gb']:.2f} GB weights + {row['kv_gb']:.3f} GB KV), "
                    f"{floor / ms:.0%} of the floor",
                    flush=True,
                )
            llm.shutdown()
            del llm
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
    return rows


def ratios(rows: list[dict]) -> None:
    by = {(r["shape"], r["format"], r["batch"]): r["step_ms"] for r in rows}
    for (shape, fmt, batch), ms in by.items():
        if fmt != "bf16":
            print(
                f"{shape} {fmt} batch {batch}: {ms / by[(shape, 'bf16', batch)]:.2f}x bf16's step"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, a tiny shape, two batches")
    parser.add_argument("--layers-8b", type=int, default=8, help="layers of the 8B shape")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--tmp", default=None, help="where checkpoints are written")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if args.smoke:
        args.device, args.batches, args.context, args.steps = "cpu", (1, 8), 32, 4
        shapes = {"smoke": SMOKE}
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --smoke on CPU")
        args.device, args.batches = "cuda", (1, 8, 64)
        cut = dict(LLAMA_8B.fields, num_hidden_layers=args.layers_8b)
        shapes = {"llama3-1b": SHAPES["llama3-1b"], "llama3-8b": LLAMA_8B.with_fields(**cut)}
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    print(f"kernel check (max relative error): {check_kernels(args.device, dtype)}")
    bandwidth = copy_bandwidth(args.device, (2 * GiB) if args.device == "cuda" else (64 << 20))
    print(f"copy bandwidth: {bandwidth / 1e9:.0f} GB/s (read + write)", flush=True)
    rows = []
    for name, spec in shapes.items():
        rows += bench_shape(name, spec, args, bandwidth)
    ratios(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"bandwidth": bandwidth, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
