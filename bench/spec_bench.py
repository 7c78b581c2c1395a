"""Speculative decoding (n-gram or a draft model) against plain decoding.

Two modes. Without --device (or with --device cpu): the embedded SmolLM2-135M on CPU, below. With
--device cuda (or --smoke, on CPU with a tiny model): a random-weight checkpoint of Llama 3.2 1B's
shape written on the fly (random weights make a draft model meaningless for acceptance), for
- n-gram on a repetitive workload (prompts of repeated motifs), batch 1 and 8: tokens/s with and
  without speculation;
- the cost of a verify step (every request verifies k proposed tokens) against the plain step
  (CUDA graphs, as served; eager for reference), at k = 2, 4, 8 and `--batches` (1 and 8): engine
  step wall time and forward time, the verify step laid out as decode rows (the paged-decode
  kernels and the captured graphs, as served: workers/verify_rows.py) and as a prefill-style mixed
  batch (the layout before, eager), with the graph replays per verify step (1.00: every one
  replayed a graph).
It needs no Ray, FastAPI, gguf or flash-attn; about a minute and a half on an H200.

    python bench/spec_bench.py --device cuda [--json out.json]
    python bench/spec_bench.py --smoke

Embedded mode (SmolLM2-135M, CPU):

Workloads (chat-templated, greedy, ignore_eos):
- `rewrite`: repeat or lightly edit a provided passage or piece of code (the output copies its
  prompt: what prompt lookup is for), at batch 1 and batch 8;
- `copy-long`: repeat a passage of ~260 tokens word for word, max_tokens 256 (the answer's length:
  the embedded model copies it whole and stops), so the output is the copy, as in the prompt
  lookup examples of vLLM and SGLang;
- `chat`: open questions whose answers do not copy the prompt, at batch 1 and batch 8 (greedy: a
  135M model's greedy answers often repeat themselves, which prompt lookup finds);
- `chat-sampled`: the same questions sampled (temperature 1.0, top-p 0.95, a seed per request, so
  both engines must give the same tokens): output that repeats little, where adaptive skipping
  must keep speculation from costing time.
Both engines live in this process and run each workload in turn, alternating plain and speculative
runs `--repeats` times; the best run of each counts (a shared machine's load only slows a run).
Reported: output tokens/s each way by wall clock and by the process's CPU time (steadier on a
loaded machine), their ratios, the share of proposed tokens accepted, the mean accepted length per
verify row, and whether the greedy tokens are identical.

    python bench/spec_bench.py [--max-tokens 96] [--repeats 3] [--num-tokens 4] [--cpu-threads 1]
        [--method draft --draft-model default]

With `--method draft` the draft model (`--draft-model`: `default` is the embedded model drafting
for itself, which measures the mechanics: acceptance near 1 under greedy, and what the draft's
forwards cost per step) proposes instead of prompt lookup; "ms/step" is the best run's wall time
per engine step.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence

import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.llm import LLM
from scheduler import SamplingParams
from workers.draft_pacing import DraftPacing
from workers.features.draft import DraftFeature

PASSAGES = [
    "Ray is an open-source framework for scaling Python applications. It provides a small set "
    "of primitives, tasks, actors and objects, on which libraries for data processing, training, "
    "tuning and serving are built. A Ray cluster has a head node and any number of worker nodes.",
    "The river rose through the night, and by morning the lower streets of the town were under "
    "water. The bakers carried their flour to the upper floors, the children watched from the "
    "bridge, and the old ferryman said he had seen it twice before, both times in spring.",
    "Speculative decoding proposes several tokens cheaply and checks them with one forward pass "
    "of the large model. Every proposed token that the model agrees with is kept, so the output "
    "is exactly what the model alone would have written, only sooner.",
    "A paged KV cache stores keys and values in fixed-size blocks. Each sequence has a block "
    "table that maps its positions to blocks, so memory is allocated on demand and freed at once "
    "when the sequence finishes, and blocks holding a shared prefix can be shared.",
]
CODE = [
    "def total(xs):\n    s = 0\n    for x in xs:\n        s = s + x\n    return s\n\n\n"
    "def mean(xs):\n    s = total(xs)\n    n = len(xs)\n    return s / n\n",
    "class Counter:\n    def __init__(self):\n        self.n = 0\n\n    def add(self, k):\n"
    "        self.n = self.n + k\n        return self.n\n\n    def reset(self):\n"
    "        self.n = 0\n",
    "def clamp(value, low, high):\n    if value < low:\n        return low\n"
    "    if value > high:\n        return high\n    return value\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print('even', i)\n    else:\n"
    "        print('odd', i)\n",
]
# `copy-long`: a passage of ~260 tokens (written for this bench) that the user asks to have
# repeated; the embedded model copies it whole, with no preamble, and stops (EOS) after 258 tokens,
# so max_tokens is the answer's length and the output is the copy, not the model's own
# continuation. Longer passages (three paragraphs) or code files to edit lose the embedded 135M
# model partway: it rewrites or loops instead of copying, which measures the model, not lookup.
LONG_PASSAGE = (
    "The harbour town of Welling sits where the river meets the sea, and for three hundred years "
    "its people have lived by the tides. Twice a day the water comes in over the mud flats, lifts "
    "the fishing boats from their moorings and fills the narrow channels between the warehouses. "
    "Twice a day it goes out again, and the boats settle on the mud, leaning on their keels like "
    "tired animals. The children of Welling learn the tide tables before they learn to read, "
    "because a walk across the flats at the wrong hour can end with the water at their knees and "
    "the shore still far away. In the middle of the town stands the old customs house, a square "
    "building of grey stone with a clock tower that has not told the right time since the great "
    "storm. The storm came in the autumn of a dry year, when the river was low and nobody expected "
    "the sea to rise so far. It broke the harbour wall in two places, carried away the wooden "
    "bridge and left a fishing boat sitting in the market square, upright and unharmed, as if "
    "someone had parked it there. The boat stayed for a month before the town found a way to move "
    "it, and by then the children had made it into a castle, a ship of pirates and a school."
)
COPY_LONG_MAX_TOKENS = 256
QUESTIONS = [
    "Write a short poem about the first snow of winter.",
    "Why is the sky blue? Explain it to a ten-year-old.",
    "Give me three ideas for a weekend trip near the mountains.",
    "What are the pros and cons of working from home?",
    "Invent a new board game and describe how to play it.",
    "Describe the taste of a lemon to someone who has never had one.",
    "What would a city on the ocean floor need to survive?",
    "Tell a short story about a robot who learns to paint.",
]


def rewrite_prompts(n: int) -> list[list[dict]]:
    asks = []
    for i in range(n):
        if i % 2 == 0:
            text = PASSAGES[(i // 2) % len(PASSAGES)]
            ask = f"Repeat the following passage word for word.\n\n{text}"
        else:
            code = CODE[(i // 2) % len(CODE)]
            ask = f"Rename the function arguments to longer names in this code:\n\n{code}"
        asks.append([{"role": "user", "content": ask}])
    return asks


def copy_long_prompts(n: int) -> list[list[dict]]:
    ask = f"Repeat the following passage word for word.\n\n{LONG_PASSAGE}"
    return [[{"role": "user", "content": ask}] for _ in range(n)]


def chat_prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(n)]


def sampled(n: int, max_tokens: int) -> list[SamplingParams]:
    return [
        SamplingParams(
            max_tokens=max_tokens, temperature=1.0, top_p=0.95, seed=1000 + i, ignore_eos=True
        )
        for i in range(n)
    ]


def count_steps(llm: LLM) -> list[int]:
    """Wrap the engine's step so that calls are counted; the counter (a one-element list)."""
    engine, counter = llm.engine, [0]
    step = engine.step

    def counted():
        counter[0] += 1
        return step()

    engine.step = counted  # type: ignore[method-assign]
    return counter


