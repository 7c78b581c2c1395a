"""Ray Data batch inference against the offline LLM: output tokens per second per engine.

Workload (fixed seed): `--prompts` text prompts of 4-24 words, `--max-tokens` each, greedy,
ignore_eos. The offline `LLM` runs them in this process with `--threads` torch threads; the Ray
Data pipeline (cluster/ray_data.py) runs them on a local Ray instance with `--engines` actors of
one CPU each (Ray gives each actor OMP_NUM_THREADS=1, so `--threads 1` is the like-for-like
figure). The pipeline's time is end to end: actor start and model load included, as a job sees it.
Every generation is compared with the offline one (greedy: they must be equal).

    python bench/ray_data.py [--model DIR] [--prompts 1000] [--max-tokens 16] [--engines 2]
                             [--nodes 2]

`--nodes N`: the pipeline runs on a local Ray cluster of N nodes (ray.cluster_utils.Cluster: a
head and N-1 worker nodes on this machine, one CPU each), so that the engines, one CPU each, are
spread over the nodes.

Without --model, a random Llama of tests/random_checkpoint.py (TINY_TP_LLAMA, a word-level
tokenizer) is written to a temporary directory.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.random_checkpoint

from cluster.ray_data import GenerationStage, map_generations
from engine.llm import LLM
from scheduler import SamplingParams

SEED = 2026


def prompts(n: int, vocab_size: int) -> list[str]:
    """n prompts of 4-24 words of the word-level tokenizer (w3 ... w<vocab-1>)."""
    rng = random.Random(SEED)
    return [
        " ".join(f"w{rng.randrange(3, vocab_size)}" for _ in range(rng.randint(4, 24)))
        for _ in range(n)
    ]


def model_dir(args: argparse.Namespace) -> tuple[str, int]:
    if args.model:
        from transformers import AutoConfig

        return args.model, AutoConfig.from_pretrained(args.model).vocab_size
    from tests.random_checkpoint import TINY_TP_LLAMA, write_random_checkpoint

    made = write_random_checkpoint(TINY_TP_LLAMA, tempfile.mkdtemp(prefix="raylm-bench-"))
    return made.path, made.vocab_size


def run_offline(model: str, texts: list[str], params: SamplingParams, engine: dict):
    llm = LLM(model=model, **engine)
    llm.generate(texts[:4], params, use_tqdm=False)  # warm-up (allocator, kernels)
    start = time.perf_counter()
    outs = llm.generate(texts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.shutdown()
    return elapsed, [o.token_ids for o in outs]


def run_pipeline(model: str, texts: list[str], params: SamplingParams, engine: dict, args):
    import ray

    cluster = None
    if args.nodes > 1:
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        for _ in range(args.nodes - 1):
            cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, log_to_driver=False)
    else:
        ray.init(num_cpus=args.engines + 1, include_dashboard=False, log_to_driver=False)
    nodes = sum(1 for n in ray.nodes() if n["Alive"])
    stage = GenerationStage(
        model=model,
        sampling_params=params,
        engine_kwargs=engine,
        batch_size=args.batch_size,
        concurrency=args.engines,
    )
    rows = [{"id": i, "prompt": t} for i, t in enumerate(texts)]
    # The fixed cost of a job (actors started, models loaded): a pipeline over one row per engine.
    start = time.perf_counter()
    map_generations(ray.data.from_items(rows[: args.engines]), stage).take_all()
    fixed = time.perf_counter() - start
    start = time.perf_counter()
    got = map_generations(ray.data.from_items(rows), stage).take_all()
    elapsed = time.perf_counter() - start
    print(f"the pipeline's actors ran on {_actor_nodes()} of the cluster's {nodes} nodes")
    ray.shutdown()
    if cluster is not None:
        cluster.shutdown()
    got.sort(key=lambda r: r["id"])
    return elapsed, fixed, nodes, [list(r["generation_token_ids"]) for r in got]


def _actor_nodes() -> int:
    """How many nodes the job's actors (the engines, Ray Data's coordinator) ran on."""
    from ray._private.state import state  # this driver's cluster (the state API may pick another)

    return len({a["Address"]["NodeID"] for a in state.actor_table(None).values()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="the offline LLM's torch threads")
    parser.add_argument("--nodes", type=int, default=1, help="local Ray nodes, one CPU each")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, vocab_size = model_dir(args)
    texts = prompts(args.prompts, vocab_size)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    engine = {"device": "cpu", "load_progress": False, "kv_cache_memory_gb": 0.25}
    tokens = args.prompts * args.max_tokens
    offline_s, offline_ids = run_offline(model, texts, params, engine)
    pipeline_s, fixed_s, nodes, pipeline_ids = run_pipeline(model, texts, params, engine, args)
    differ = sum(a != b for a, b in zip(offline_ids, pipeline_ids))
    per_engine = tokens / pipeline_s / args.engines
    print(f"model {model}, {args.prompts} prompts x {args.max_tokens} tokens, greedy")
    print(
        f"offline LLM ({args.threads} threads): {offline_s:.1f} s, {tokens / offline_s:.0f} tok/s"
    )
    print(
        f"Ray Data, {args.engines} engines x 1 CPU, {nodes} nodes: {pipeline_s:.1f} s end to end, "
        f"{tokens / pipeline_s:.0f} tok/s, {per_engine:.0f} tok/s per engine"
    )
    print(f"per engine / offline: {per_engine / (tokens / offline_s):.2f}")
    # Printed beside, not subtracted: under load a job's start-up varies as much as the job.
    print(f"fixed cost (a pipeline over {args.engines} rows: actors, model loads): {fixed_s:.1f} s")
    print(f"pipeline / offline (whole job): {offline_s / pipeline_s:.2f}x")
    print(f"generations that differ from the offline LLM's: {differ} of {args.prompts}")


if __name__ == "__main__":
    main()
