"""Images in, text out, through the offline LLM: a tiny random LLaVA with its real processor gives
transformers' greedy tokens for prompts with 0, 1 and 3 images, mixed with text-only requests,
chunked around images under an encoder budget, preempted, with prefix and encoder caches."""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from tests.workers.vision_checkpoints import VisionCheckpoint, random_image, write_tiny_llava
from workers.features.vision import VisionFeature

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
# Two engines serve every test (an engine start is the cost), each with a feature images compose
# with: A caches prefixes in blocks of 4 and verifies n-gram proposals; B runs steps of 6 tokens
# and 4 image tokens over a pool too small for its batch, no prefix cache, overlapped steps.
ENGINE_A = dict(
    num_gpu_blocks=64,
    max_model_len=256,
    block_size=4,
    speculative={"method": "ngram", "num_tokens": 3},
)
ENGINE_B = dict(
    async_scheduling=True,
    max_num_batched_tokens=6,
    max_num_encoder_tokens=4,
    num_gpu_blocks=12,
    block_size=4,
    max_model_len=48,
    enable_prefix_caching=False,
)
ONE = "USER: <image>\nWhat is in this picture? ASSISTANT:"
THREE = "USER: <image> first, <image> second <image> and third: compare them ASSISTANT:"
TEXT = "USER: Tell me a story about a small cat. ASSISTANT:"


@dataclass
class Llava:
    ckpt: VisionCheckpoint
    hf: Any
    processor: Any

    @property
    def path(self) -> str:
        return self.ckpt.path

    def greedy(self, text: str, images: list[Any], n: int = GREEDY.max_tokens) -> list[int]:
        """transformers' greedy continuation of text with its images."""
        inputs = self.processor(text=text, images=images or None, return_tensors="pt")
        with torch.no_grad():
            out = self.hf.generate(**inputs, max_new_tokens=n, do_sample=False)
        return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.fixture(scope="module")
def llava(tmp_path_factory, smollm2_tokenizer) -> Llava:
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    path = str(tmp_path_factory.mktemp("tiny-llava"))
    ckpt = write_tiny_llava(path, smollm2_tokenizer)
    hf = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return Llava(ckpt, hf, AutoProcessor.from_pretrained(path))


@pytest.fixture(scope="module")
def engine_a(llava) -> Iterator[LLM]:
    with LLM(model=llava.path, device="cpu", load_progress=False, **ENGINE_A) as llm:
        yield llm


@pytest.fixture(scope="module")
def engine_b(llava) -> Iterator[LLM]:
    with LLM(model=llava.path, device="cpu", load_progress=False, **ENGINE_B) as llm:
        yield llm


def with_images(text: str, images: list[Any]) -> dict[str, Any]:
    return {"prompt": text, "multi_modal_data": {"image": images}}


def test_greedy_tokens_match_hf_for_0_1_3_images_in_a_batch_with_text_requests(llava, engine_a):
    llm = engine_a
    one, three = [random_image(1)], [random_image(2), random_image(3, (64, 48)), random_image(4)]
    cases = [(TEXT, []), (ONE, one), (THREE, three), ("USER: hi ASSISTANT:", [])]
    outs = llm.generate([with_images(t, i) if i else t for t, i in cases], GREEDY, use_tqdm=False)
    for (text, images), out in zip(cases, outs):
        assert out.token_ids == llava.greedy(text, images), (text, len(images))
    # The same prompt as token ids with one placeholder per image: the same tokens.
    ids = llm.tokenizer.encode(THREE, add_special_tokens=False)
    assert ids.count(llava.ckpt.image_token_id) == 3
    again = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": three}}, GREEDY)
    assert again[0].token_ids == outs[2].token_ids


def test_chunks_around_images_under_an_encoder_budget_with_preemption_match_hf(llava, engine_b):
    """Steps of 6 tokens and 4 image tokens (one image a step), a pool too small for the batch,
    no prefix cache: every image still runs whole, and each request gives HF's tokens."""
    llm = engine_b
    cases = [
        (THREE, [random_image(10 + i), random_image(20 + i), random_image(30)]) for i in range(3)
    ]
    cases.append((ONE, [random_image(40)]))
    before = llm.engine.stats().num_preemptions
    outs = llm.generate([with_images(t, i) for t, i in cases], GREEDY, use_tqdm=False)
    assert llm.engine.stats().num_preemptions > before
    for (text, images), out in zip(cases, outs):
        assert out.token_ids == llava.greedy(text, images)


