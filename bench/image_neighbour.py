"""Text streams beside images, served: does image work slow a neighbouring text stream?

A tiny random LLaVA (tests/workers/vision_checkpoints.py, its real CLIP processor, images of
`--image-px` pixels in 14 px patches) served by one replica on this machine; every text stream is
`/v1/chat/completions` with `stream: true` and `ignore_eos`, timed by the client between its
tokens (inter-token latency, ITL). Two comparisons, each printed as p50 / p90 ITL and the ratio
to its image-free run (issue 49's bound: 2x):

1. hostile: one text stream alone, then the same stream while another client sends the hostile
   set (tests/frontend/hostile_images.py: decompression bombs, truncated files, a text file named
   .png, metadata bombs, an oversized base64 text) over and over; each must answer 400. Its
   control: the same loop of as many tiny bodies refused by the schema (no image): what the
   flood of requests costs the stream on this machine whatever they hold.
2. encoder budget: `--streams` text streams alone, then the same streams while one request with
   `--images` images is prefilled beside them (the engine spreads its image tokens over steps,
   `max_num_encoder_tokens`).

Figures, never pass/fail: they depend on the machine and its load (printed before and after).

    python bench/image_neighbour.py [--image-px 70] [--images 16] [--streams 8] [--tokens 96]
                                   [--rounds 3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.stats import pct
from tests.frontend.hostile_images import data_url, encoded, hostile_urls

MODEL = "tiny-llava"
MAX_IMAGE_BYTES = 4 << 20


def write_model(path: str, image_px: int) -> str:
    """The tiny LLaVA of tests/workers/vision_checkpoints.py at `image_px` pixels a side."""
    from transformers import AutoTokenizer

    import tests.workers.vision_checkpoints as checkpoints
    from workers.model_files import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("default"))
    ckpt = checkpoints.write_tiny_llava(path, tokenizer, image_size=image_px)
    print(f"tiny LLaVA: {ckpt.tokens_per_image} image tokens per {image_px} px image")
    return ckpt.path


def serve_model(model_dir: str, images: int, port: int) -> str:
    import ray
    from ray import serve

    from deploy.app import build_app

    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {
        "model": model_dir,
        "served_model_name": MODEL,
        "max_model_len": 512,
        "num_gpu_blocks": 256,
        "kv_cache_memory_gb": 0.2,
        "max_images_per_request": max(images, 1),
        "max_image_bytes": MAX_IMAGE_BYTES,
        "replica_num_cpus": 1,
        "ingress_num_cpus": 0.5,
    }
    serve.run(build_app(args), name="vision", route_prefix="/")
    return f"http://127.0.0.1:{port}/v1"


def stream_gaps(url: str, tokens: int, seed: int) -> list[float]:
    """One streaming text chat's gaps between tokens after its first (seconds)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Tell story number {seed} about a cat."}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    stamps: list[float] = []
    with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and _has_text(json.loads(line[6:])):
                stamps.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(stamps)]


def _has_text(chunk: dict) -> bool:
    return any(c.get("delta", {}).get("content") for c in chunk.get("choices", []))


def run_streams(url: str, streams: int, tokens: int) -> list[float]:
    with ThreadPoolExecutor(streams) as pool:
        runs = list(pool.map(lambda s: stream_gaps(url, tokens, s), range(streams)))
    return [g for gaps in runs for g in gaps]


def hostile_bodies() -> list[bytes]:
    """The hostile set, one chat body per image."""
    bodies = []
    for image in hostile_urls(MAX_IMAGE_BYTES):
        content = [{"type": "text", "text": "what?"}, image_part(image)]
        body = {"model": MODEL, "max_tokens": 1, "messages": [user(content)]}
        bodies.append(json.dumps(body).encode())
    return bodies


def control_bodies() -> list[bytes]:
    """As many requests as the hostile set, each a tiny body refused with a 400 by the schema
    (`max_tokens: -1`): what a loop of 400s costs Serve and the ingress without any image."""
    body = {"model": MODEL, "max_tokens": -1, "messages": [user([text("what?")])]}
    return [json.dumps(body).encode()] * len(hostile_bodies())


def send_hostile(url: str, control: bool, stop: Any, answered: Any, statuses: Any) -> None:
    """In its own process (its JSON and sends never hold the measuring client's GIL): the
    hostile set (or its control), encoded once, sent over and over until `stop`."""
    bodies = control_bodies() if control else hostile_bodies()
    headers = {"content-type": "application/json"}
    with httpx.Client(timeout=600) as client:
        while not stop.is_set():
            for body in bodies:
                r = client.post(f"{url}/chat/completions", content=body, headers=headers)
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                answered.value += 1


