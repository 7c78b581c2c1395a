"""The prefix cache's CPU tier against recomputation: multi-turn chat whose working set is about
four times the device KV pool, on the embedded SmolLM2-135M (or a model given by --model).

Workload: `--users` conversations (64), each its own system prompt, then `--turns` turns of a user
message and a greedy answer (`--answer-tokens`, ignore_eos); turn t+1 sends the whole
conversation so far. Requests go turn by turn over all users (user 0..63 turn 1, then turn 2, ...)
with `--concurrency` in flight, so between two turns of one user every other user's turn passes
and a device pool of a quarter of the working set has evicted the conversation. Both engines
(tier off, tier on) live in this process and run the same requests in the same order, turn by
turn in alternation (a shared machine's load drifts over both alike); they must give the same
tokens.

Reported per engine: TTFT p50 / p90 (from submitting a request to its first token), prompt
tokens computed (prompt less the tokens served from cache), wall time, and the tier's blocks
loaded; and the ratio off / on. Then the per-block copy time CPU tier -> device (and device -> CPU
tier) measured on the same KV block shape, on this process's device.

    python bench/kv_tier_bench.py [--users 64] [--turns 3] [--concurrency 8] [--device cpu]
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import torch

from engine.llm import LLM
from scheduler import EngineRequest, SamplingParams
from scheduler.kv_connector import KVTransfers
from workers.kv_cache import KVCache, KVCacheSpec
from workers.kv_tiers import KVTierConfig, KVTiers


@dataclass
class RunResult:
    ttft: list[float] = field(default_factory=list)
    ttft_later: list[float] = field(default_factory=list)  # turns 2 on: a returning user
    cpu_ttft: list[float] = field(default_factory=list)  # process CPU seconds to first token
    computed: int = 0  # prompt tokens that went through the model
    prompt: int = 0
    wall_s: float = 0.0
    answers: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    loaded_blocks: int = 0
    failed_loads: int = 0


def conversation_parts(args: argparse.Namespace, vocab: int) -> tuple[list, list]:
    rng = random.Random(args.seed)
    systems = [
        [rng.randrange(10, vocab) for _ in range(args.system_tokens)] for _ in range(args.users)
    ]
    messages = [
        [[rng.randrange(10, vocab) for _ in range(args.user_tokens)] for _ in range(args.turns)]
        for _ in range(args.users)
    ]
    return systems, messages


@dataclass
class Conversation:
    """One engine's copy of every user's conversation so far, and its figures."""

    history: list[list[int]]
    result: RunResult = field(default_factory=RunResult)


def run_turn(llm: LLM, args: argparse.Namespace, turn: int, conv: Conversation, messages) -> None:
    """Turn `turn` of every user in user order, `concurrency` at a time; TTFT per request."""
    engine, result = llm.engine, conv.result
    params = SamplingParams(max_tokens=args.answer_tokens, temperature=0.0, ignore_eos=True)
    live: dict[str, tuple[int, float, float, list[int]]] = {}
    started: set[str] = set()
    users = list(range(args.users))
    before = engine.stats()
    t0 = time.perf_counter()
    while users or live:
        while users and len(live) < args.concurrency:
            user = users.pop(0)
            prompt = conv.history[user] + messages[user][turn]
            rid = f"u{user}-t{turn}"
            engine.add_request(EngineRequest(rid, prompt, params))
            live[rid] = (user, time.perf_counter(), time.process_time(), prompt)
        for out in engine.step():
            user, sent, sent_cpu, prompt = live[out.request_id]
            if out.request_id not in started and out.new_token_ids:
                started.add(out.request_id)
                result.ttft.append(time.perf_counter() - sent)
                result.cpu_ttft.append(time.process_time() - sent_cpu)
                if turn > 0:
                    result.ttft_later.append(result.ttft[-1])
                result.computed += len(prompt) - out.num_cached_tokens
                result.prompt += len(prompt)
            result.answers.setdefault((user, turn), []).extend(out.new_token_ids)
            if out.finished:
                del live[out.request_id]
                conv.history[user] = prompt + result.answers[(user, turn)]
    result.wall_s += time.perf_counter() - t0
    after = engine.stats()
    result.loaded_blocks += after.num_tier_loaded_blocks - before.num_tier_loaded_blocks
    result.failed_loads += after.num_tier_failed_loads - before.num_tier_failed_loads


def quantile(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q * 100) - 1]


def ms(xs: list[float], q: float) -> float:
    return quantile(xs, q) * 1e3 if len(xs) > 1 else float("nan")


def ratio(off: list[float], on: list[float], q: float) -> float:
    return quantile(off, q) / quantile(on, q) if len(off) > 1 and len(on) > 1 else float("nan")


def copy_times(
    spec: KVCacheSpec, device: torch.device, n: int, repeats: int
) -> tuple[float, float]:
    """Seconds per block to load n blocks CPU tier -> device, and to save n device -> CPU tier."""
    cache = KVCache(spec, n + 1, 0, device)
    tiers = KVTiers(cache, KVTierConfig(num_cpu_blocks=n))
    saves = KVTransfers(save=[(b, b, b + 1) for b in range(n)])
    loads = KVTransfers(load_cpu=[(b, b, b + 1) for b in range(n)])
    timings = {"save": [], "load": []}
    for _ in range(repeats):
        for name, t in (("save", saves), ("load", loads)):
            sync(device)
            start = time.perf_counter()
            if name == "save":
                tiers.wait_for_loads()
                tiers.save(t)
            else:
                assert not tiers.load(t)
                tiers.wait_for_loads()
            sync(device)
            timings[name].append((time.perf_counter() - start) / n)
    return min(timings["load"]), min(timings["save"])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quantization", default="none", help="the engine's quantization")
    parser.add_argument(
        "--cpu-threads", type=int, default=None, help="torch threads (1 on a loaded machine)"
    )
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=32)
    parser.add_argument("--user-tokens", type=int, default=16)
    parser.add_argument("--answer-tokens", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--pool-share", type=float, default=0.25, help="device pool / working set")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=36)
    parser.add_argument("--copy-blocks", type=int, default=64)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    bs = args.block_size
    final = args.system_tokens + args.turns * (args.user_tokens + args.answer_tokens)
    working_set = args.users * -(-final // bs)
    pool = max(int(working_set * args.pool_share), -(-(final + bs) // bs) * args.concurrency)
    common = dict(
        device=args.device,
        quantization=args.quantization,
        cpu_threads=args.cpu_threads,
        load_progress=False,
        num_gpu_blocks=pool,
        max_model_len=-(-(final + bs) // bs) * bs,
        max_num_batched_tokens=2048,
        block_size=bs,
        max_num_seqs=args.concurrency,
    )
    print(
        f"{args.users} users x {args.turns} turns, final context {final} tokens; working set "
        f"{working_set} blocks of {bs}, device pool {pool} blocks ({pool / working_set:.2f}x)"
    )
    engines = {
        "tier off": LLM(args.model, **common),
        "cpu tier": LLM(args.model, **common, num_cpu_tier_blocks=working_set + pool),
    }
    vocab = engines["tier off"].engine.vocab_size
    systems, messages = conversation_parts(args, vocab)
    convs = {name: Conversation([list(s) for s in systems]) for name in engines}
    for llm in engines.values():  # first-use costs (kernel builds, allocations) out of the timing
        llm.generate([[3] * 40, [4] * 40], SamplingParams(max_tokens=2), use_tqdm=False)
    # Turn by turn, alternating engines: a shared machine's load drifts over both alike.
    for turn in range(args.turns):
        for name, llm in engines.items():
            run_turn(llm, args, turn, convs[name], messages)
            print(f"turn {turn + 1} {name}: {convs[name].result.wall_s:.1f} s so far", flush=True)
    spec = engines["cpu tier"].engine.executor.runner.kv_spec  # type: ignore[attr-defined]
    for llm in engines.values():
        llm.shutdown()
    results = {name: conv.result for name, conv in convs.items()}
    off, on = results["tier off"], results["cpu tier"]
    print(f"identical tokens: {off.answers == on.answers}")
    print(
        f"{'engine':<9} {'TTFT p50 ms':>12} {'TTFT p90 ms':>12} {'later p50':>10} "
        f"{'later p90':>10} {'CPU-TTFT p50':>13} {'prompt tok':>11} {'computed':>9} "
        f"{'wall s':>7} {'loaded blk':>10} {'failed':>6}"
    )
    for name, r in results.items():
        print(
            f"{name:<9} {ms(r.ttft, 0.5):12.1f} {ms(r.ttft, 0.9):12.1f} "
            f"{ms(r.ttft_later, 0.5):10.1f} {ms(r.ttft_later, 0.9):10.1f} "
            f"{ms(r.cpu_ttft, 0.5):13.1f} {r.prompt:11d} {r.computed:9d} {r.wall_s:7.1f} "
            f"{r.loaded_blocks:10d} {r.failed_loads:6d}"
        )
    print(
        f"off / on: TTFT p50 {ratio(off.ttft, on.ttft, 0.5):.2f}x, "
        f"p90 {ratio(off.ttft, on.ttft, 0.9):.2f}x; returning users p50 "
        f"{ratio(off.ttft_later, on.ttft_later, 0.5):.2f}x, p90 "
        f"{ratio(off.ttft_later, on.ttft_later, 0.9):.2f}x; CPU-time TTFT p50 "
        f"{ratio(off.cpu_ttft, on.cpu_ttft, 0.5):.2f}x; prompt tokens computed "
        f"{off.computed / max(on.computed, 1):.2f}x; wall {off.wall_s / on.wall_s:.2f}x"
    )
    device = torch.device(args.device)
    load_s, save_s = copy_times(spec, device, args.copy_blocks, repeats=5)
    mb = spec.block_bytes / 1e6
    print(
        f"per-block copy ({mb:.2f} MB a block, {args.copy_blocks} blocks a batch, {device}): "
        f"CPU tier -> device {load_s * 1e6:.0f} us ({mb / load_s / 1e3:.2f} GB/s), "
        f"device -> CPU tier {save_s * 1e6:.0f} us ({mb / save_s / 1e3:.2f} GB/s)"
    )


if __name__ == "__main__":
    main()
