"""GGUF kept quantized on CPU against the de-quantised fp32 path, on the same file and threads.

Each system runs in its own subprocess (so its RSS is its own), in the order given, on the
embedded SmolLM2-135M-Instruct Q4_1 GGUF (or --model):
  - decode tok/s at batch 1, 8 and 32: (t(max_tokens=1 + n) - t(max_tokens=1)) per token, greedy,
    ignore_eos, prompts of 16 distinct random tokens (no prefix-cache hits);
  - prompt tok/s: one 512-token prompt of distinct random tokens, max_tokens=1;
  - process RSS after the runs (the default 2 GiB KV pool included, as in issue 31).
llama.cpp (`llama-cpp-python`, from --llama-python, a separate venv) runs the same file and thread
count when that interpreter imports llama_cpp; otherwise it is skipped and said so.

Quality (--quality N): N prompts (chat-templated, fixed seed), 32 greedy tokens each with top-2
logprobs, through both raylm paths in one process: the share of identical tokens, and the
largest difference of the sampled token's logprob while the two agree. A first difference is
accepted only at a near-tie of the fp32 path (top-2 logprobs within NEAR_TIE, stated below).

    python bench/quantized_cpu.py [--threads 2] [--systems gguf,none,llama.cpp] [--quality 32]
        [--llama-python /work/venvs/llamacpp/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.prompts, run as a script

# A first difference is accepted at a top-2 gap up to this. 1e-3 held while the GGUF path kept
# float32 activations (1,024 of 1,024 tokens identical); its int8 activations, rounded per
# 32-element block as llama.cpp's are, part from fp32 at gaps up to 0.35 nats (2026-11-26,
# 32 prompts): the widest gap at a difference is reported beside the verdicts.
NEAR_TIE = 0.5
DECODE_TOKENS = 64
PROMPT_LEN = 512


def _prompts(rng: random.Random, n: int, length: int) -> list[list[int]]:
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def _timed(llm, prompts: list[list[int]], max_tokens: int) -> float:
    from scheduler import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    return time.perf_counter() - t0


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_raylm(model: str, quantization: str, threads: int, seed: int) -> dict:
    import torch

    from engine.llm import LLM

    torch.set_num_threads(threads)
    llm = LLM(model=model, device="cpu", quantization=quantization, load_progress=False)
    rss_loaded = _rss_mib()
    rng = random.Random(seed)
    _timed(llm, _prompts(rng, 1, 16), 8)  # warm-up: kernels built, caches touched
    out: dict = {"system": f"raylm quantization={quantization}", "rss_loaded_mib": rss_loaded}
    for batch in (1, 8, 32):
        first = _timed(llm, _prompts(rng, batch, 16), 1)
        full = _timed(llm, _prompts(rng, batch, 16), 1 + DECODE_TOKENS)
        out[f"decode_b{batch}_tok_s"] = batch * DECODE_TOKENS / max(full - first, 1e-9)
    _timed(llm, _prompts(rng, 1, PROMPT_LEN), 1)  # warm the prefill shapes
    best = min(_timed(llm, _prompts(rng, 1, PROMPT_LEN), 1) for _ in range(3))
    out["prompt_tok_s"] = PROMPT_LEN / best
    out["rss_mib"] = _rss_mib()
    out["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def run_llama_cpp(model: str, threads: int, seed: int) -> dict:
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=model, n_threads=threads, n_ctx=1024, n_batch=512, verbose=False)
    rng = random.Random(seed)
    out: dict = {"system": "llama.cpp (llama-cpp-python)"}
    llm.reset()
    llm.eval(_prompts(rng, 1, 16)[0])
    t0 = time.perf_counter()
    for _ in range(DECODE_TOKENS):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    out["decode_b1_tok_s"] = DECODE_TOKENS / (time.perf_counter() - t0)
    best = float("inf")
    for _ in range(3):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(_prompts(rng, 1, PROMPT_LEN)[0])
        best = min(best, time.perf_counter() - t0)
    out["prompt_tok_s"] = PROMPT_LEN / best
    out["rss_mib"] = _rss_mib()
    return out


def quality(model: str, n: int, threads: int, seed: int) -> dict:
    import torch

    from engine.llm import LLM
    from scheduler import SamplingParams
    from tests.prompts import random_chats

    torch.set_num_threads(threads)
    chats = random_chats(n, seed, max_words=30)
    sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=2)
    runs = {}
    for q in ("none", "gguf"):
        llm = LLM(
            model=model, device="cpu", quantization=q, load_progress=False, kv_cache_memory_gb=0.25
        )
        runs[q] = llm.chat(chats, sp, use_tqdm=False)
        llm.shutdown()
    return compare(runs["none"], runs["gguf"])


def compare(reference, candidate) -> dict:
    """Identical-token share, near-tie check of each first difference, largest logprob gap."""
    same = total = 0
    worst_gap = widest_tie = 0.0
    failures = []
    for ref, cand in zip(reference, candidate, strict=True):
        total += len(ref.token_ids)
        for i, (a, b) in enumerate(zip(ref.token_ids, cand.token_ids, strict=True)):
            if a != b:
                top1, top2 = ref.logprobs[i][1][1], ref.logprobs[i][2][1]
                widest_tie = max(widest_tie, top1 - top2)
                if top1 - top2 > NEAR_TIE:
                    failures.append((ref.request_id, i, top1 - top2))
                break
            same += 1
            worst_gap = max(worst_gap, abs(ref.logprobs[i][0][1] - cand.logprobs[i][0][1]))
    return {
        "prompts": len(reference),
        "tokens": total,
        "identical_share": same / total,
        "max_logprob_diff": worst_gap,
        "widest_top2_gap_at_a_difference": widest_tie,
        "not_near_tie_differences": failures,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--systems", default="gguf,none,llama.cpp")
    p.add_argument("--quality", type=int, default=32, help="prompts (0: skip)")
    p.add_argument("--model", default=None, help="a .gguf file (default: the embedded one)")
    p.add_argument("--llama-python", default="/work/venvs/llamacpp/bin/python")
    p.add_argument("--seed", type=int, default=31)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.model is None:  # the llama.cpp child always gets --model: its venv has no transformers
        from workers.model_files import default_model_path

        a.model = str(default_model_path())
    model = a.model
    if a.one is not None:  # a child: one system, JSON on the last line
        if a.one == "llama.cpp":
            result = run_llama_cpp(model, a.threads, a.seed)
        else:
            result = run_raylm(model, a.one, a.threads, a.seed)
        print(json.dumps(result))
        return
    print(f"model {model}, {a.threads} threads, torch threads pinned per child")
    for system in a.systems.split(","):
        python = a.llama_python if system == "llama.cpp" else sys.executable
        if system == "llama.cpp" and not _imports(python, "llama_cpp"):
            print(f"llama.cpp: skipped ({python} cannot import llama_cpp)")
            continue
        cmd = [python, __file__, "--one", system, "--threads", str(a.threads), "--model", model]
        env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            print(f"{system}: failed\n{proc.stderr[-2000:]}")
            continue
        print(json.dumps(json.loads(proc.stdout.strip().splitlines()[-1])), flush=True)
    if a.quality:
        print(json.dumps({"quality": quality(model, a.quality, a.threads, a.seed)}))


def _imports(python: str, module: str) -> bool:
    if not os.path.exists(python):
        return False
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0


if __name__ == "__main__":
    main()
