"""Gemma 3 with images as raylm runs it (tests/workers/gemma3_checkpoint.py: a sliding window of
8, shorter than every prompt here, and 4 image tokens an image):

- the SigLIP tower, its final norm and the pooling projector give transformers' image features;
- the spliced prompt gives transformers' logits through the paged cache, the image tokens of
  each image attending to each other both ways (causal alone does not), also when the prefill
  starts inside an image whose head came from the cache (a prefix hit);
- the engine's expansion of one soft token per image gives Gemma3Processor's ids;
- bad configs are refused naming the field.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoProcessor

from engine.multimodal import ImagePreprocessor
from frontend.images import image_text
from scheduler.request import EngineRequest
from tests.workers.gemma3_checkpoint import SLIDING_WINDOW, write_tiny_gemma3
from tests.workers.vision_checkpoints import random_image
from workers.kv_cache import KVCache, KVCacheSpec
from workers.layers.attention import AttentionMetadata, select_backend
from workers.loader import load_model
from workers.models.gemma3_vl import Gemma3ForConditionalGeneration

BLOCK = 4
PROMPT = (
    "<start_of_turn>user\nLook at: <start_of_image> and <start_of_image>, compare.<end_of_turn>\n"
)
SEEDS = (11, 12)
HUGE = [2**64, -1, float("nan"), 10**12]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, smollm2_tokenizer):
    """(checkpoint dir, HF model, the prompt's HF inputs and logits, our model on a paged
    cache)."""
    from transformers import Gemma3ForConditionalGeneration as HFGemma3

    path = str(tmp_path_factory.mktemp("tiny-gemma3"))
    write_tiny_gemma3(path, smollm2_tokenizer)
    hf = HFGemma3.from_pretrained(path, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(path)
    inputs = processor(text=PROMPT, images=[random_image(s) for s in SEEDS], return_tensors="pt")
    assert inputs["input_ids"].shape[1] > 3 * SLIDING_WINDOW  # the window bounds every layer 0
    with torch.no_grad():
        expected = hf(**inputs).logits[0]
    return path, hf, (inputs, expected), load(path)


def load(path: str) -> Gemma3ForConditionalGeneration:
    config = AutoConfig.from_pretrained(path)
    model = load_model(path, config, torch.float32, torch.device("cpu"), progress=False)
    assert isinstance(model, Gemma3ForConditionalGeneration)
    layers = model.attention_layers()
    KVCache(KVCacheSpec.of(layers, BLOCK, torch.float32), 32, 0, torch.device("cpu")).bind(layers)
    backend = select_backend(torch.device("cpu"), "torch")
    for layer in layers:
        layer.backend = backend
    return model


def run(model, ids: list[int], pixels: torch.Tensor, start: int = 0, both_ways: bool = True):
    """Logits of tokens [start, len(ids)) over blocks 0.. (positions before start already in the
    cache), the images' rows in the chunk spliced; both_ways=False hides the image ranges from
    the attention (plain causal)."""
    soft = model.image_token
    runs = [i for i, t in enumerate(ids) if t == soft and ids[i - 1] != soft]
    per_image = model.multi_modal_projector.side // model.multi_modal_projector.kernel
    per_image *= per_image
    with torch.inference_mode():
        embeds = torch.cat([model.encode_image({"pixel_values": p[None]}) for p in pixels])
        rows = [r + k for r in runs for k in range(per_image)]
        keep = [i for i, r in enumerate(rows) if r >= start]
        spans = [
            (max(r, start) - start, r + per_image - start) for r in runs if r + per_image > start
        ]
        rows_t = torch.tensor([rows[i] - start for i in keep])
        model.image_splice.set(rows_t, embeds[keep], spans if both_ways else [])
        n = len(ids) - start
        table = [list(range(-(-len(ids) // BLOCK)))]
        meta, positions = AttentionMetadata.build([start], [n], table, BLOCK, "cpu")
        model.attention_layers()[0].backend.prepare(meta)
        hidden = model(torch.tensor(ids[start:]), positions, meta)
        return model.compute_logits(hidden)


def test_the_tower_and_projector_give_transformers_image_features(gemma3):
    _, hf, (inputs, _), model = gemma3
    with torch.no_grad():
        features = hf.model.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output
        ours = torch.stack(
            [model.encode_image({"pixel_values": p[None]}) for p in inputs["pixel_values"]]
        )
    assert ours.shape == (2, 4, 64)
    torch.testing.assert_close(ours, features, atol=1e-5, rtol=1e-5)


def test_the_spliced_prompt_gives_transformers_logits_with_images_attended_both_ways(gemma3):
    _, _, (inputs, expected), model = gemma3
    ids = inputs["input_ids"][0].tolist()
    got = run(model, ids, inputs["pixel_values"])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    causal = run(model, ids, inputs["pixel_values"], both_ways=False)
    assert (causal - expected).abs().max() > 1e-2  # the image mask changes what follows


def test_a_prefill_starting_inside_an_image_after_a_prefix_hit_gives_transformers_logits(gemma3):
    """The cache holds the whole prompt's KV (a first request); a second prefill from a block
    boundary inside the second image recomputes the rest: its rows equal transformers'."""
    _, _, (inputs, expected), model = gemma3
    ids = inputs["input_ids"][0].tolist()
    second = [i for i, t in enumerate(ids) if t == model.image_token][4]  # image 2's first row
    start = (second // BLOCK + 1) * BLOCK
    assert second < start < second + 4, second  # the chunk starts inside the image
    run(model, ids, inputs["pixel_values"])  # the first request fills the cache
    got = run(model, ids, inputs["pixel_values"], start=start)
    torch.testing.assert_close(got, expected[start:], atol=1e-4, rtol=1e-4)


def test_one_soft_token_per_image_expands_to_the_processors_ids(gemma3):
    path, _, (inputs, _), _ = gemma3
    pre = ImagePreprocessor.load(path)
    assert pre is not None
    processor = AutoProcessor.from_pretrained(path)
    sent = image_text(processor.tokenizer)
    assert sent is not None
    ids = processor.tokenizer.encode(sent.apply(PROMPT), add_special_tokens=False)
    assert ids.count(pre.placeholder) == 2
    images = tuple(random_image(s) for s in SEEDS)
    out = pre.expand(EngineRequest("r", ids, images=images))
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert out.mm_inputs is not None and [s.length for s in out.mm_inputs.spans] == [4, 4]


@pytest.mark.parametrize("bad", [*HUGE, 3, 5, "4", True])
def test_bad_image_token_counts_are_refused(gemma3, bad):
    config = copy.deepcopy(AutoConfig.from_pretrained(gemma3[0]))
    config.__dict__["mm_tokens_per_image"] = bad  # past transformers' own field checks
    with pytest.raises(ValueError, match="mm_tokens_per_image"):
        Gemma3ForConditionalGeneration(config)


@pytest.mark.parametrize("bad", [*HUGE, 30])
def test_bad_tower_sizes_are_refused(gemma3, bad):
    config = copy.deepcopy(AutoConfig.from_pretrained(gemma3[0]))
    config.vision_config.__dict__["image_size"] = bad
    with pytest.raises(ValueError, match="vision_config.image_size"):
        Gemma3ForConditionalGeneration(config)


def test_an_image_of_another_size_is_refused_naming_images(gemma3):
    import numpy as np

    config = AutoConfig.from_pretrained(gemma3[0])
    arrays = {"pixel_values": np.zeros((1, 3, 56, 56), np.float32)}
    with pytest.raises(ValueError, match="images: expected pixel_values of one 28x28"):
        Gemma3ForConditionalGeneration.num_image_tokens(config, arrays)


def test_the_frontend_writes_gemma3s_image_text_and_leaves_typed_markers_as_text(gemma3):
    """A chat's image parts become the processor's text around one soft token each (its ids,
    expanded, are Gemma3Processor's for the same chat); `<start_of_image>` typed in a text part
    stays text, never an image."""
    from frontend.frontend import Frontend

    path, _, _, _ = gemma3
    frontend = Frontend.load(path)
    processor = AutoProcessor.from_pretrained(path)
    parts = [{"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "text", "text": "it"}]
    messages = [{"role": "user", "content": parts}]
    ids = frontend.encode_chat(messages)
    image = random_image(SEEDS[0])
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    hf_ids = processor(text=text, images=[image])["input_ids"][0]
    pre = ImagePreprocessor.load(path)
    assert pre is not None and ids.count(pre.placeholder) == 1
    expanded = pre.expand(EngineRequest("r", ids, images=(image,))).prompt_token_ids
    assert expanded == list(hf_ids)
    typed = [{"role": "user", "content": [{"type": "text", "text": "<start_of_image> hi"}]}]
    assert pre.placeholder not in frontend.encode_chat(typed)


@pytest.mark.parametrize(
    ("setting", "value"), [("attention_backend", "flash_attn"), ("batch_invariant", True)]
)
def test_settings_that_cannot_attend_an_image_both_ways_are_refused_at_start(
    gemma3, setting, value
):
    """The vision feature is built when the runner starts: a Gemma 3 engine with flash-attn or
    batch-invariant rows never starts (no step could run its images right)."""
    from workers.features.base import RunnerContext
    from workers.features.vision import VisionFeature
    from workers.runner_config import RunnerConfig

    path, _, _, model = gemma3
    fields = dict(
        model_dir=path,
        dtype="float32",
        device="cpu",
        block_size=BLOCK,
        max_model_len=256,
        max_num_batched_tokens=256,
        max_num_seqs=4,
        seed=0,
        attention_backend="torch",
        kv_cache_memory_gb=0.1,
        gpu_memory_utilization=0.9,
        load_progress=False,
    )
    cpu, args = torch.device("cpu"), (torch.float32, True, {})
    VisionFeature(RunnerContext(RunnerConfig(**fields), model, None, cpu, *args))  # type: ignore[arg-type]
    config = RunnerConfig(**{**fields, setting: value})
    with pytest.raises(ValueError, match=setting):
        VisionFeature(RunnerContext(config, model, None, cpu, *args))  # type: ignore[arg-type]
