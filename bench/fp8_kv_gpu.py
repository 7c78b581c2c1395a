"""The FP8 KV cache on a GPU (`kv_cache_dtype: fp8` against `auto`, bf16): blocks per
gpu_memory_utilization, the decode step with long contexts, quality, and the kernel's parity.

1. Parity: the Triton decode kernel reading E4M3 codes against torch attention over the same cache
   de-quantized to float32 (max relative error), at the Llama 3.2 1B head layout, contexts to 4k.
2. Quality on a random Llama 3.2 1B (bf16, written here): 32 prompts, teacher-forced, run through
   the model's own attention layers twice (an FP8 cache, a bf16 cache). Prompts are fed in chunks
   of --chunk tokens (every chunk after the first reads its context from the cache, as a
   prefix-cache hit or a chunked prefill does), then --decode-steps single-token decode steps
   (the Triton kernel). Mean KL(bf16 || fp8) per token and top-1 agreement, over the tokens that
   read the cache.
3. Engines: one per cache dtype at the same gpu_memory_utilization (CUDA graphs, as served). Each
   reports the blocks it got, then the mean pure-decode step at batch 1, 8 and 64 with
   --context-token prompts, against the bytes it must read (weights + KV) at the copy bandwidth
   measured in the same run.

Needs torch and transformers only (no Ray, flash-attn or FastAPI). Reuses bench/quant_gpu.py's
copy bandwidth, decode-step timing and weight bytes.

    python bench/fp8_kv_gpu.py            # CUDA (compute capability 8.9+), about 2 minutes
    python bench/fp8_kv_gpu.py --smoke    # CPU: tiny shapes; the kernel under Triton's
                                          # interpreter, quality through the torch backend,
                                          # the block arithmetic, and a bf16 engine's timing
    python bench/fp8_kv_gpu.py --json out.json
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # Triton's interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import dataclasses
import gc
import json
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.quant_gpu import (
    SMOKE,
    _warm_steps,
    copy_bandwidth,
    decode_ms,
    step_bytes,
)
from tests.random_checkpoint import SHAPES, random_prompts, write_random_checkpoint
from workers.kv_cache import KVCache, KVCacheSpec
from workers.kv_fp8 import cache_dtype, dequantize, quantize

GiB = 1 << 30
KV_DTYPES = ("auto", "fp8")
BLOCK = 16


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---- 1. kernel parity ---------------------------------------------------------------------------
def check_kernel(device: str, hq: int, hk: int, d: int, lens: list[int]) -> dict:
    """Max relative error of paged_decode over an FP8 cache (and over the bf16 cache of the same
    values, for scale) against float32 attention over the de-quantized cache."""
    import torch.nn.functional as F

    from workers.layers.backends.triton_decode import paged_decode

    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # the interpreter has no bf16
    gen = torch.Generator(device=device).manual_seed(0)
    per_req = [-(-n // BLOCK) for n in lens]
    num_blocks = sum(per_req) + 4
    perm = torch.randperm(num_blocks, device=device, generator=gen).tolist()
    tables = [[perm.pop() for _ in range(b)] for b in per_req]
    width = max(per_req)
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    shape = (num_blocks, BLOCK, hk, d)
    kv_scale = torch.tensor([0.05, 0.02], device=device)  # K ~ N(0, 2^2), V ~ N(0, 0.5^2)
    k_codes = quantize(torch.randn(shape, device=device, generator=gen) * 2, kv_scale[0])
    v_codes = quantize(torch.randn(shape, device=device, generator=gen) * 0.5, kv_scale[1])
    k_f = dequantize(k_codes, kv_scale[0], torch.float32)
    v_f = dequantize(v_codes, kv_scale[1], torch.float32)
    q = torch.randn(len(lens), hq, d, device=device, generator=gen).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    tables_d = table_t.to(device)
    scale = d**-0.5
    refs = []
    for i, n in enumerate(lens):
        ids = torch.tensor(tables[i], device=device)
        k = k_f[ids].reshape(-1, hk, d)[:n].transpose(0, 1)  # [hk, n, d]
        v = v_f[ids].reshape(-1, hk, d)[:n].transpose(0, 1)
        qi = q[i].float().view(hk, hq // hk, d)
        refs.append(F.scaled_dot_product_attention(qi, k, v, scale=scale).reshape(hq, d))
    ref = torch.stack(refs)
    fp8 = paged_decode(q, k_codes, v_codes, tables_d, seq_lens, scale, kv_scale=kv_scale)
    bf16 = paged_decode(q, k_f.to(dtype), v_f.to(dtype), tables_d, seq_lens, scale)
    _sync(device)

    def rel(y: torch.Tensor) -> float:
        return float((y.float() - ref).abs().max() / ref.abs().max())

    return {"fp8_cache": rel(fp8), "same_values_in_16_bit": rel(bf16), "contexts": lens}


# ---- 2. quality ---------------------------------------------------------------------------------
@torch.inference_mode()
def quality(path: str, device: str, args) -> dict:
    """KL(bf16 cache || fp8 cache) per token and top-1 agreement, teacher-forced."""
    from workers.layers.attention import AttentionMetadata, select_backend
    from workers.loader import load_model

    config = AutoConfig.from_pretrained(path)
    dev = torch.device(device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    length = args.quality_len
    model = load_model(path, config, dtype, dev, length + 16, progress=False)
    layers = model.attention_layers()
    backend = select_backend(dev, "auto", dtype, layers[0].head_dim, BLOCK)
    for layer in layers:
        layer.backend = backend
    blocks_per = -(-length // BLOCK)
    n = args.prompts
    caches = {
        kv: KVCache(KVCacheSpec.of(layers, BLOCK, cache_dtype(kv, dtype)), n * blocks_per, 0, dev)
        for kv in KV_DTYPES
    }
    prompts = torch.tensor(random_prompts(n, config.vocab_size, length, length, seed=7))
    tables = [list(range(i * blocks_per, (i + 1) * blocks_per)) for i in range(n)]
    prefill_end = length - args.decode_steps
    steps = [(s, min(args.chunk, prefill_end - s)) for s in range(0, prefill_end, args.chunk)]
    steps += [(s, 1) for s in range(prefill_end, length)]
    kls: dict[str, list[torch.Tensor]] = {"chunks": [], "decode": []}
    agree: dict[str, list[torch.Tensor]] = {"chunks": [], "decode": []}
    for start, q_len in steps:
        ids = prompts[:, start : start + q_len].reshape(-1).to(dev)
        logps = {}
        for kv, cache in caches.items():
            cache.bind(layers)
            meta, positions = AttentionMetadata.build([start] * n, [q_len] * n, tables, BLOCK, dev)
            backend.prepare(meta)
            hidden = model(ids, positions, meta)
            logps[kv] = model.compute_logits(hidden).float().log_softmax(-1)
        if start == 0:
            continue  # the first chunk attends to its own fresh K/V: the cache is not read
        ref, got = logps["auto"], logps["fp8"]
        part = "decode" if q_len == 1 else "chunks"
        kls[part].append((ref.exp() * (ref - got)).sum(-1))
        agree[part].append(ref.argmax(-1) == got.argmax(-1))
    out = {}
    for part in ("chunks", "decode"):
        kl, top1 = torch.cat(kls[part]), torch.cat(agree[part])
        out[part] = dict(
            mean_kl=kl.mean().item(),
            p99_kl=kl.quantile(0.99).item(),
            top1=top1.float().mean().item(),
            tokens=top1.numel(),
        )
    del model, caches
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


# ---- 3. engines ---------------------------------------------------------------------------------
def budget(context: int) -> int:
    return max(2048, context)  # bench/quant_gpu.py's prefill budget: _warm_steps assumes it


def make_llm(path: str, kv: str, args):
    from engine.llm import LLM

    # decode_ms's requests run their prompt, the warm-up steps, the timed steps and 4 more.
    longest = args.context + _warm_steps(max(args.batches), args.context) + args.steps + 4
    sizing = (
        {"gpu_memory_utilization": args.gpu_memory_utilization}
        if args.device == "cuda"
        else {"kv_cache_memory_gb": 0.25}
    )
    return LLM(
        model=path,
        dtype="bfloat16" if args.device == "cuda" else "float32",
        device=args.device,
        kv_cache_dtype=kv,
        load_progress=False,
        max_num_seqs=max(args.batches),
        max_num_batched_tokens=budget(args.context),
        max_model_len=-(-longest // BLOCK) * BLOCK,
        block_size=BLOCK,
        **sizing,
    )


def kv_bytes(config, batch: int, context: int, elem: int) -> int:
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * d * elem * batch * context


def bench_engines(path: str, args, bandwidth: float) -> list[dict]:
    config = AutoConfig.from_pretrained(path)
    rows = []
    kinds = KV_DTYPES if args.device == "cuda" else ("auto",)  # FP8 KV is refused on CPU
    for kv in kinds:
        t = time.perf_counter()
        llm = make_llm(path, kv, args)
        blocks = llm.engine.num_gpu_blocks
        sized = (
            f"gpu_memory_utilization {args.gpu_memory_utilization}"
            if args.device == "cuda"
            else "kv_cache_memory_gb 0.25"
        )
        print(
            f"kv_cache_dtype {kv}: {blocks} blocks of {BLOCK} tokens "
            f"({blocks * BLOCK / 1e6:.2f}M tokens) at {sized} "
            f"(engine up in {time.perf_counter() - t:.0f}s)",
            flush=True,
        )
        elem = 1 if kv == "fp8" else (2 if args.device == "cuda" else 4)
        for batch in args.batches:
            ms = decode_ms(llm, config.vocab_size, batch, args.context, args.steps, args.device)
            context = args.context + args.steps  # about the mean context of the timed steps
            # Not kept in a local: the model's attention layers hold views of the KV pool, which
            # would outlive the engine's shutdown and leave the next engine no memory.
            weights, _ = step_bytes(llm.engine.executor.runner.model, batch, context, config)
            kv_b = kv_bytes(config, batch, context, elem)
            floor = (weights + kv_b) / bandwidth * 1e3
            rows.append(
                dict(kv_cache_dtype=kv, blocks=blocks, batch=batch, step_ms=ms, floor_ms=floor)
                | dict(weights_gb=weights / 1e9, kv_gb=kv_b / 1e9)
            )
            print(
                f"  {kv:4s} batch {batch:3d}, context {args.context}: step {ms:8.3f} ms, floor "
                f"{floor:7.3f} ms ({weights / 1e9:.2f} GB weights + {kv_b / 1e9:.2f} GB KV)",
                flush=True,
            )
        llm.shutdown()
        del llm
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
            # What the next engine's profile must not find still held (it would size over it).
            print(f"  after shutdown: {torch.cuda.memory_reserved() / GiB:.2f} GiB reserved")
    return rows


def block_arithmetic(path: str, budget_bytes: float) -> dict:
    """Blocks a budget holds for each cache dtype (the arithmetic cuda_num_blocks applies)."""
    config = AutoConfig.from_pretrained(path)
    out = {}
    for kv in KV_DTYPES:
        spec = KVCacheSpec.from_hf_config(config, BLOCK, cache_dtype(kv, torch.bfloat16))
        out[kv] = spec.blocks_in(budget_bytes)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per batch")
    # Below the serving default (0.9) so that a pool the first engine failed to release cannot
    # push the second past the device; the blocks' ratio does not depend on it.
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--quality-len", type=int, default=1024, help="tokens per prompt")
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk of the quality run")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--skip-engines", action="store_true", help="parity and quality only")
    parser.add_argument("--tmp", default=None, help="where the checkpoint is written")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if args.smoke:
        args.device, args.batches, args.context, args.steps = "cpu", (1, 4), 64, 3
        args.prompts, args.quality_len, args.chunk, args.decode_steps = 4, 48, 16, 8
        spec = dataclasses.replace(SMOKE, dtype=torch.float32)
        heads, lens = (8, 2, 64), [1, 17, 100]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --smoke on CPU")
        args.device, args.batches = "cuda", (1, 8, 64)
        spec = SHAPES["llama3-1b"]
        heads, lens = (32, 8, 64), [1, 100, 1000, 4096, 4097, 2500, 64, 4000]
    result: dict = {"device": args.device}
    if args.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
        print(f"GPU: {result['gpu']}")
    t = time.perf_counter()
    result["parity"] = check_kernel(args.device, *heads, lens)
    print(f"kernel parity (max relative error vs float32): {result['parity']}", flush=True)
    with tempfile.TemporaryDirectory(dir=args.tmp) as root:
        path = f"{root}/model"
        write_random_checkpoint(spec, path, device=args.device)
        print(f"checkpoint written ({time.perf_counter() - t:.0f}s so far)", flush=True)
        result["quality"] = quality(path, args.device, args)
        for part, q in result["quality"].items():
            print(
                f"quality, fp8 vs bf16 KV, {part}: mean KL {q['mean_kl']:.5f} nats/token (p99 "
                f"{q['p99_kl']:.5f}), top-1 agreement {q['top1']:.4f} over {q['tokens']} tokens",
                flush=True,
            )
        result["blocks_per_budget"] = block_arithmetic(path, 40 * GiB)
        print(f"blocks in 40 GiB: {result['blocks_per_budget']}")
        if not args.skip_engines:
            nbytes = (2 * GiB) if args.device == "cuda" else (64 << 20)
            bandwidth = copy_bandwidth(args.device, nbytes)
            print(f"copy bandwidth: {bandwidth / 1e9:.0f} GB/s (read + write)", flush=True)
            result["bandwidth"] = bandwidth
            result["rows"] = rows = bench_engines(path, args, bandwidth)
            by = {(r["kv_cache_dtype"], r["batch"]): r for r in rows}
            for batch in args.batches:
                if ("fp8", batch) in by:
                    ratio = by[("fp8", batch)]["step_ms"] / by[("auto", batch)]["step_ms"]
                    print(f"batch {batch}: fp8-KV step {ratio:.2f}x bf16-KV's")
            if ("fp8", 1) in by:
                gain = by[("fp8", 1)]["blocks"] / by[("auto", 1)]["blocks"]
                print(f"blocks: fp8 {gain:.2f}x auto's at the same gpu_memory_utilization")
    print(f"done in {time.perf_counter() - t:.0f}s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
