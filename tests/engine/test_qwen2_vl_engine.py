"""Qwen2.5-VL through the engine: greedy tokens equal transformers' generate on the same weights.

The tiny random checkpoint (tests/workers/qwen2_vl_checkpoint.py) with the real image processor:
a 56x56 image (4 tokens) and an 84x112 one (12 tokens, several attention windows). Prompts with
0, 1 and 3 images run in one batch, beside a text-only request, on two engines:
- whole prompts, prefix caching on; then a second turn of the 3-image conversation, whose prefix
  (past all three images) comes from the cache: its first chunk starts after the images, at the
  positions the request's M-RoPE delta gives, and nothing is encoded again;
- 16-token steps with at most 12 image tokens encoded per step (chunks never end inside an image)
  over a pool too small for the batch (preemption recomputes, and the positions are laid out
  again).
Every request gives transformers' greedy tokens.
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
from workers.features.vision import VisionFeature

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


def generate(llm: LLM, prompts, keep: bool = False) -> list:
    """Every prompt in one batch through the offline LLM; each one's tokens (its whole output
    with keep)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    batch = [{"prompt_token_ids": ids, "multi_modal_data": {"image": im}} for ids, im in prompts]
    outputs = llm.generate(batch, params, use_tqdm=False)
    return outputs if keep else [out.token_ids for out in outputs]


WHOLE = dict(block_size=4, num_gpu_blocks=96, max_model_len=96)
CHUNKED = dict(
    block_size=4,
    num_gpu_blocks=14,  # the 47-token request alone needs 12; the batch needs 24
    max_model_len=56,
    max_num_batched_tokens=16,
    max_num_encoder_tokens=12,
    enable_prefix_caching=False,
)


def engine(path: str, settings: dict) -> LLM:
    return LLM(path, device="cpu", load_progress=False, **settings)


@pytest.fixture(scope="module")
def whole(checkpoint):
    """The engine that prefills whole prompts, with the prefix cache."""
    with engine(checkpoint[0], WHOLE) as llm:
        yield llm


def test_whole_prompts_then_a_second_turn_from_the_prefix_cache(checkpoint, references, whole):
    path, hf = checkpoint
    outputs = generate(whole, PROMPTS)
    for (_, images), tokens, ref in zip(PROMPTS, outputs, references):
        assert_greedy_match(tokens, ref, f"{len(images)} images, whole prompts")
    ids, images = PROMPTS[2]
    turn = ids + outputs[2] + [11, 12, 13]
    cache = whole.engine.executor.runner.feature(VisionFeature).cache  # type: ignore[attr-defined]
    encoded = cache.misses
    second = generate(whole, [(turn, images)], keep=True)[0]
    assert second.num_cached_tokens >= len(ids) - 3 + 20  # all 20 image tokens came cached
    assert cache.misses == encoded  # nothing encoded again
    processor = AutoImageProcessor.from_pretrained(path)
    assert_greedy_match(second.token_ids, hf_greedy(hf, processor, turn, images), "second turn")


def test_chat_with_an_image_part(checkpoint, whole):
    """LLM.chat: the template writes Qwen's placeholder for the image part; transformers' tokens
    for the ids it renders."""
    path, hf = checkpoint
    picture = image(5, (84, 56))
    content = [{"type": "text", "text": "w5 w6 w7"}, {"type": "text", "text": "w8"}]
    chat = [{"role": "user", "content": [{"type": "image_pil", "image_pil": picture}, *content]}]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    got = whole.chat(chat, params, use_tqdm=False)[0]
    rendered = [{"role": "user", "content": [{"type": "image"}, *content]}]
    text = whole.tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
    ids = whole.tokenizer(text, add_special_tokens=False).input_ids
    assert got.prompt_token_ids == ids
    assert ids.count(IMAGE_TOKEN) == 1 and ids[ids.index(IMAGE_TOKEN) - 1] == VISION_START
    processor = AutoImageProcessor.from_pretrained(path)
    assert_greedy_match(got.token_ids, hf_greedy(hf, processor, ids, [picture]), "chat")


def test_chunks_encoder_budget_and_preemption(checkpoint, references):
    path, _ = checkpoint
    with engine(path, CHUNKED) as llm:
        outputs = generate(llm, PROMPTS)
        assert llm.engine.stats().num_preemptions > 0
    for (_, images), tokens, ref in zip(PROMPTS, outputs, references):
        assert_greedy_match(tokens, ref, f"{len(images)} images, chunked")