def test_second_turn_reads_the_encoder_cache_and_gives_identical_tokens(llava, engine_b):
    llm = engine_b
    cache = llm.engine.executor.runner.feature(VisionFeature).cache  # type: ignore[attr-defined]
    image = random_image(77)
    first = llm.generate(with_images(ONE, [image]), GREEDY, use_tqdm=False)[0]
    hits, misses = cache.hits, cache.misses
    second = llm.generate(with_images(ONE, [image.copy()]), GREEDY, use_tqdm=False)[0]
    assert (cache.hits, cache.misses) == (hits + 1, misses)  # read, not encoded again
    stats = llm.engine.stats()  # what /metrics reads
    assert stats.num_encoder_cache_hits == cache.hits and stats.num_images_encoded == misses
    assert stats.encoder_time_us > 0
    assert second.token_ids == first.token_ids == llava.greedy(ONE, [image])


def test_prefix_cache_keys_image_blocks_by_the_image(llava, engine_a):
    """The same text with another image hits only the blocks before the image; with the same
    image it hits past it; the other image's tokens are its own (HF's)."""
    llm = engine_a
    text = "USER: a long shared preamble about pictures of things <image> what is it? ASSISTANT:"
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    before_image = ids.index(llava.ckpt.image_token_id) // 4 * 4
    x, y = random_image(101), random_image(102)
    llm.generate(with_images(text, [x]), GREEDY, use_tqdm=False)
    other = llm.generate(with_images(text, [y]), GREEDY, use_tqdm=False)[0]
    assert other.num_cached_tokens == before_image
    assert other.token_ids == llava.greedy(text, [y])
    same = llm.generate(with_images(text, [x]), GREEDY, use_tqdm=False)[0]
    assert same.num_cached_tokens > before_image + llava.ckpt.tokens_per_image
    assert same.token_ids == llava.greedy(text, [x])


def test_chat_with_image_parts_renders_the_placeholder_and_matches_hf(llava, engine_a):
    llm = engine_a
    a, b = random_image(5), random_image(6)
    png = io.BytesIO()
    a.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    content = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "image_pil", "image_pil": b},
        {"type": "text", "text": "Which one is brighter?"},
    ]
    out = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)[0]
    rendered = "USER: <image>\n<image>\nWhich one is brighter? ASSISTANT:"
    assert out.prompt == rendered
    assert out.token_ids == llava.greedy(rendered, [a, b])


def test_control_text_in_a_text_part_stays_text(llava, engine_a):
    """`<image>` typed in a text part is text, never a placeholder: the prompt holds exactly the
    placeholders of its image parts."""
    llm = engine_a
    content = [
        {"type": "image_pil", "image_pil": random_image(7)},
        {"type": "text", "text": "ignore <image> this"},
    ]
    out = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids.count(llava.ckpt.image_token_id) == 1


@pytest.mark.parametrize(
    ("prompt", "field"),
    [
        (with_images(ONE, []), "images"),  # a placeholder without its image
        (with_images(TEXT, [None]), "multi_modal_data.image[0]"),
        ({"prompt": ONE, "prompt_token_ids": [1]}, "prompt"),
        ({"prompt": ONE, "multi_modal_data": {"video": []}}, "multi_modal_data"),
        ({"prompt": ONE, "extra": 1}, "prompt"),
    ],
)
def test_bad_image_prompts_are_refused_naming_the_field(llava, engine_a, prompt, field):
    llm = engine_a
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(prompt, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_images_are_refused_by_a_text_model(tiny_model_dir, llm_factory):
    llm = llm_factory(model=tiny_model_dir, num_gpu_blocks=64, max_model_len=256)
    with pytest.raises(ValueError, match="images: .* takes no images"):
        llm.generate(with_images("hello", [random_image(1)]), GREEDY, use_tqdm=False)


@pytest.mark.parametrize("value", [2**64, -1, float("nan"), float("inf"), 1e9, "x" * 100_000])
def test_encoder_cache_gb_out_of_bounds_is_refused_naming_it(value):
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="encoder_cache_gb"):
        EngineConfig.from_kwargs(encoder_cache_gb=value)
    assert (
        EngineConfig.from_kwargs(encoder_cache_gb=0).runner_config("m", 64).encoder_cache_bytes == 0
    )
