"""Streaming text requests' inter-token latency beside a request with many images, offline on one
engine, with and without the encoder budget (max_num_encoder_tokens).

A random LLaVA whose CLIP tower is big enough to cost something on a CPU (by default 224 px
images, 256 tokens each, a tower of width 256 and 4 layers) serves 8 text requests that decode
one token a step; once they stream, a request with 16 images arrives. Three runs on fresh
engines:
- solo: the 8 streams alone;
- unbudgeted: the token budget holds the whole image prompt, the encoder budget is left at it;
- budgeted: the same token budget, max_num_encoder_tokens one image.
Prints the streams' median, p90 and longest gap between tokens, and each as a ratio to solo, in
wall time and in this process's CPU time (all threads): on a shared machine the CPU figures are
the ones other processes' load distorts least. Figures, never pass/fail.

    python bench/vision_encoder_budget.py [--images 16] [--streams 8] [--tokens 24] [--threads 2]
        [--image-size 224] [--vision-width 256] [--vision-layers 4]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from transformers import AutoTokenizer

from engine.llm import LLM
from scheduler.request import EngineRequest
from scheduler.sampling_params import SamplingParams
from tests.workers.vision_checkpoints import random_image, write_tiny_llava
from workers.model_files import resolve_model


def stream_gaps(
    llm: LLM, images: int, streams: int, tokens: int, size: int
) -> dict[str, list[float]]:
    """Gaps between consecutive tokens of the streams, the image request arriving once all
    stream."""
    engine = llm.engine
    params = SamplingParams(max_tokens=tokens + 1, temperature=0, ignore_eos=True)
    ids = [f"s{i}" for i in range(streams)]
    for i, rid in enumerate(ids):
        engine.add_request(EngineRequest(rid, list(range(300 + i, 340 + i)), params))
    started: set[str] = set()
    while len(started) < streams:
        started |= {o.request_id for o in engine.step() if o.new_token_ids}
    if images:
        placeholder = engine.images.placeholder  # type: ignore[union-attr]
        prompt = [placeholder] * images + list(range(500, 520))
        pictures = tuple(random_image(100 + i, (size, size)) for i in range(images))
        engine.add_request(
            EngineRequest("img", prompt, SamplingParams(max_tokens=4), images=pictures)
        )
    gaps: dict[str, list[float]] = {"wall": [], "cpu": []}
    last = (time.perf_counter(), time.process_time())
    live = set(ids)
    while live:
        outs = engine.step()
        if any(o.request_id in live and o.new_token_ids for o in outs):
            now = (time.perf_counter(), time.process_time())
            gaps["wall"].append(now[0] - last[0])
            gaps["cpu"].append(now[1] - last[1])
            last = now
        live -= {o.request_id for o in outs if o.finished}
    while engine.has_unfinished_requests():
        engine.step()
    return gaps


def summary(values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values)
    return statistics.median(ordered), ordered[int(0.9 * (len(ordered) - 1))], ordered[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--image-size", type=int, default=224, help="px; tokens: (size / 14)^2")
    parser.add_argument("--vision-width", type=int, default=256)
    parser.add_argument("--vision-layers", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = tempfile.mkdtemp(prefix="bench-llava-")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("default"))
    ckpt = write_tiny_llava(
        path,
        tokenizer,
        image_size=args.image_size,
        vision_width=args.vision_width,
        vision_layers=args.vision_layers,
        max_positions=8192,
    )
    budget = args.images * ckpt.tokens_per_image + 64  # the whole image prompt fits one step
    runs = {
        "solo": ({}, 0),
        "unbudgeted": ({}, args.images),
        "budgeted": ({"max_num_encoder_tokens": ckpt.tokens_per_image}, args.images),
    }
    results = {}
    for name, (extra, images) in runs.items():
        with LLM(
            model=path,
            device="cpu",
            load_progress=False,
            num_gpu_blocks=512,
            max_model_len=budget + 64,
            max_num_batched_tokens=budget,
            enable_prefix_caching=False,
            **extra,
        ) as llm:
            stream_gaps(llm, 0, args.streams, 4, args.image_size)  # warm-up
            results[name] = stream_gaps(llm, images, args.streams, args.tokens, args.image_size)
    base = {clock: summary(results["solo"][clock]) for clock in ("wall", "cpu")}
    print(
        f"{args.streams} streams, {args.images} images of {ckpt.tokens_per_image} tokens "
        f"(tower: {args.image_size} px, width {args.vision_width}, {args.vision_layers} layers)"
    )
    for name, gaps in results.items():
        for clock in ("wall", "cpu"):
            med, p90, worst = summary(gaps[clock])
            b = base[clock]
            print(
                f"{name:>10} {clock:>4}: median {med * 1e3:7.1f} ms ({med / b[0]:4.2f}x)  "
                f"p90 {p90 * 1e3:7.1f} ms ({p90 / b[1]:4.2f}x)  "
                f"max {worst * 1e3:7.1f} ms ({worst / b[2]:4.2f}x)"
            )


if __name__ == "__main__":
    main()