def run(
    llm: LLM,
    convs: Sequence,
    params: SamplingParams | list[SamplingParams],
    counter: list[int] | None = None,
) -> tuple[tuple[float, float], list, tuple, int]:
    """Chats (or token-id prompts): (wall, CPU) seconds, tokens, spec counts, engine steps."""
    before = llm.engine.stats()
    steps = counter[0] if counter else 0
    t, cpu = time.perf_counter(), time.process_time()
    if convs and isinstance(convs[0][0], int):
        outs = llm.generate(list(convs), params, use_tqdm=False)
    else:
        outs = llm.chat(list(convs), params, use_tqdm=False)
    elapsed = (time.perf_counter() - t, time.process_time() - cpu)
    after = llm.engine.stats()
    spec = (
        after.num_spec_proposed_tokens - before.num_spec_proposed_tokens,
        after.num_spec_accepted_tokens - before.num_spec_accepted_tokens,
        after.num_spec_verify_rows - before.num_spec_verify_rows,
    )
    return elapsed, [o.token_ids for o in outs], spec, (counter[0] - steps if counter else 0)


def compare(
    plain: LLM, spec: LLM, name: str, convs: Sequence, how, repeats: int, counters: dict
) -> dict:
    """Alternate plain and speculative runs; the best of each, and the speculation counts."""
    best = {"plain": [float("inf")] * 2, "spec": [float("inf")] * 2}
    per_step = {"plain": float("inf"), "spec": float("inf")}
    tokens: dict[str, list] = {}
    proposed = accepted = rows = 0
    for _ in range(repeats):
        for key, llm in (("plain", plain), ("spec", spec)):
            elapsed, tokens[key], (p, a, r), steps = run(llm, convs, how, counters.get(key))
            best[key] = [min(b, e) for b, e in zip(best[key], elapsed)]
            per_step[key] = min(per_step[key], elapsed[0] / max(steps, 1))
            proposed, accepted, rows = proposed + p, accepted + a, rows + r
    total = sum(len(t) for t in tokens["plain"])
    return dict(
        tokens=total * repeats,
        workload=name,
        batch=len(convs),
        plain_tok_s=total / best["plain"][0],
        spec_tok_s=total / best["spec"][0],
        cpu_ratio=best["plain"][1] / best["spec"][1],
        proposed=proposed,
        accepted=accepted,
        rows=rows,
        plain_ms_step=per_step["plain"] * 1e3,
        spec_ms_step=per_step["spec"] * 1e3,
        identical=sum(a == b for a, b in zip(tokens["plain"], tokens["spec"])),
    )


