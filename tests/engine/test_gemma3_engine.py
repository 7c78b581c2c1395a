"""Gemma 3 with images through the offline LLM (tests/workers/gemma3_checkpoint.py: a tiny random
checkpoint with its real processor, a sliding window of 8 shorter than every prompt): one engine
in steps of 10 tokens and 4 image tokens (an image never cut, one image a step) with the prefix
cache in blocks of 4 gives transformers' greedy tokens for prompts with 0, 1 and 3 images in one
batch, again from the prefix and encoder caches, and for a chat with image parts; a second engine
over a pool too small for its batch preempts and still gives transformers' tokens."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from engine.llm import LLM
from frontend.images import image_text
from scheduler.sampling_params import SamplingParams
from tests.workers.gemma3_checkpoint import write_tiny_gemma3
from tests.workers.vision_checkpoints import random_image
from workers.features.vision import VisionFeature

# One engine start and transformers' generate per case: ~50 s on the loaded 2-core VM.
pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
ENGINE = dict(
    num_gpu_blocks=96,
    max_model_len=256,
    block_size=4,
    max_num_batched_tokens=10,
    max_num_encoder_tokens=4,
)
TURN = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"
ONE = TURN.format("<start_of_image>What is in this picture?")
THREE = TURN.format("<start_of_image> first, <start_of_image> second <start_of_image> third")
TEXT = TURN.format("Tell me a story about a small cat.")


@dataclass
class Gemma3:
    path: str
    hf: Any
    processor: Any

    def greedy(self, text: str, images: list[Any]) -> list[int]:
        """transformers' greedy continuation of text (`<start_of_image>` per image)."""
        inputs = self.processor(text=text, images=images or None, return_tensors="pt")
        with torch.no_grad():
            out = self.hf.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
        return out[0, inputs["input_ids"].shape[1] :].tolist()

    def sent(self, text: str) -> str:
        """The prompt as raylm takes it: one soft token per image, as the chat path writes it."""
        rewrite = image_text(self.processor.tokenizer)
        assert rewrite is not None
        return rewrite.apply(text)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, smollm2_tokenizer) -> Gemma3:
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    path = str(tmp_path_factory.mktemp("tiny-gemma3-engine"))
    write_tiny_gemma3(path, smollm2_tokenizer, seed=1)
    hf = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return Gemma3(path, hf, AutoProcessor.from_pretrained(path))


@pytest.fixture(scope="module")
def llm(gemma3) -> Iterator[LLM]:
    with LLM(model=gemma3.path, device="cpu", load_progress=False, **ENGINE) as llm:
        yield llm


def prompt(gemma3: Gemma3, text: str, images: list[Any]) -> Any:
    if not images:
        return gemma3.sent(text)
    return {"prompt": gemma3.sent(text), "multi_modal_data": {"image": images}}


def test_greedy_tokens_match_hf_for_0_1_3_images_chunked_in_a_batch(gemma3, llm):
    one, three = [random_image(1)], [random_image(2), random_image(3, (64, 48)), random_image(4)]
    cases = [(TEXT, []), (ONE, one), (THREE, three)]
    outs = llm.generate([prompt(gemma3, t, i) for t, i in cases], GREEDY, use_tqdm=False)
    for (text, images), out in zip(cases, outs):
        assert len(out.prompt_token_ids) > 10  # prefilled over several steps
        assert out.token_ids == gemma3.greedy(text, images), (text, len(images))


def test_a_pool_too_small_for_the_batch_preempts_and_still_gives_hf_tokens(gemma3):
    """Two prompts of one image (22 tokens each) prefilled in one step over 14 blocks of 4
    tokens, no prefix cache: by their 29th token they need 16 blocks, so one is preempted and
    recomputed (its image encoded again, never cut); a prompt of three images waits its turn.
    Each gives transformers' tokens."""
    cases = [(ONE, [random_image(10)]), (ONE, [random_image(11)])]
    cases.append((THREE, [random_image(20), random_image(21), random_image(22)]))
    small = {
        **ENGINE,
        "num_gpu_blocks": 14,
        "max_model_len": 56,
        "max_num_batched_tokens": 48,
        "max_num_encoder_tokens": 12,
        "enable_prefix_caching": False,
    }
    with LLM(model=gemma3.path, device="cpu", load_progress=False, **small) as llm:
        outs = llm.generate([prompt(gemma3, t, i) for t, i in cases], GREEDY, use_tqdm=False)
        assert llm.engine.stats().num_preemptions > 0
    for (text, images), out in zip(cases, outs):
        assert out.token_ids == gemma3.greedy(text, images), len(images)


def test_a_second_turn_reads_every_image_from_the_prefix_cache_with_identical_tokens(gemma3, llm):
    cache = llm.engine.executor.runner.feature(VisionFeature).cache  # type: ignore[attr-defined]
    images = [random_image(20), random_image(21), random_image(22)]
    first = llm.generate(prompt(gemma3, THREE, images), GREEDY, use_tqdm=False)[0]
    encoded = cache.misses
    second = llm.generate(prompt(gemma3, THREE, images), GREEDY, use_tqdm=False)[0]
    # The output's prompt holds one soft token an image; the engine's, 4 (offsets shift by 3).
    ids = second.prompt_token_ids
    soft = [i for i, t in enumerate(ids) if t == gemma3.hf.config.image_token_id]
    starts = [u + 3 * k for k, u in enumerate(soft)]
    assert len(starts) == 3
    assert second.num_cached_tokens >= starts[-1] + 4  # every image's KV from the cache
    assert cache.misses == encoded  # so no image is encoded again
    assert second.token_ids == first.token_ids == gemma3.greedy(THREE, images)
    # A third image of its own after the same two: the hit stops inside the prefix before it,
    # the new image is encoded, the first two (a resumed chunk may touch) are read if needed.
    third = [*images[:2], random_image(23)]
    other = llm.generate(prompt(gemma3, THREE, third), GREEDY, use_tqdm=False)[0]
    assert 0 < other.num_cached_tokens <= starts[2]  # not past the new image's first token
    assert other.token_ids == gemma3.greedy(THREE, third)


def test_chat_with_image_parts_matches_hf_on_the_processors_template(gemma3, llm):
    a, b = random_image(5), random_image(6)
    content = [
        {"type": "text", "text": "Compare"},
        {"type": "image_pil", "image_pil": a},
        {"type": "text", "text": "with"},
        {"type": "image_pil", "image_pil": b},
    ]
    out = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)[0]
    hf_messages = [
        {
            "role": "user",
            "content": [p if p["type"] == "text" else {"type": "image"} for p in content],
        }
    ]
    text = gemma3.processor.apply_chat_template(hf_messages, add_generation_prompt=True)
    inputs = gemma3.processor(text=text, images=[a, b], return_tensors="pt")
    hf_ids, soft = inputs["input_ids"][0].tolist(), gemma3.hf.config.image_token_id
    one_each = [t for i, t in enumerate(hf_ids) if t != soft or hf_ids[i - 1] != soft]
    assert out.prompt_token_ids == one_each  # the processor's ids, one soft token an image
    assert out.token_ids == gemma3.greedy(text, [a, b])
