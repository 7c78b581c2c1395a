"""Qwen2.5-VL through the engine: greedy tokens equal transformers' generate on the same weights.

The tiny random checkpoint (tests/workers/qwen2_vl_checkpoint.py) with the real image processor:
a 56x56 image (4 tokens) and an 84x112 one (12 tokens, several attention windows). Prompts with
0, 1 and 3 images run in one batch, beside a text-only request, on an engine that prefills whole
prompts and on one whose 16-token budget cuts them into chunks (never inside an image) while the
others decode: every request gives transformers' greedy tokens. Text after images runs at
positions shifted by the request's M-RoPE delta; a text-only request keeps plain positions.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor

from engine.llm import LLM
from scheduler import SamplingParams
from tests.workers.greedy import Greedy, assert_greedy_match
from tests.workers.qwen2_vl_checkpoint import (
    IMAGE_TOKEN,
    VISION_END,
    VISION_START,
    write_tiny_qwen2_vl,
)

MAX_TOKENS = 8
SIZES = [(56, 56), (112, 84), (56, 56)]  # (width, height): 4, 12 and 4 tokens


def image(seed: int, size: tuple[int, int]) -> Image.Image:
    pixels = np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def prompt(num_images: int, seed: int) -> tuple[list[int], list[Image.Image]]:
    """Token ids with one <|image_pad|> per image between vision start and end, and the images
    (the third the first one again)."""
    gen = np.random.RandomState(seed)
    ids = gen.randint(3, 290, 4).tolist()
    images = []
    for i in range(num_images):
        ids += [VISION_START, IMAGE_TOKEN, VISION_END, *gen.randint(3, 290, 3).tolist()]
        images.append(image(i % 2, SIZES[i]))
    return ids, images


PROMPTS = [prompt(0, 10), prompt(1, 11), prompt(3, 12), prompt(0, 13)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen2-vl-engine"))
    return path, write_tiny_qwen2_vl(path, seed=1)


@pytest.fixture(scope="module")
def references(checkpoint) -> list[Greedy]:
    path, hf = checkpoint
    processor = AutoImageProcessor.from_pretrained(path)
    return [hf_greedy(hf, processor, ids, images) for ids, images in PROMPTS]


@torch.inference_mode()
def hf_greedy(hf, processor, ids: list[int], images: list[Image.Image]) -> Greedy:
    """transformers' greedy generate on the processor's pixels, the placeholders expanded as
    Qwen2_5_VLProcessor expands them (one per merged patch)."""
    kwargs = {}
    expanded = list(ids)
    if images:
        out = processor(images=images, return_tensors="pt")
        counts = iter((out["image_grid_thw"].prod(-1) // 4).tolist())
        expanded = [t for i in ids for t in ([i] * next(counts) if i == IMAGE_TOKEN else [i])]
        kwargs = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
    input_ids = torch.tensor([expanded])
    generated = hf.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        mm_token_type_ids=(input_ids == IMAGE_TOKEN).int(),
        max_new_tokens=MAX_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )
    tokens = generated.sequences[0, len(expanded) :].tolist()
    top2 = [tuple(s[0].log_softmax(-1).topk(2).values.tolist()) for s in generated.logits]
    return Greedy(tokens, top2)


def generate(llm: LLM, prompts) -> list[list[int]]:
    """Every prompt in one batch through the offline LLM; each one's tokens."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    batch = [{"prompt_token_ids": ids, "multi_modal_data": {"image": im}} for ids, im in prompts]
    return [out.token_ids for out in llm.generate(batch, params, use_tqdm=False)]


@pytest.mark.parametrize("budget", [2048, 16], ids=["whole-prompts", "chunked"])
def test_images_text_and_batch_give_transformers_tokens(checkpoint, references, budget):
    path, _ = checkpoint
    with LLM(
        path,
        device="cpu",
        load_progress=False,
        kv_cache_memory_gb=0.01,
        max_num_batched_tokens=budget,
        enable_prefix_caching=False,
    ) as llm:
        outputs = generate(llm, PROMPTS)
    for (_, images), tokens, ref in zip(PROMPTS, outputs, references):
        assert_greedy_match(tokens, ref, f"{len(images)} images, budget {budget}")
