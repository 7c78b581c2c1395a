"""GPU benchmarks, all in one run on one GPU: copy bandwidth, the paged-decode kernel, the decode
roofline (eager vs CUDA graphs) and offline throughput against Hugging Face static batching.

Models are random-weight checkpoints of published shapes written here (tests/random_checkpoint.py):
Llama 3.2 1B for the roofline, Qwen3 0.6B for throughput (nano-vllm's workload: 256 sequences,
input and output lengths uniform in 100..1024, ignore_eos, bf16).

    python bench/gpu_bench.py [--only copy,kernel,roofline,throughput] [--hf-batch 64] [--json
    out.json]
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import os
import random
import sys
import tempfile
import time

import torch

from scheduler.request import EngineRequest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scheduler import SamplingParams
from tests.random_checkpoint import SHAPES, random_prompts, write_random_checkpoint

GiB = 1 << 30


def copy_bandwidth(num_bytes: int = 2 * GiB, repeats: int = 10) -> float:
    """Device-to-device copy rate, bytes read plus bytes written per second."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * num_bytes * repeats / (start.elapsed_time(end) / 1e3)


def graph_time_ms(fn, calls: int = 20, repeats: int = 10) -> float:
    """GPU time of one fn() call, replayed from a CUDA graph so that launch overhead does not
    count."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (repeats * calls)


def bench_kernel(bandwidth: float) -> list[dict]:
    """Triton paged decode vs the torch backend's gather + SDPA, Qwen3-0.6B heads, bf16, block
    16."""
    from workers.layers.attention import AttentionMetadata
    from workers.layers.backends.torch_ref import TorchBackend
    from workers.layers.backends.triton_decode import paged_decode

    rows = []
    hq, hk, d, bs = 16, 8, 128, 16
    for batch, ctx in ((1, 1024), (64, 1024), (256, 512)):
        width = -(-ctx // bs)
        k_cache = torch.randn(batch * width + 1, bs, hk, d, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        tables = [list(range(i * width, (i + 1) * width)) for i in range(batch)]
        meta, _ = AttentionMetadata.build(
            [ctx - 1] * batch, [1] * batch, tables, bs, torch.device("cuda")
        )
        q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
        torch_backend = TorchBackend()
        torch_backend.prepare(meta)
        t_triton = graph_time_ms(
            functools.partial(
                paged_decode, q, k_cache, v_cache, meta.block_tables, meta.seq_lens, d**-0.5
            )
        )
        t_torch = graph_time_ms(
            functools.partial(torch_backend.decode, q, k_cache, v_cache, meta, d**-0.5)
        )
        kv_bytes = 2 * batch * ctx * hk * d * 2
        rows.append(
            dict(
                batch=batch,
                context=ctx,
                triton_us=t_triton * 1e3,
                torch_us=t_torch * 1e3,
                triton_bw_share=kv_bytes / bandwidth / (t_triton / 1e3),
            )
        )
    return rows


def make_llm(path: str, **kwargs):
    """An offline LLM on CUDA in bf16 unless kwargs say otherwise."""
    from engine.llm import LLM

    return LLM(
        model=path, **{"dtype": "bfloat16", "device": "cuda", "load_progress": False, **kwargs}
    )


def release(llm) -> None:
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def decode_step_ms(
    path: str, vocab: int, batch: int, eager: bool, context: int, steps: int = 60
) -> tuple[float, float]:
    """(engine step, forward) milliseconds with `batch` requests decoding, on an LLM of its own."""
    blocks_per_request = -(-(context + steps + 40) // 16)
    llm = make_llm(
        path,
        enforce_eager=eager,
        max_num_seqs=max(batch, 8),
        max_num_batched_tokens=16384,
        max_model_len=16 * blocks_per_request,
        num_gpu_blocks=batch * blocks_per_request + 16,
    )
    try:
        return time_decode_steps(llm, vocab, batch, context, steps)
    finally:
        release(llm)


def time_decode_steps(
    llm, vocab: int, batch: int, context: int, steps: int = 60
) -> tuple[float, float]:
    """(engine step, forward) milliseconds with `batch` requests of `context` prompt tokens
    decoding on `llm` (which must hold batch x (context + steps + 40) tokens of KV); the
    requests are aborted afterwards, so the LLM can time another batch.

    The step is wall time of schedule + forward + sample; the forward is GPU time from the first
    kernel of the model to the logits (CUDA events), launch gaps included (wall time on CPU).
    """
    engine = llm.engine
    runner = engine.executor.runner
    cuda = runner.device.type == "cuda"
    ids = [f"b{batch}-r{i}" for i in range(batch)]
    for rid, prompt in zip(ids, random_prompts(batch, vocab, context, context, seed=batch)):
        engine.add_request(
            EngineRequest(rid, prompt, SamplingParams(max_tokens=steps + 30, ignore_eos=True))
        )
    for _ in range(
        -(-batch * context // 16384) + 5
    ):  # the prefill, then a few decode steps to warm up
        engine.step()
    forward_ms: list[float] = []
    forward = runner._forward

    def timed_forward(batch_inputs):
        if not cuda:
            t = time.perf_counter()
            logits = forward(batch_inputs)
            forward_ms.append((time.perf_counter() - t) * 1e3)
            return logits
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        logits = forward(batch_inputs)
        end.record()
        events.append((start, end))
        return logits

    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    runner._forward = timed_forward
    try:
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
        step_ms = (time.perf_counter() - t) / steps * 1e3
    finally:
        runner._forward = forward
    forward_ms += [a.elapsed_time(b) for a, b in events]
    engine.abort_requests(ids)
    for _ in range(8):  # a step still in flight (async scheduling) ends here
        if not engine.has_unfinished_requests():
            break
        engine.step()
    return step_ms, sum(forward_ms) / len(forward_ms)


def bench_roofline(path: str, bandwidth: float, context: int = 512) -> list[dict]:
    """Decode step vs reading the weights and the KV once at the measured copy bandwidth."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    rows = []
    for batch in (1, 8, 64):
        mean_context = context + 5 + 30  # the timed steps sit 5..65 tokens past the prompt
        weight_bytes, kv_bytes = step_read_bytes(config, batch, mean_context)
        # a copy's rate counts the bytes read and written
        floor_ms = (weight_bytes + kv_bytes) / bandwidth * 1e3
        row = dict(
            batch=batch,
            weights_gb=weight_bytes / 1e9,
            kv_gb=kv_bytes / 1e9,
            floor_ms=floor_ms,
        )
        for eager in (True, False):
            step_ms, forward_ms = decode_step_ms(path, config.vocab_size, batch, eager, context)
            key = "eager" if eager else "graphs"
            row.update(
                {
                    f"{key}_ms": step_ms,
                    f"{key}_share": floor_ms / step_ms,
                    f"{key}_forward_ms": forward_ms,
                    f"{key}_forward_share": floor_ms / forward_ms,
                }
            )
        rows.append(row)
    return rows