TABLE_HEAD = (
    "| workload | batch | plain tok/s | spec tok/s | speedup | speedup (CPU time) | proposed for | "
    "acceptance | mean accepted length | plain ms/step | spec ms/step | identical |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


def table_row(r: dict) -> str:
    acceptance = r["accepted"] / r["proposed"] if r["proposed"] else 0.0
    mean_len = r["accepted"] / r["rows"] if r["rows"] else 0.0
    # Output tokens that verify rows emitted (each its accepted tokens and one of the model's own):
    # the share prompt lookup had a proposal for; the rest came from one-row steps.
    covered = r["accepted"] + r["rows"]
    return (
        f"| {r['workload']} | {r['batch']} | {r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} | "
        f"{r['spec_tok_s'] / r['plain_tok_s']:.2f}x | {r['cpu_ratio']:.2f}x | "
        f"{covered / r['tokens']:.2f} ({covered}/{r['tokens']}) | "
        f"{acceptance:.2f} ({r['accepted']}/{r['proposed']}) | "
        f"{mean_len:.2f} ({r['rows']} rows) | {r['plain_ms_step']:.1f} | "
        f"{r['spec_ms_step']:.1f} | {r['identical']}/{r['batch']} |"
    )


# ---- embedded SmolLM2 (CPU) ---------------------------------------------------------------------
# name: (prompts for a batch, max_tokens: None for --max-tokens)
WORKLOADS = {
    "rewrite": (rewrite_prompts, None),
    "copy-long": (copy_long_prompts, COPY_LONG_MAX_TOKENS),
    "chat": (chat_prompts, None),
    "chat-sampled": (chat_prompts, None),
}


def speculative_settings(args: argparse.Namespace, variant: str | None = None) -> dict:
    """The `speculative:` settings; variant "k" or "k:max" (ngram) overrides --num-tokens and
    --max-num-tokens."""
    k, top = args.num_tokens, args.max_num_tokens
    if variant is not None:
        k, _, cap = variant.partition(":")
        k, top = int(k), int(cap or 0)
    spec = {"method": args.method, "num_tokens": k, "max_batch_size": args.max_batch_size}
    if args.method == "draft":
        spec["draft_model"] = args.draft_model
    else:
        spec["ngram_min"] = args.ngram_min
        spec["max_num_tokens"] = top
    return spec


def spec_engine(args: argparse.Namespace, common: dict, variant: str | None) -> LLM:
    spec = LLM(**common, speculative=speculative_settings(args, variant))
    runner = spec.engine.executor.runner  # type: ignore[attr-defined]
    runner.verify_as_decodes = args.verify_layout == "decode"
    draft = runner.feature(DraftFeature)
    if draft is not None and args.shadow_every is not None:  # 1: every request, each step (before)
        draft.pacing = DraftPacing(args.shadow_every)
    return spec


def embedded_main(args: argparse.Namespace) -> None:
    common = dict(
        model="default",
        device="cpu",
        load_progress=False,
        cpu_threads=args.cpu_threads,
        quantization=args.quantization,
    )
    plain = LLM(**common)
    variants = args.variants.split(",") if args.variants else [None]
    specs = {v: spec_engine(args, common, v) for v in variants}
    steps = {v: count_steps(spec) for v, spec in specs.items()}
    plain_steps = count_steps(plain)
    runner = next(iter(specs.values())).engine.executor.runner  # type: ignore[attr-defined]
    draft = runner.feature(DraftFeature)
    pacing = f"every {draft.pacing.every} steps" if draft is not None else "none"
    for llm in (plain, *specs.values()):  # warm-up: allocator, kernels
        llm.chat(chat_prompts(2), SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    how_spec = (
        f"draft {args.draft_model}" if args.method == "draft" else f"ngram {args.ngram_min}-4"
    )
    print(
        f"SmolLM2-135M, quantization {args.quantization}, CPU, torch threads "
        f"{torch.get_num_threads()}, max_tokens "
        f"{args.max_tokens} (copy-long: {COPY_LONG_MAX_TOKENS}), greedy unless sampled; "
        f"speculative: {how_spec}, num_tokens[:max_num_tokens] "
        f"{args.variants or f'{args.num_tokens}:{args.max_num_tokens}'}, min_acceptance_rate 0.4, "
        f"max_batch_size {args.max_batch_size}, "
        f"verify rows as {args.verify_layout}, draft shadow proposals {pacing}; best "
        f"of {args.repeats}; load average {os.getloadavg()[0]:.1f}"
    )
    print(TABLE_HEAD)
    for name in args.workloads.split(","):
        maker, max_tokens = WORKLOADS[name]
        max_tokens = max_tokens or args.max_tokens
        greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for batch in map(int, args.batches.split(",")):
            convs = maker(batch)
            how = sampled(batch, max_tokens) if name == "chat-sampled" else greedy
            for variant, spec in specs.items():  # each against plain, alternating, same minute
                counters = {"plain": plain_steps, "spec": steps[variant]}
                label = f"{name}, k {variant}" if variant else name
                row = compare(plain, spec, label, convs, how, args.repeats, counters)
                print(table_row(row), flush=True)
    for llm in (plain, *specs.values()):
        llm.shutdown()


# ---- a random Llama-1B-shaped model (CUDA), or a tiny one (--smoke) ------------------------------
class FixedProposer:
    """Proposes k tokens for every request (the last token repeated), so every step verifies k."""

    uses_hidden_states = False

    def __init__(self, k: int) -> None:
        self.k = k

    def propose(self, contexts, hidden_states=None) -> list[list[int]]:
        return [[ctx[-1]] * self.k for ctx in contexts]


def repetitive_prompts(n: int, vocab: int, length: int, seed: int = 0) -> list[list[int]]:
    """Prompts of a few random motifs (4-12 tokens) repeated: what prompt lookup is for."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        motifs = [[rng.randrange(3, vocab) for _ in range(rng.randint(4, 12))] for _ in range(3)]
        prompts.append([t for _ in range(16) for m in motifs for t in m][:length])
    return prompts


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_steps(llm: LLM, steps: int, device: str) -> tuple[float, float, float]:
    """(engine step ms, forward ms, graph replays per step) over `steps` engine steps."""
    engine = llm.engine
    runner = engine.executor.runner  # type: ignore[attr-defined]
    forward = runner._forward
    times: list[float] = []

    def timed(batch):
        sync(device)
        t = time.perf_counter()
        out = forward(batch)
        sync(device)
        times.append(time.perf_counter() - t)
        return out

    replays = runner.graphs.replays if runner.graphs is not None else 0
    runner._forward = timed
    try:
        sync(device)
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(device)
        step_ms = (time.perf_counter() - t) / steps * 1e3
    finally:
        runner._forward = forward
    replayed = (runner.graphs.replays - replays) / steps if runner.graphs is not None else 0.0
    return step_ms, sum(times) / max(len(times), 1) * 1e3, replayed


def measure(llm: LLM, name: str, batch: int, vocab: int, context: int, steps: int, device):
    """Start `batch` requests of `context` random tokens, prefill them and run a few steps, then
    time `steps` engine steps; the requests are aborted afterwards."""
    from scheduler.request import EngineRequest
    from tests.random_checkpoint import random_prompts

    ids = [f"{name}-{batch}-{i}" for i in range(batch)]
    for rid, prompt in zip(ids, random_prompts(batch, vocab, context, context, seed=batch)):
        params = SamplingParams(max_tokens=(steps + 10) * 9, ignore_eos=True)
        llm.engine.add_request(EngineRequest(rid, prompt, params))
    budget = llm.engine.scheduler.config.max_num_batched_tokens
    for _ in range(-(-batch * context // budget) + 4):  # the prefill, a few decodes
        llm.engine.step()
    result = timed_steps(llm, steps, device)
    llm.engine.abort_requests(ids)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    return result


def step_cost(
    make, vocab: int, batches: Sequence[int], ks: Sequence[int], context: int, steps: int, device
) -> list[dict]:
    """Per batch size: the plain step (graphs, and eager for reference) and, at each k, the verify
    step (every request verifies k proposed tokens) with its rows as decode rows (graphs when they
    fit: as served now) and as a prefill-style mixed batch (eager: the layout before)."""
    rows: list[dict] = []
    plain = make()
    always = {"num_tokens": max(ks), "min_acceptance_rate": 0.0, "max_batch_size": max(batches)}
    spec = make(speculative=always)
    plain_runner = plain.engine.executor.runner  # type: ignore[attr-defined]
    spec_runner = spec.engine.executor.runner  # type: ignore[attr-defined]
    proposer = FixedProposer(max(ks))
    spec_runner.proposer = proposer
    for batch in batches:
        row: dict = dict(batch=batch)
        graphs = plain_runner.graphs
        row["graphs"] = measure(plain, "plain", batch, vocab, context, steps, device)
        plain_runner.graphs = None
        try:
            row["eager"] = measure(plain, "eager", batch, vocab, context, steps, device)
        finally:
            plain_runner.graphs = graphs
        for k in ks:
            proposer.k = k
            for layout in ("decode", "mixed"):
                spec_runner.verify_as_decodes = layout == "decode"
                key = f"k{k}_{layout}"
                row[key] = measure(spec, key, batch, vocab, context, steps, device)
            spec_runner.verify_as_decodes = True
        rows.append(row)
        print(f"step cost: batch {batch} done", flush=True)
    for llm in (plain, spec):
        llm.shutdown()
    del plain, spec
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows


def print_step_cost(rows: list[dict], ks: Sequence[int], context: int) -> None:
    print(
        f"\nstep cost, context {context}: ms per engine step (forward ms), and the verify step "
        "against the plain step with graphs\n"
    )
    print(
        "| batch | k | plain, graphs | plain, eager | verify, decode rows | x plain | "
        "verify, mixed (before) | x plain | graph replays / verify step |"
    )
    print("| --- " * 9 + "|")
    for r in rows:
        g, e = r["graphs"], r["eager"]
        for k in ks:
            dec, mix = r[f"k{k}_decode"], r[f"k{k}_mixed"]
            print(
                f"| {r['batch']} | {k} | {g[0]:.2f} ({g[1]:.2f}) | {e[0]:.2f} ({e[1]:.2f}) | "
                f"{dec[0]:.2f} ({dec[1]:.2f}) | {dec[0] / g[0]:.2f}x | "
                f"{mix[0]:.2f} ({mix[1]:.2f}) | {mix[0] / g[0]:.2f}x | {dec[2]:.2f} |"
            )
    print(
        "(x plain: the verify step's time over the plain graph step's; graph replays: 1.00 when "
        "every verify step replayed a captured graph, 0 without graphs (CPU))"
    )


def random_main(args: argparse.Namespace) -> None:
    from tests.random_checkpoint import SHAPES, TINY_FAMILIES, write_random_checkpoint

    t_start = time.perf_counter()
    device = "cpu" if args.smoke else args.device
    batches = [int(b) for b in args.batches.split(",")]
    if args.smoke:
        shape, dtype, context, steps = TINY_FAMILIES["llama"], "float32", 64, 6
        max_tokens = 24
    else:
        shape, dtype, context, steps = SHAPES["llama3-1b"], "bfloat16", 512, 30
        max_tokens = args.max_tokens
    ks = [2, 4, 8]
    with tempfile.TemporaryDirectory() as path:
        t = time.perf_counter()
        ckpt = write_random_checkpoint(shape, path, device=device)
        print(f"random checkpoint written in {time.perf_counter() - t:.0f}s", flush=True)
        blocks_per_request = -(-(context + (steps + 10) * 9 + 16) // 16)
        max_batch = max(max(batches), 8)
        pool = dict(
            max_num_seqs=max_batch,
            max_num_batched_tokens=max(2048, context * 2),
            max_model_len=16 * blocks_per_request,
            num_gpu_blocks=max_batch * blocks_per_request + 16,
        )

        def make(**extra) -> LLM:
            return LLM(model=path, dtype=dtype, device=device, load_progress=False, **pool, **extra)

        name = "tiny random Llama (smoke)" if args.smoke else "random Llama-3.2-1B shape"
        where = torch.cuda.get_device_name(0) if device.startswith("cuda") else "CPU"
        print(f"{name}, {dtype}, {where}, torch {torch.__version__}")
        result: dict = {"model": name, "device": where, "ngram": [], "step_cost": []}
        plain, spec = make(), make(speculative=speculative_settings(args))
        counters = {"plain": count_steps(plain), "spec": count_steps(spec)}
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        print(
            f"\nn-gram (num_tokens {args.num_tokens}, max_batch_size {args.max_batch_size}), "
            "repetitive prompts, greedy\n"
        )
        print(TABLE_HEAD)
        for batch in (1, 8):
            prompts = repetitive_prompts(batch, ckpt.vocab_size, context, seed=batch)
            run(plain, prompts[:1], params)  # warm-up
            row = compare(plain, spec, "repetitive", prompts, params, args.repeats, counters)
            result["ngram"].append(row)
            print(table_row(row), flush=True)
        for llm in (plain, spec):
            llm.shutdown()
        del plain, spec
        rows = step_cost(make, ckpt.vocab_size, batches, ks, context, steps, device)
        result["step_cost"] = rows
    print_step_cost(rows, ks, context)
    print(f"\ntotal {time.perf_counter() - t_start:.0f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu", help="cpu (embedded SmolLM2) or cuda")
    parser.add_argument("--smoke", action="store_true", help="the cuda mode on CPU, tiny model")
    parser.add_argument("--json", default=None, help="cuda mode: write the figures here")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--cpu-threads", type=int, default=None, help="torch threads (1 on a shared machine)"
    )
    parser.add_argument(
        "--quantization",
        default="auto",
        help="embedded mode: the engine's quantization (auto: the default Q4_1 blocks, kept "
        "quantized on CPU; none: de-quantised fp32, as the figures before 2026-11-29)",
    )
    parser.add_argument("--method", default="ngram", choices=["ngram", "draft"])
    parser.add_argument("--draft-model", default="default", help="method draft: the draft model")
    parser.add_argument("--num-tokens", type=int, default=4, help="speculative.num_tokens")
    parser.add_argument(
        "--max-num-tokens", type=int, default=0, help="speculative.max_num_tokens (adaptive)"
    )
    parser.add_argument(
        "--variants",
        default=None,
        help="embedded mode: n-gram engines to compare with the one plain engine, each 'k' or "
        "'k:max_num_tokens' (e.g. 4,8,4:16); default: --num-tokens and --max-num-tokens",
    )
    parser.add_argument("--ngram-min", type=int, default=2, help="speculative.ngram_min")
    parser.add_argument("--max-batch-size", type=int, default=4, help="speculative.max_batch_size")
    parser.add_argument(
        "--batches", default="1,8", help="batch sizes (cuda mode: of the step cost)"
    )
    parser.add_argument("--workloads", default="rewrite,chat,chat-sampled")
    parser.add_argument(
        "--verify-layout",
        default="decode",
        choices=["decode", "mixed"],
        help="embedded mode: verify rows as decode rows (as served) or as a mixed batch (before)",
    )
    parser.add_argument(
        "--shadow-every",
        type=int,
        default=None,
        help="method draft: a paused request proposes every N steps (default 8; 1: every step)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.smoke or args.device != "cpu":
        if args.method != "ngram":
            parser.error("--method: the random model measures n-gram and the verify step only")
        random_main(args)
    else:
        embedded_main(args)


if __name__ == "__main__":
    main()
