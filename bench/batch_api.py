"""An interactive stream's inter-token latency alone, and while a Batch API batch runs.

deploy.yaml's app (the embedded SmolLM2 on CPU, or --device cuda) with one token a chunk
(stream_interval 1) and the `priority` queue policy unless --policy says otherwise. The official
openai client uploads a `--lines`-line chat batch (each line `--batch-tokens` tokens) and runs it;
meanwhile `--runs` interactive streams of `--tokens` tokens each are timed chunk by chunk. The
same streams are timed first with nothing else running. Prints the median and p90 gap between
tokens and the time to first token, each as a ratio to solo, and the batch's own throughput.
Figures, never pass/fail: they depend on the machine (the issue's target: ITL within 1.5x).

    python bench/batch_api.py [--lines 200] [--runs 6] [--tokens 64] [--policy priority]
                              [--in-flight 4] [--device cpu]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time

import httpx
import openai
import yaml

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
import ray
from ray import serve

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from deploy.app import build_app
from workers.distributed import free_port

MODEL = "SmolLM2-135M-Instruct"


def stream_gaps(url: str, tokens: int, i: int) -> tuple[float, list[float]]:
    """(time to first token, gaps between the later tokens) of one streamed chat."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Tell me a story about the number {i}."}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    start = time.perf_counter()
    stamps = []
    with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                stamps.append(time.perf_counter())
    return stamps[0] - start, [b - a for a, b in itertools.pairwise(stamps)]


def interactive(url: str, runs: int, tokens: int) -> tuple[list[float], list[float]]:
    ttfts, gaps = [], []
    for i in range(runs):
        ttft, g = stream_gaps(url, tokens, i)
        ttfts.append(ttft)
        gaps.extend(g)
    return ttfts, gaps


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1]


def start_batch(client: openai.OpenAI, lines: int, tokens: int) -> str:
    rows = [
        json.dumps(
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"Summarize fact number {i}."}],
                    "max_tokens": tokens,
                    "ignore_eos": True,
                },
            }
        )
        for i in range(lines)
    ]
    upload = client.files.create(file=("bench.jsonl", "\n".join(rows).encode()), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return batch.id


def wait_done(client: openai.OpenAI, batch_id: str):
    while (batch := client.batches.retrieve(batch_id)).status not in (
        "completed",
        "failed",
        "cancelled",
        "expired",
    ):
        time.sleep(0.5)  # polls the batch; no timing is measured from this loop
    return batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lines", type=int, default=200)
    p.add_argument("--batch-tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=6)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--policy", default="priority")
    p.add_argument("--in-flight", type=int, default=4)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    with open("deploy.yaml") as f:
        args = yaml.safe_load(f)["applications"][0]["args"]
    args.update(
        stream_interval=1,
        policy=a.policy,
        device=a.device,
        batch_dir=tempfile.mkdtemp(prefix="raylm-batch-bench-"),
        batch_lines_in_flight=a.in_flight,
    )
    ray.init(include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name="raylm", route_prefix="/")
    url = f"http://127.0.0.1:{port}/v1"
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    interactive(url, 2, 8)  # warm-up
    solo_ttft, solo = interactive(url, a.runs, a.tokens)
    batch_id = start_batch(client, a.lines, a.batch_tokens)
    while client.batches.retrieve(batch_id).request_counts.completed < 2 * a.in_flight:
        time.sleep(0.2)  # the batch is under way before the interactive streams start
    t0 = time.perf_counter()
    busy_ttft, busy = interactive(url, a.runs, a.tokens)
    during = client.batches.retrieve(batch_id).request_counts
    batch = wait_done(client, batch_id)
    batch_s = time.perf_counter() - t0
    print(f"device {a.device}, policy {a.policy}, {a.in_flight} batch lines in flight")
    print(
        f"interactive: {a.runs} streams x {a.tokens} tokens; batch: {a.lines} lines x "
        f"{a.batch_tokens} tokens"
    )
    for name, ttft, gaps in (("solo", solo_ttft, solo), ("with batch", busy_ttft, busy)):
        print(
            f"{name:>10}: ITL median {statistics.median(gaps) * 1e3:7.2f} ms  p90 "
            f"{p90(gaps) * 1e3:7.2f} ms   TTFT median {statistics.median(ttft) * 1e3:7.1f} ms"
        )
    print(
        f"     ratio: ITL median {statistics.median(busy) / statistics.median(solo):.2f}x  "
        f"p90 {p90(busy) / p90(solo):.2f}x   TTFT median "
        f"{statistics.median(busy_ttft) / statistics.median(solo_ttft):.2f}x"
    )
    counts = batch.request_counts
    print(
        f"batch: {batch.status}, {counts.completed} completed / {counts.failed} failed of "
        f"{counts.total}; {during.completed} lines done while the streams ran; "
        f"{counts.completed * a.batch_tokens / batch_s:.1f} batch tokens/s from the streams' start"
    )
    out = [json.loads(r) for r in client.files.content(batch.output_file_id).content.splitlines()]
    assert len({r["custom_id"] for r in out}) == counts.completed  # each line answered once
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
