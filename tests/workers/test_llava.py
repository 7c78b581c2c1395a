"""LLaVA as raylm runs it: the CLIP tower and projector give transformers' image features, the
spliced prompt gives its logits (on one rank, and on two tensor-parallel ranks with the tower
replicated), and both checkpoint layouts load."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoProcessor, LlavaConfig

from engine.multimodal import ImagePreprocessor
from tests.workers.vision_checkpoints import random_image, write_tiny_llava
from workers.kv_cache import KVCache, KVCacheSpec
from workers.layers.attention import AttentionMetadata, select_backend
from workers.loader import iterate_weights, load_model
from workers.models.image_splice import ImageSplice
from workers.models.llava import LlavaForConditionalGeneration
from workers.models.vision_family import config_image_token_id
from workers.parallel import init_tensor_parallel, reset_tensor_parallel

PROMPT = "USER: <image> and <image>, compare. ASSISTANT:"
SEEDS = (11, 12)


@pytest.fixture(scope="module")
def llava(tmp_path_factory, smollm2_tokenizer):
    """(checkpoint dir, HF model, the prompt's HF inputs)."""
    from transformers import LlavaForConditionalGeneration as HFLlava

    path = str(tmp_path_factory.mktemp("tiny-llava-model"))
    write_tiny_llava(path, smollm2_tokenizer)
    hf = HFLlava.from_pretrained(path, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(path)
    inputs = processor(text=PROMPT, images=[random_image(s) for s in SEEDS], return_tensors="pt")
    return path, hf, inputs


def load(path: str) -> LlavaForConditionalGeneration:
    model = load_model(path, AutoConfig.from_pretrained(path), torch.float32, torch.device("cpu"))
    assert isinstance(model, LlavaForConditionalGeneration)
    return model


def spliced_logits(path: str, input_ids: list[int], pixels: torch.Tensor) -> torch.Tensor | None:
    """One prefill of the prompt with both images encoded and spliced at their placeholders."""
    model = load(path)
    layers = model.attention_layers()
    cache = KVCache(KVCacheSpec.of(layers, 4, torch.float32), 32, 0, torch.device("cpu"))
    cache.bind(layers)
    backend = select_backend(torch.device("cpu"), "torch")
    for layer in layers:
        layer.backend = backend
    placeholder = config_image_token_id(AutoConfig.from_pretrained(path))
    rows = [i for i, t in enumerate(input_ids) if t == placeholder]
    with torch.inference_mode():
        embeds = torch.cat([model.encode_image({"pixel_values": p[None]}) for p in pixels])
        model.image_splice.set(torch.tensor(rows), embeds)
        n = len(input_ids)
        meta, positions = AttentionMetadata.build([0], [n], [list(range(-(-n // 4)))], 4, "cpu")
        backend.prepare(meta)
        hidden = model(torch.tensor(input_ids), positions, meta)
        assert model.image_splice.rows is None  # spent by the forward
        return model.compute_logits(hidden)


def test_the_tower_and_projector_give_transformers_image_features(llava):
    path, hf, inputs = llava
    model = load(path)
    with torch.no_grad():
        expected = hf.model.get_image_features(
            pixel_values=inputs["pixel_values"],
            vision_feature_layer=hf.config.vision_feature_layer,
            vision_feature_select_strategy=hf.config.vision_feature_select_strategy,
        )
        expected = expected.pooler_output if hasattr(expected, "pooler_output") else expected
        ours = [model.encode_image({"pixel_values": p[None]}) for p in inputs["pixel_values"]]
    for mine, theirs in zip(ours, expected):
        assert mine.shape == (4, 64)
        torch.testing.assert_close(mine, theirs.reshape(mine.shape), atol=1e-5, rtol=1e-5)


def test_the_spliced_prompt_gives_transformers_logits(llava):
    path, hf, inputs = llava
    with torch.no_grad():
        expected = hf(**inputs).logits[0]
    ids = inputs["input_ids"][0].tolist()
    got = spliced_logits(path, ids, inputs["pixel_values"])
    assert got is not None
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def tp_spliced_logits(rank: int, world: int, path: str, ids: list[int], pixels) -> object:
    """A gloo_ranks job: the spliced prefill on this rank (the tower runs whole on each)."""
    init_tensor_parallel(rank, world, dist.group.WORLD)
    logits = spliced_logits(path, ids, pixels)
    return logits if rank == 0 else None


@pytest.mark.slow
def test_two_tensor_parallel_ranks_with_a_replicated_tower_match_one(llava, gloo_ranks):
    path, _, inputs = llava
    ids, pixels = inputs["input_ids"][0].tolist(), inputs["pixel_values"]
    two = gloo_ranks(2).run(tp_spliced_logits, path, ids, pixels)
    reset_tensor_parallel()
    torch.testing.assert_close(two, spliced_logits(path, ids, pixels), atol=1e-4, rtol=1e-4)


def test_the_transformers_5_layout_loads_the_same_weights(llava):
    """Checkpoints name tensors `language_model.model.*` (llava-hf) or `model.language_model.*`
    (transformers 5 in memory); both load into the same parameters."""
    path, hf, _ = llava
    config = AutoConfig.from_pretrained(path)
    from_disk, from_memory = (LlavaForConditionalGeneration(config) for _ in range(2))
    from_disk.check_loaded(from_disk.load_weights(iterate_weights(path, progress=False)))
    from_memory.check_loaded(from_memory.load_weights(hf.state_dict().items()))
    disk, memory = from_disk.state_dict(), from_memory.state_dict()
    assert disk.keys() == memory.keys()
    for name, tensor in disk.items():
        torch.testing.assert_close(tensor, memory[name], msg=name)


def test_token_counts_follow_the_feature_strategy(llava):
    path, _, _ = llava
    config = AutoConfig.from_pretrained(path)
    arrays = {"pixel_values": np.zeros((1, 3, 28, 28), np.float32)}
    assert LlavaForConditionalGeneration.num_image_tokens(config, arrays) == 4
    full = LlavaConfig.from_dict({**config.to_dict(), "vision_feature_select_strategy": "full"})
    assert LlavaForConditionalGeneration.num_image_tokens(full, arrays) == 5
    model = LlavaForConditionalGeneration(full)
    assert model.encode_image({"pixel_values": torch.zeros(1, 3, 28, 28)}).shape == (5, 64)
    with pytest.raises(ValueError, match="pixel_values"):
        LlavaForConditionalGeneration.num_image_tokens(config, {"pixel_values": np.zeros((3, 28))})


def test_bad_configs_and_splices_are_refused(llava):
    path, _, _ = llava
    config = AutoConfig.from_pretrained(path)
    deep = LlavaConfig.from_dict({**config.to_dict(), "vision_feature_layer": -9})
    with pytest.raises(ValueError, match="vision_feature_layer"):
        LlavaForConditionalGeneration(deep)
    with pytest.raises(ValueError, match="2 rows for 3 image embeddings"):
        ImageSplice().set(torch.tensor([0, 1]), torch.zeros(3, 8))


def test_the_preprocessor_expands_each_placeholder_to_the_image_tokens(llava):
    from scheduler.request import EngineRequest

    path, _, inputs = llava
    pre = ImagePreprocessor.load(path)
    assert pre is not None
    ids = [5, pre.placeholder, 6, pre.placeholder]
    images = (random_image(SEEDS[0]), random_image(SEEDS[1]))
    out = pre.expand(EngineRequest("r", ids, images=images))
    assert out.images == () and out.mm_inputs is not None
    assert out.prompt_token_ids == [5, *[pre.placeholder] * 4, 6, *[pre.placeholder] * 4]
    spans = out.mm_inputs.spans
    assert [(s.offset, s.length) for s in spans] == [(1, 4), (6, 4)]
    pixels = dict(out.mm_inputs.images[0].arrays)["pixel_values"]
    assert pixels.shape == (1, 3, 28, 28)
    got = np.frombuffer(pixels.data, np.float32).reshape(pixels.shape)
    np.testing.assert_allclose(got[0], inputs["pixel_values"][0].numpy(), atol=1e-6)
    again = pre.expand(EngineRequest("s", ids, images=images))
    assert again.mm_inputs is not None and again.mm_inputs.spans == spans  # digest: pixels alone


def test_an_image_the_tower_cannot_take_fails_its_request_alone(llava):
    """Pixels of the wrong size (56 px for a 28 px tower) fail that request in the step's
    output; the other request's image is spliced as ever."""
    from engine.multimodal import pack
    from scheduler.multimodal import ImageInput, ImageSpan, MultiModalInputs
    from scheduler.outputs import ModelRunnerOutput, NewRequestData
    from scheduler.sampling_params import SamplingParams
    from workers.features.base import RunnerContext
    from workers.features.vision import VisionFeature
    from workers.runner_config import RunnerConfig
    from workers.step_state import Batch

    path, _, inputs = llava
    model = load(path)
    cpu = torch.device("cpu")
    config = RunnerConfig(
        model_dir=path,
        dtype="float32",
        device="cpu",
        block_size=16,
        max_model_len=256,
        max_num_batched_tokens=256,
        max_num_seqs=4,
        seed=0,
        attention_backend="torch",
        kv_cache_memory_gb=0.1,
        gpu_memory_utilization=0.9,
        load_progress=False,
    )
    feature = VisionFeature(RunnerContext(config, model, None, cpu, torch.float32, True, {}))  # type: ignore[arg-type]
    arrays = {
        "good": pack(inputs["pixel_values"][:1].numpy()),
        "bad": pack(np.zeros((1, 3, 56, 56), np.float32)),
    }
    for i, (rid, pixels) in enumerate(arrays.items()):
        image = ImageInput(ImageSpan(1, 4, f"{i:064x}"), (("pixel_values", pixels),))
        new = NewRequestData(rid, [5] * 6, SamplingParams(), [], 0)
        new.mm_inputs = MultiModalInputs((image,))
        feature.start(new, None)  # type: ignore[arg-type]
    batch = Batch(req_ids=["good", "bad"], input_ids=[5] * 12, starts=[0, 0], query_lens=[6, 6])
    assert feature.prepare(batch) is True
    assert model.image_splice.rows is not None
    assert model.image_splice.rows.tolist() == [1, 2, 3, 4]  # the good request's rows alone
    output = ModelRunnerOutput(["good", "bad"], [[], []])
    feature.proposed(batch, output)
    assert list(output.failed) == ["bad"] and output.failed["bad"].startswith("images: ")


def test_a_siglip_tower_gives_transformers_features_logits_and_token_counts(
    tmp_path, smollm2_tokenizer
):
    """SigLIP (no class token, a biased patch convolution, no pre-norm; every row kept): the
    engine's expansion equals LlavaProcessor's, the tower's rows and the spliced prompt's logits
    equal transformers'."""
    from transformers import LlavaForConditionalGeneration as HFLlava

    from scheduler.request import EngineRequest

    path = str(tmp_path)
    write_tiny_llava(path, smollm2_tokenizer, tower="siglip")
    hf = HFLlava.from_pretrained(path, dtype=torch.float32).eval()
    images = [random_image(s) for s in SEEDS]
    inputs = AutoProcessor.from_pretrained(path)(text=PROMPT, images=images, return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    pre = ImagePreprocessor.load(path)
    assert pre is not None
    unexpanded = [t for i, t in enumerate(ids) if t != pre.placeholder or ids[i - 1] != t]
    expanded = pre.expand(EngineRequest("r", unexpanded, images=tuple(images)))
    assert expanded.prompt_token_ids == ids and ids.count(pre.placeholder) == 8
    model = load(path)
    with torch.no_grad():
        features = hf.model.get_image_features(
            pixel_values=inputs["pixel_values"],
            vision_feature_layer=hf.config.vision_feature_layer,
            vision_feature_select_strategy=hf.config.vision_feature_select_strategy,
        )
        features = features.pooler_output if hasattr(features, "pooler_output") else features
        ours = model.encode_image({"pixel_values": inputs["pixel_values"][:1]})
        expected = hf(**inputs).logits[0]
    torch.testing.assert_close(ours, features[0].reshape(ours.shape), atol=1e-5, rtol=1e-5)
    got = spliced_logits(path, ids, inputs["pixel_values"])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_the_encoder_cache_drops_the_least_recently_used_past_its_bytes():
    from workers.features.vision import EncoderCache

    cache = EncoderCache(max_bytes=3 * 64)  # three [4, 4] float32 entries
    rows = {k: torch.full((4, 4), float(i)) for i, k in enumerate("abcd")}
    for key in "abc":
        cache.put(key, rows[key])
    assert cache.get("a") is rows["a"]  # a is now the most recently used
    cache.put("d", rows["d"])  # b, the least recently used, goes
    assert cache.get("b") is None and cache.get("c") is rows["c"] and cache.get("d") is rows["d"]
    assert (cache.hits, cache.misses, cache.bytes) == (3, 1, 3 * 64)
    cache.put("big", torch.zeros(100))  # larger than the whole cache: not kept, nothing dropped
    assert cache.get("big") is None and len(cache.entries) == 3
    none = EncoderCache(max_bytes=0)  # encoder_cache_gb 0
    none.put("a", rows["a"])
    assert none.get("a") is None