def step_read_bytes(config, batch: int, mean_context: int) -> tuple[int, int]:
    """(weight bytes, KV bytes) a bf16 decode step of `batch` requests reads at least."""
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    return 2 * sum(_param_counts(config)), batch * mean_context * kv_per_token


def _param_counts(config) -> list[int]:
    """Parameters a decode step reads: every layer, the final norm, the LM head (tied or not)."""
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    d, hq, hk = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    per_layer = h * d * (hq + 2 * hk) + hq * d * h + 3 * h * i + 2 * h
    if getattr(config, "qk_norm", False) or config.model_type == "qwen3":
        per_layer += 2 * d
    return [layers * per_layer, h, config.vocab_size * h]


def throughput_workload(
    vocab: int, num: int = 256, seed: int = 0
) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [
        [rng.randint(3, vocab - 1) for _ in range(rng.randint(100, 1024))] for _ in range(num)
    ]
    return prompts, [rng.randint(100, 1024) for _ in range(num)]


def bench_raylm(path: str, prompts, max_tokens) -> float:
    llm = make_llm(path, max_num_seqs=512, max_num_batched_tokens=16384, max_model_len=4096)
    params = [SamplingParams(max_tokens=m, temperature=0.6, ignore_eos=True) for m in max_tokens]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    assert [len(o.token_ids) for o in outs] == list(max_tokens)
    release(llm)
    return elapsed


