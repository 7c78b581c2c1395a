"""Multi-LoRA on CPU: a decode step with adapters against the base model alone, in the same run.

On the embedded SmolLM2-135M (de-quantised fp32, oneDNN-packed linears) or --model (an HF
directory), one engine with `max_loras` slots:
  - decode step at batch B (default 32): B requests, each past its prompt, stepped together; the
    step time is the median over rounds that alternate the base-only batch and a batch spread
    evenly over N distinct rank-R adapters (default 8 of rank 16 on all seven projections). The
    ratio lora / base is the figure (issue 32's target: at most 1.3x);
  - adapter load: add_lora (read and checked from disk), the worker's read into its CPU cache, and
    the copy of a cached adapter into a device slot;
  - cold adapter: the latency of a one-token request under an adapter never used before (read,
    slotted, prefilled) against the same request again (warm) and under the base model.

Adapters are written in PEFT's file layout with random weights (no training, no peft needed).

    python bench/lora_bench.py [--batch 32] [--adapters 8] [--rank 16] [--rounds 5] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

COLD = 3  # adapters first used by the cold-start measurement
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: str, hf_config, rank: int, seed: int) -> str:
    """A rank-`rank` LoRA over every projection, as peft's save_pretrained lays it out."""
    import torch
    from safetensors.torch import save_file

    from workers.lora.adapter import ModelShapes

    shapes = ModelShapes.from_hf_config(hf_config).shapes
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for target in TARGETS:
            out_f, in_f = shapes[target]
            part = "self_attn" if target in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.02
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return path


def decode_step_s(engine, prompts, loras, steps: int, tag: str) -> list[float]:
    """Put len(prompts) requests past their prompts, then time `steps` decode steps of them."""
    from scheduler import EngineRequest, SamplingParams

    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt, lora in zip(ids, prompts, loras):
        engine.add_request(EngineRequest(rid, prompt, params, lora_name=lora))
    started: set[str] = set()
    while len(started) < len(ids):
        started |= {o.request_id for o in engine.step() if o.new_token_ids}
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    engine.abort_requests(ids)
    engine.step()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()

    from transformers import AutoConfig

    from engine.llm import LLM
    from scheduler import EngineRequest, SamplingParams

    root = tempfile.mkdtemp(prefix="lora-bench-")
    llm = LLM(
        args.model,
        device="cpu",
        quantization="none",
        load_progress=False,
        kv_cache_memory_gb=0.5,
        max_loras=args.adapters,
        max_cpu_loras=args.adapters + COLD,  # every adapter stays loaded
        max_lora_rank=args.rank,
        lora_root=root,
        cpu_threads=args.threads,
    )
    engine = llm.engine
    hf_config = AutoConfig.from_pretrained(engine.model_dir)
    names = [f"bench-{i}" for i in range(args.adapters + COLD)]  # the last COLD stay cold
    paths = [
        write_adapter(os.path.join(root, n), hf_config, args.rank, i) for i, n in enumerate(names)
    ]
    add_s = []
    for name, path in zip(names, paths):
        t0 = time.perf_counter()
        engine.add_lora(name, path)
        add_s.append(time.perf_counter() - t0)
    manager = engine.executor.runner.loras  # the in-process worker's adapters
    t0 = time.perf_counter()
    engine.loras.prepare("bench-read", paths[0])  # read and check, as a load does
    read_s = time.perf_counter() - t0
    identity = engine.loras.slots.identities[names[0]]
    t0 = time.perf_counter()
    manager.load({args.adapters - 1: (names[0], identity)})
    slot_s = time.perf_counter() - t0
    manager.slot_of.clear()  # the scheduler assigns the slots from here on
    adapter_mib = manager.kept[identity].nbytes / 2**20

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(16)] for _ in range(args.batch)]
    spread = [names[i % args.adapters] for i in range(args.batch)]
    base_steps: list[float] = []
    lora_steps: list[float] = []
    decode_step_s(engine, prompts, spread, 2, "warm-lora")  # load the adapters once
    decode_step_s(engine, prompts, [None] * args.batch, 2, "warm-base")
    for r in range(args.rounds):
        base_steps += decode_step_s(engine, prompts, [None] * args.batch, args.steps, f"b{r}")
        lora_steps += decode_step_s(engine, prompts, spread, args.steps, f"l{r}")
    base, lora = statistics.median(base_steps), statistics.median(lora_steps)

    one = SamplingParams(max_tokens=1, temperature=0.0)
    prompt = [rng.randrange(100, 40000) for _ in range(64)]

    def first_token_s(lora_name: str | None, tag: str) -> float:
        t0 = time.perf_counter()
        engine.add_request(EngineRequest(tag, list(prompt), one, lora_name=lora_name))
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - t0

    engine.config.scheduler.enable_prefix_caching = False  # each request computes its prompt
    engine.scheduler.kv.enable_prefix_caching = False
    cold = statistics.median(first_token_s(n, f"cold-{n}") for n in names[-COLD:])
    warm = statistics.median(first_token_s(names[-1], f"warm-{i}") for i in range(COLD))
    base_first = statistics.median(first_token_s(None, f"base-{i}") for i in range(COLD))

    print(
        f"model {args.model} ({hf_config.num_hidden_layers} layers, hidden {hf_config.hidden_size})"
    )
    print(f"threads {args.threads or 'default'}, max_loras {args.adapters}, rank {args.rank}")
    print(f"decode step, batch {args.batch}, {args.rounds} rounds x {args.steps} steps (median):")
    print(f"  base model only        {base * 1e3:8.2f} ms")
    print(f"  {args.adapters} adapters (rank {args.rank}) {lora * 1e3:8.2f} ms")
    print(f"  ratio lora / base      {lora / base:8.3f}")
    print(
        f"adapter size {adapter_mib:.1f} MiB "
        f"(fp32, 7 projections x {hf_config.num_hidden_layers} layers)"
    )
    print(f"add_lora (read + check) median {statistics.median(add_s) * 1e3:.1f} ms")
    print(f"read + check (off the engine)  {read_s * 1e3:.1f} ms")
    print(f"copy into a device slot        {slot_s * 1e3:.1f} ms")
    print(
        f"first token, 64-token prompt (median of {COLD}): cold adapter {cold * 1e3:.1f} ms, "
        f"warm {warm * 1e3:.1f} ms, base {base_first * 1e3:.1f} ms"
    )
    llm.shutdown()


if __name__ == "__main__":
    main()
