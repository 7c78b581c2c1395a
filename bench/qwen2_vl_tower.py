"""The Qwen2.5-VL vision tower: raylm's (workers/models/qwen2_vl_vision.py) against transformers'
`model.visual` on the same random weights, ms per image and the ratio, in one run.

    .venv/bin/python bench/qwen2_vl_tower.py [--depth 8] [--repeats 3] [--threads 0]

The tower has Qwen2.5-VL-3B's shape (width 1280, 16 heads, MLP 3420, out 2048, 112-pixel windows,
full attention on every 8th block) cut to --depth blocks (the published 32 scale linearly), float32
on CPU. Images of 224x224 (64 tokens), 448x448 (256) and 896x672 (768) through the real image
processor. Each figure is the best of --repeats (the machine is shared: the best run is the least
disturbed); the largest difference between the two outputs is printed beside it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image
from transformers import Qwen2_5_VLConfig, Qwen2VLImageProcessor
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionTransformerPretrainedModel,
)

from workers.loader import finish_cpu_weights
from workers.models.qwen2_vl_vision import Qwen2_5_VisionTransformer

SIZES = ((224, 224), (448, 448), (896, 672))


def towers(depth: int) -> tuple[torch.nn.Module, Qwen2_5_VisionTransformer]:
    """transformers' tower with random weights, and ours loaded from its state dict (packed for
    CPU linears, as the loader leaves a model)."""
    vision = Qwen2_5_VLConfig(
        vision_config={
            "depth": depth,
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "out_hidden_size": 2048,
            "window_size": 112,
            "fullatt_block_indexes": list(range(7, depth, 8)),
        }
    ).vision_config
    torch.manual_seed(0)
    theirs = Qwen2_5_VisionTransformerPretrainedModel._from_config(vision).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.02)
    ours = Qwen2_5_VisionTransformer(vision)
    ours.load_weights(theirs.state_dict().items())
    finish_cpu_weights(ours)
    return theirs, ours.eval()


def best_ms(fn: Callable[[], torch.Tensor], repeats: int) -> tuple[float, torch.Tensor]:
    times, out = [], torch.empty(0)
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3, out


def row(theirs, ours, processor, size: tuple[int, int], repeats: int) -> str:
    """One image size's line: tokens, both towers' best ms, their ratio, the largest difference."""
    width, height = size
    pixels = np.random.RandomState(0).randint(0, 256, (height, width, 3), dtype=np.uint8)
    out = processor(images=[Image.fromarray(pixels)], return_tensors="pt")
    px, grid = out["pixel_values"], out["image_grid_thw"]
    hf_ms, expected = best_ms(lambda: theirs(px, grid_thw=grid).pooler_output, repeats)
    our_ms, got = best_ms(lambda: ours(px, grid), repeats)
    diff = (got - expected).abs().max().item()
    return (
        f"{width:>4}x{height:<4} {got.shape[0]:>6} {hf_ms:>9.1f} {our_ms:>9.1f} "
        f"{our_ms / hf_ms:>8.2f} {diff:>9.2e}"
    )


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    theirs, ours = towers(args.depth)
    processor = Qwen2VLImageProcessor()
    print(f"depth {args.depth}, {torch.get_num_threads()} threads, best of {args.repeats}")
    header = ("image", "tokens", "hf ms", "raylm ms", "raylm/hf", "max diff")
    print("{:>9} {:>6} {:>9} {:>9} {:>8} {:>9}".format(*header))
    for size in SIZES:
        print(row(theirs, ours, processor, size, args.repeats), flush=True)


if __name__ == "__main__":
    main()