@torch.inference_mode()
def bench_hf(path: str, prompts, max_tokens, batch: int) -> float:
    """HF generate in static batches of `batch` (left padding), each run to its longest output."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    model.generation_config.eos_token_id = None  # ignore_eos
    t = time.perf_counter()
    for start in range(0, len(prompts), batch):
        chunk, lens = prompts[start : start + batch], max_tokens[start : start + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device="cuda")
        config = GenerationConfig(
            max_new_tokens=max(lens), do_sample=True, temperature=0.6, top_k=0, pad_token_id=0
        )
        model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="copy,kernel,roofline,throughput")
    parser.add_argument("--hf-batch", type=int, default=128)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    only = set(args.only.split(","))
    props = torch.cuda.get_device_properties(0)
    result: dict = {
        "gpu": props.name,
        "torch": torch.__version__,
        "memory_gib": props.total_memory / GiB,
    }
    print(f"GPU: {props.name}, {props.total_memory / GiB:.0f} GiB, torch {torch.__version__}")
    bandwidth = copy_bandwidth()
    result["copy_bandwidth_tbs"] = bandwidth / 1e12
    print(f"copy bandwidth (read + written): {bandwidth / 1e12:.2f} TB/s")
    if "kernel" in only:
        result["kernel"] = bench_kernel(bandwidth)
        print(
            "\n| batch | context | Triton paged decode (us) | torch gather + SDPA (us) | Triton "
            "share of copy bw |"
        )
        print("| --- | --- | --- | --- | --- |")
        for r in result["kernel"]:
            print(
                f"| {r['batch']} | {r['context']} | {r['triton_us']:.1f} | {r['torch_us']:.1f} | "
                f"{r['triton_bw_share']:.0%} |"
            )
    with tempfile.TemporaryDirectory() as tmp:
        if "roofline" in only:
            llama = write_random_checkpoint(
                SHAPES["llama3-1b"], os.path.join(tmp, "llama3-1b"), device="cuda"
            ).path
            result["roofline"] = bench_roofline(llama, bandwidth)
            print(
                "\nDecode roofline, Llama-3.2-1B shape, bf16, 512-token prompts (step = schedule "
                "+ forward + sample)"
            )
            print(
                "| batch | weights + KV read (GB) | floor (ms) | mode | forward (ms) | share | "
                "engine step (ms) | share |"
            )
            print("| --- | --- | --- | --- | --- | --- | --- | --- |")
            for r in result["roofline"]:
                for key, label in (("eager", "eager"), ("graphs", "CUDA graphs")):
                    print(
                        f"| {r['batch']} | {r['weights_gb'] + r['kv_gb']:.2f} | "
                        f"{r['floor_ms']:.3f} | {label} | "
                        f"{r[key + '_forward_ms']:.3f} | {r[key + '_forward_share']:.0%} | "
                        f"{r[key + '_ms']:.3f} | {r[key + '_share']:.0%} |"
                    )
        if "throughput" in only:
            qwen = write_random_checkpoint(
                SHAPES["qwen3-0.6b"], os.path.join(tmp, "qwen3-0.6b"), device="cuda"
            ).path
            prompts, max_tokens = throughput_workload(151936, args.num_seqs)
            total = sum(max_tokens)
            ours = bench_raylm(qwen, prompts, max_tokens)
            print(f"raylm: {total} tokens in {ours:.1f}s = {total / ours:.0f} tok/s", flush=True)
            hf = bench_hf(qwen, prompts, max_tokens, args.hf_batch)
            result["throughput"] = dict(
                sequences=len(prompts),
                output_tokens=total,
                raylm_s=ours,
                hf_s=hf,
                raylm_tok_s=total / ours,
                hf_tok_s=total / hf,
                hf_batch=args.hf_batch,
            )
            print(
                f"\nOffline throughput, Qwen3-0.6B shape, bf16, {len(prompts)} sequences, {total} "
                "output tokens"
            )
            print("| system | time (s) | output tok/s | vs HF |")
            print("| --- | --- | --- | --- |")
            print(f"| raylm | {ours:.1f} | {total / ours:.0f} | {hf / ours:.1f}x |")
            print(
                f"| HF transformers, static batches of {args.hf_batch} | {hf:.1f} | "
                f"{total / hf:.0f} | 1.0x |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
