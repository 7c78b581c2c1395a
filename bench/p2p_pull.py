"""Peer-to-peer prefix pulls against recomputing, served: TTFT of a forked-context agent workload
on two replicas, with `router_kwargs.peer_pulls` on and off, and whether the tokens are identical.

Harness: Ray Serve on this machine, two LLMReplicas (CPU, a random Llama of `--layers` layers and
`--hidden` hidden size) behind this process's FleetRouter (prefix affinity with a low load ceiling,
`imbalance_threshold` 1 and `imbalance_ratio` 1, so a burst spills off the context's holder). The
KV events each last output carries go to the router as the ingress hands them on.

Workload: `--contexts` long shared contexts (`--context-blocks` blocks of 16 tokens each), one
after another: a first request computes the context on one replica; then `--forks` forks of it
(the context and a question of their own, `--max-tokens` greedy tokens each) are sent at once, as
an agent fans one context out to sub-agents. Load sends some of them to the other replica, which
either pulls the context from the holder or computes it.

Prints, per setting: the forks' TTFT p50 / p90 / max, the share of prompt tokens the replicas
found cached (pulled blocks count: they land as prefix hits), then each fork's TTFT / cached
blocks in the order sent; at the end the ratio of the TTFT p90s and whether every fork's tokens
were the same with and without pulls. `--prefill-tokens-per-s` is the cost model's prefill rate
(this machine's CPU prefills about 2,000 tokens a second of the default model).

    python bench/p2p_pull.py [--contexts 3] [--forks 6] [--context-blocks 128]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from cluster.kv_event_pub import deliver_kv_tail
from scheduler import EngineRequest, SamplingParams, hash_prompt_blocks
from tests.random_checkpoint import TINY_SERVED_LLAMA, write_random_checkpoint

BLOCK = 16


def workload(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], list[list[int]]]]:
    """(context, its forks' prompts) per context."""
    rng = random.Random(args.seed)
    out = []
    for _ in range(args.contexts):
        context = [rng.randrange(10, vocab) for _ in range(args.context_blocks * BLOCK)]
        forks = [context + [rng.randrange(10, vocab) for _ in range(24)] for _ in range(args.forks)]
        out.append((context, forks))
    return out


def request(rid: str, prompt: list[int], max_tokens: int) -> EngineRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return EngineRequest(rid, prompt, params, block_hashes=hash_prompt_blocks(prompt, BLOCK))


async def timed(handle: Any, req: EngineRequest) -> tuple[float, list[int], int]:
    """(TTFT s, tokens, cached prompt tokens) of one streamed request."""
    start = time.perf_counter()
    ttft, tokens, cached = None, [], 0
    async for out in handle.options(stream=True).generate.remote(req):
        if ttft is None and out.new_token_ids:
            ttft = time.perf_counter() - start
        tokens.extend(out.new_token_ids)
        cached = out.num_cached_tokens
        deliver_kv_tail(out)  # as the ingress does (deploy/generation.py)
    assert ttft is not None
    return ttft, tokens, cached


async def in_sync(handle: Any) -> None:
    """Until this process's router holds both replicas' KV events in sync."""
    router = handle._router._asyncio_router.request_router
    for _ in range(200):
        kv = router.fleet.kv
        if len(kv.replicas()) == 2 and all(kv.in_sync(r) for r in kv.replicas()):
            return
        await asyncio.sleep(0.1)
    raise RuntimeError("the replicas' KV events never reached the router")


async def run_workload(
    handle: Any, work: list[tuple[list[int], list[list[int]]]], args: argparse.Namespace
) -> tuple[list[float], list[list[int]], list[int]]:
    """(forks' TTFTs, forks' tokens, forks' cached prompt tokens)."""
    ttfts, tokens, cached = [], [], []
    for c, (context, forks) in enumerate(work):
        await timed(handle, request(f"c{c}", context + [7], 1))
        await in_sync(handle)
        outs = await asyncio.gather(
            *(timed(handle, request(f"c{c}f{i}", p, args.max_tokens)) for i, p in enumerate(forks))
        )
        for ttft, toks, hit in outs:
            ttfts.append(ttft)
            tokens.append(toks)
            cached.append(hit)
    return ttfts, tokens, cached


def start(model: str, args: argparse.Namespace, pulls: bool, name: str) -> Any:
    from ray import serve

    from cluster.replica import LLMReplica
    from deploy.config import AppConfig

    config = AppConfig.from_args(
        {
            "model": model,
            "device": "cpu",
            "num_replicas": 2,
            "cpu_threads": 1,
            "block_size": BLOCK,
            "num_gpu_blocks": (args.context_blocks + 4) * (args.forks + 2),
            "max_model_len": args.context_blocks * BLOCK + 128,
            "max_num_batched_tokens": args.context_blocks * BLOCK + 128,
            "replica_num_cpus": 1,
            "router": "fleet",
            "router_kwargs": {
                "router_policy": "prefix_affinity",
                "imbalance_threshold": 1,
                "imbalance_ratio": 1,
                "peer_pulls": pulls,
                "prefill_tokens_per_s": args.prefill_tokens_per_s,
            },
        }
    )
    replica = LLMReplica.options(  # type: ignore[attr-defined]
        num_replicas=2,
        ray_actor_options=config.replica_actor_options(),
        placement_group_bundles=config.placement_group_bundles(),
        request_router_config=config.request_router_config(),
        health_check_timeout_s=300,
    )
    return serve.run(replica.bind(config.engine), name=name, route_prefix=None)


def print_pulls(handle: Any) -> None:
    """The router's joined pulls and each replica's pull counts (cluster/kv_pull.py): a fork that
    joined a pull in flight waited for its blocks instead of asking the peer again."""
    router = handle._router._asyncio_router.request_router
    seen: dict[str, dict[str, Any]] = {}
    for _ in range(20):  # stats calls go where the router sends them: ask until both answered
        stats = handle.stats.remote().result()
        seen[stats["replica"]] = stats
        if len(seen) == 2:
            break
    keys = ("peer_pulls", "peer_pulls_joined", "peer_pulls_held", "peer_pull_blocks_received")
    print(f"  router: pulls joined {router.fleet.pulls.num_joined}", flush=True)
    for replica, stats in sorted(seen.items()):
        print(f"  {replica}: " + " ".join(f"{k}={stats.get(k)}" for k in keys), flush=True)


def measure(
    model: str, vocab: int, args: argparse.Namespace, pulls: bool
) -> tuple[float, list[list[int]]]:
    from ray import serve

    name = f"p2p_{'on' if pulls else 'off'}"
    handle = start(model, args, pulls, name)
    asyncio.run(timed(handle, request("warm", [11], 1)))  # makes this process's router
    work = workload(args, vocab)
    ttfts, tokens, cached = asyncio.run(run_workload(handle, work, args))
    if pulls:
        print_pulls(handle)
    serve.delete(name)
    q = statistics.quantiles(ttfts, n=10)
    share = sum(cached) / sum(len(p) for _, forks in work for p in forks)
    print(
        f"peer_pulls={'on ' if pulls else 'off'} forks={len(ttfts)} TTFT p50={q[4]:.3f}s "
        f"p90={q[8]:.3f}s max={max(ttfts):.3f}s cached={share:.1%}",
        flush=True,
    )
    # Each fork's TTFT and cached prompt blocks, in the order sent: which ones pulled or computed.
    print("  " + " ".join(f"{t:.2f}s/{c // BLOCK}" for t, c in zip(ttfts, cached)), flush=True)
    return q[8], tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, default=3)
    p.add_argument("--forks", type=int, default=6)
    p.add_argument("--context-blocks", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--prefill-tokens-per-s", type=float, default=2000.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    import ray

    spec = TINY_SERVED_LLAMA.with_fields(
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        max_position_embeddings=args.context_blocks * BLOCK + 256,
        vocab_size=2048,
    )
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_random_checkpoint(spec, tmp, seed=0)
        ray.init(
            num_cpus=8, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1"
        )
        from ray import serve

        serve.start(proxy_location="Disabled")
        off, off_tokens = measure(tmp, checkpoint.vocab_size, args, pulls=False)
        on, on_tokens = measure(tmp, checkpoint.vocab_size, args, pulls=True)
        same = on_tokens == off_tokens
        print(f"TTFT p90 recompute / pulls: {off / on:.2f}x; identical tokens: {same}")
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