def image_request(url: str, images: int, image_px: int, statuses: list[int]) -> None:
    from tests.workers.vision_checkpoints import random_image

    parts = [
        image_part(data_url(encoded(random_image(i, (image_px, image_px)), "PNG")))
        for i in range(images)
    ]
    body = {"model": MODEL, "max_tokens": 4, "messages": [user([*parts, text("Compare.")])]}
    statuses.append(httpx.post(f"{url}/chat/completions", json=body, timeout=600).status_code)


def beside(url: str, streams: int, tokens: int, work: threading.Thread) -> list[float]:
    """The streams' gaps while `work` runs (started once the streams are under way)."""
    with ThreadPoolExecutor(streams) as pool:
        futures = [pool.submit(stream_gaps, url, tokens, s) for s in range(streams)]
        time.sleep(0.2)  # the streams are decoding when the work arrives
        work.start()
        gaps = [g for f in futures for g in f.result()]
    work.join()
    return gaps


def hostile_run(url: str, tokens: int, rounds: int, control: bool = False) -> dict:
    """One stream alone, then the same stream while the hostile set (or its control: as many
    tiny 400s) is sent over and over; `rounds` times, alternating (the machine's load drifts),
    gaps pooled."""
    solo: list[float] = []
    loaded: list[float] = []
    for _ in range(rounds):
        solo += stream_gaps(url, tokens, 0)
        loaded += hostile_beside(url, tokens, control)
    return report("tiny 400s" if control else "hostile set", solo, loaded)


def hostile_beside(url: str, tokens: int, control: bool) -> list[float]:
    with multiprocessing.Manager() as manager:
        stop, answered, statuses = manager.Event(), manager.Value("i", 0), manager.dict()
        hostile = multiprocessing.Process(
            target=send_hostile, args=(url, control, stop, answered, statuses)
        )
        hostile.start()
        while not answered.value:  # the hostile requests arrive before the stream starts
            time.sleep(0.05)
        loaded = stream_gaps(url, tokens, 0)
        during = answered.value
        stop.set()
        hostile.join()
        codes = dict(statuses)
    print(f"   hostile requests answered by the stream's end: {during}, statuses {codes}")
    return loaded


def user(content: list[dict]) -> dict:
    return {"role": "user", "content": content}


def text(value: str) -> dict:
    return {"type": "text", "text": value}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def report(name: str, solo: list[float], loaded: list[float]) -> dict:
    row: dict[str, Any] = {
        "run": name,
        "solo_p50_ms": pct(solo, 0.5) * 1e3,
        "solo_p90_ms": pct(solo, 0.9) * 1e3,
        "beside_p50_ms": pct(loaded, 0.5) * 1e3,
        "beside_p90_ms": pct(loaded, 0.9) * 1e3,
    }
    row["p50_ratio"] = row["beside_p50_ms"] / row["solo_p50_ms"]
    row["p90_ratio"] = row["beside_p90_ms"] / row["solo_p90_ms"]
    print(
        f"{name:>15}: solo p50 {row['solo_p50_ms']:.1f} ms p90 {row['solo_p90_ms']:.1f} ms | "
        f"beside p50 {row['beside_p50_ms']:.1f} ms p90 {row['beside_p90_ms']:.1f} ms | "
        f"ratio p50 {row['p50_ratio']:.2f}x p90 {row['p90_ratio']:.2f}x"
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image-px", type=int, default=70)
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=8017)
    args = parser.parse_args()
    print(f"load average before: {_load()}")
    url = serve_model(write_model(tempfile.mkdtemp(), args.image_px), args.images, args.port)
    run_streams(url, 2, 8)  # warm-up: the first steps compile and warm the kernels
    rows = [hostile_run(url, args.tokens, args.rounds)]
    rows.append(hostile_run(url, args.tokens, args.rounds, control=True))
    solo: list[float] = []
    loaded: list[float] = []
    answered: list[int] = []
    for _ in range(args.rounds):
        solo += run_streams(url, args.streams, args.tokens)
        images = threading.Thread(
            target=image_request, args=(url, args.images, args.image_px, answered)
        )
        loaded += beside(url, args.streams, args.tokens, images)
    rows.append(report(f"{args.images} images", solo, loaded))
    print(f"   the {args.images}-image requests answered {answered}")
    print(f"load average after: {_load()}")
    print(json.dumps({"args": vars(args), "rows": rows}))


def _load() -> str:
    """The machine's 1, 5 and 15 minute load averages: ratios read against them."""
    return " ".join(f"{v:.1f}" for v in os.getloadavg())


if __name__ == "__main__":
    main()
