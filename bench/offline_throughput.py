"""Offline throughput: raylm vs Hugging Face static batching on the embedded SmolLM2-135M.

Workload (fixed seed): 64 chat-templated prompts of 20-200 tokens, max_tokens uniform in
[16, 128], greedy, ignore_eos. Both systems run in this process; the figure is useful output
tokens per second (HF decodes every row of a batch to the batch's longest max_tokens; only each
request's own max_tokens count). raylm's tokens are compared with HF's greedy output; a
difference is accepted only at a near-tie (HF's top-2 logprobs within 1e-3).
Roofline: a large fp32 GEMM measured in the same run; SmolLM2 costs ~0.27 GFLOP per token.

    python bench/offline_throughput.py [--dtypes float32,bfloat16] [--hf-batch 32] [--skip-hf]
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import time

import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from engine.llm import LLM
from scheduler import SamplingParams

SEED = 2024
NUM_PROMPTS = 64
FLOP_PER_TOKEN = 0.27e9
NEAR_TIE = 1e-3
WORDS = [
    "the",
    "a",
    "of",
    "river",
    "stone",
    "light",
    "market",
    "engine",
    "garden",
    "winter",
    "paper",
    "signal",
    "forest",
    "copper",
    "harbor",
    "lantern",
    "window",
    "orbit",
    "cotton",
    "meadow",
    "thunder",
    "explain",
    "describe",
    "why",
    "how",
    "history",
    "science",
    "music",
    "city",
    "ocean",
    "mountain",
    "travel",
    "friend",
    "computer",
    "language",
]


def build_workload(tokenizer) -> tuple[list[list[int]], list[int]]:
    """64 chat-templated prompts with 20-200 tokens each, and their max_tokens in [16, 128]."""
    rng = random.Random(SEED)
    prompts, max_tokens = [], []
    for _ in range(NUM_PROMPTS):
        target = rng.randint(20, 200)
        words = [rng.choice(WORDS) for _ in range(target)]
        while True:
            messages = [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": " ".join(words)},
            ]
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) <= target or not words:
                break
            words = words[: max(len(words) - max(1, (len(ids) - target) // 2), 0)]
        prompts.append(ids)
        max_tokens.append(rng.randint(16, 128))
    return prompts, max_tokens


def gemm_flops(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def run_raylm(dtype: str, prompts, max_tokens, **knobs) -> tuple[float, list[list[int]]]:
    # fp32 (de-quantised): the path whose tokens equal transformers'.
    llm = LLM(
        model="default",
        dtype=dtype,
        device="cpu",
        load_progress=False,
        quantization="none",
        **knobs,
    )
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up (allocator, kernels)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    llm.shutdown()
    return elapsed, [o.token_ids for o in outs]


@torch.inference_mode()
def run_hf(dtype: torch.dtype, prompts, max_tokens, batch: int):
    """HF generate, static batches with left padding; tokens and per-step top-2 logprobs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from workers.model_files import default_model_path, resolve_model

    path = default_model_path()
    model_dir = resolve_model("default")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype
    ).eval()
    model.generation_config.eos_token_id = None  # ignore_eos
    tokens, top2 = [], []
    t = time.perf_counter()
    for start in range(0, len(prompts), batch):
        chunk, lens = prompts[start : start + batch], max_tokens[start : start + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[tokenizer.pad_token_id or 0] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        config = GenerationConfig(
            max_new_tokens=max(lens),
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        logprobs = torch.stack(out.logits, 1).float().log_softmax(-1).topk(2, dim=-1).values
        for row, n in enumerate(lens):
            tokens.append(out.sequences[row, width : width + n].tolist())
            top2.append(logprobs[row, :n].tolist())
    return time.perf_counter() - t, tokens, top2


def compare(ours: list[list[int]], hf: list[list[int]], top2) -> tuple[int, int, int]:
    """(identical, differing first at a near-tie, differing otherwise) request counts."""
    same = tie = other = 0
    for a, b, t in zip(ours, hf, top2):
        diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if diff is None and len(a) == len(b):
            same += 1
        elif diff is not None and t[diff][0] - t[diff][1] <= NEAR_TIE:
            tie += 1
        else:
            other += 1
    return same, tie, other


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--hf-batch", type=int, default=32)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from transformers import AutoTokenizer

    from workers.model_files import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("default"))
    prompts, max_tokens = build_workload(tokenizer)
    useful = sum(max_tokens)
    print(
        f"workload: {len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens "
        f"({min(map(len, prompts))}-{max(map(len, prompts))} each), {useful} output tokens; "
        f"torch threads {torch.get_num_threads()}"
    )
    knobs = dict(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs)
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        flops = gemm_flops(dtype)
        ceiling = flops / FLOP_PER_TOKEN
        seconds, ours = run_raylm(dtype_name, prompts, max_tokens, **knobs)
        rate = useful / seconds
        print(f"[{dtype_name}] GEMM {flops / 1e9:.0f} GFLOP/s -> ceiling {ceiling:.0f} tok/s")
        print(
            f"[{dtype_name}] raylm: {seconds:.1f} s, {rate:.0f} useful tok/s, "
            f"{100 * rate / ceiling:.0f}% of the roofline"
        )
        if args.skip_hf:
            continue
        hf_seconds, hf_tokens, top2 = run_hf(dtype, prompts, max_tokens, args.hf_batch)
        hf_rate = useful / hf_seconds
        same, tie, other = compare(ours, hf_tokens, top2)
        print(
            f"[{dtype_name}] HF static batch {args.hf_batch}: {hf_seconds:.1f} s, {hf_rate:.0f} "
            "useful tok/s"
        )
        print(
            f"[{dtype_name}] raylm / HF = {rate / hf_rate:.2f}x; tokens vs HF: {same} identical, "
            f"{tie} differ first at a near-tie, {other} differ otherwise"
        )


if __name__ == "__main__":
    main()
