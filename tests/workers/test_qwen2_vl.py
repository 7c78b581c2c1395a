"""Qwen2.5-VL's parts equal transformers' on the same weights (qwen2_vl_checkpoint.py).

- M-RoPE: a prompt's 3-axis positions and delta are get_rope_index's for 0, 1 and 3 images of
  different grids; the rotation equals transformers' M-RoPE cos/sin applied to q and k, and a
  text-only position vector gives plain RoPE.
- The vision tower: two images of different sizes (one larger than a window) give
  `model.visual(pixel_values, grid_thw)`'s embeddings.
- The language model: the same inputs_embeds and 3-D position ids give transformers' logits, as
  one prefill and as two chunks then a decode step through the paged KV cache.
- The whole forward: token ids with image placeholders, the images encoded and spliced, give
  transformers' logits.
- Bad grids and mrope sections are refused, naming the field.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from transformers import AutoConfig

from engine.multimodal import pack
from scheduler import SamplingParams
from scheduler.multimodal import ImageInput, ImageSpan, MultiModalInputs
from scheduler.outputs import NewRequestData
from tests.workers.qwen2_vl_checkpoint import (
    IMAGE_TOKEN,
    VISION_END,
    VISION_START,
    write_tiny_qwen2_vl,
)
from workers.kv_cache import KVCache, KVCacheSpec
from workers.layers.attention import AttentionMetadata, select_backend
from workers.layers.mrope import (
    MRopePositions,
    MRopeSpan,
    MRotaryEmbedding,
    check_mrope_section,
    prompt_positions,
    step_positions,
)
from workers.layers.rotary import RotaryEmbedding
from workers.loader import load_model
from workers.models.qwen2_vl import Qwen2_5_VLForConditionalGeneration, merged_grid
from workers.models.qwen2_vl_vision import VisionArgs
from workers.models.vision_family import config_image_token_id
from workers.parallel import init_tensor_parallel, reset_tensor_parallel
from workers.step_state import Batch

BLOCK = 4
HUGE = [2**64, -1, float("nan"), 10**12]
# Patch grids (t, h, w): 4 tokens; 12 tokens over several 56-pixel windows; 6 tokens.
GRIDS = [(1, 4, 4), (1, 6, 8), (1, 4, 6)]


def load(path: str) -> Qwen2_5_VLForConditionalGeneration:
    """Our model of the checkpoint (this rank's shards), bound to a paged cache on the torch
    backend."""
    config = AutoConfig.from_pretrained(path)
    ours = load_model(path, config, torch.float32, torch.device("cpu"), progress=False)
    layers = ours.attention_layers()
    KVCache(KVCacheSpec.of(layers, BLOCK, torch.float32), 64, 0, torch.device("cpu")).bind(layers)
    backend = select_backend(torch.device("cpu"), "torch")
    for layer in layers:
        layer.backend = backend
    assert isinstance(ours, Qwen2_5_VLForConditionalGeneration)
    return ours


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(its directory, transformers' model of it)."""
    path = str(tmp_path_factory.mktemp("qwen2-vl"))
    return path, write_tiny_qwen2_vl(path)


@pytest.fixture(scope="module")
def models(checkpoint):
    """(transformers' model, ours) over one tiny random checkpoint."""
    path, hf = checkpoint
    return hf, load(path)


def prompt_with_images(grids: list[tuple[int, int, int]], seed: int = 0) -> list[int]:
    """Text, then per image vision_start, its merged-grid count of image tokens, vision_end."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 290, (5,), generator=gen).tolist()
    for t, h, w in grids:
        ids += [VISION_START] + [IMAGE_TOKEN] * (t * h * w // 4) + [VISION_END]
        ids += torch.randint(3, 290, (3,), generator=gen).tolist()
    return ids


def spans_of(ids: list[int], grids: list[tuple[int, int, int]]) -> list[MRopeSpan]:
    starts = [i for i, t in enumerate(ids) if t == IMAGE_TOKEN and ids[i - 1] != IMAGE_TOKEN]
    return [MRopeSpan(s, t, h // 2, w // 2) for s, (t, h, w) in zip(starts, grids)]


def hf_positions(hf, ids: list[int], grids) -> tuple[torch.Tensor, int]:
    input_ids = torch.tensor([ids])
    pos, delta = hf.model.get_rope_index(
        input_ids,
        mm_token_type_ids=(input_ids == IMAGE_TOKEN).int(),
        image_grid_thw=torch.tensor(grids) if grids else None,
    )
    return pos[:, 0], int(delta)


@pytest.mark.parametrize("num_images", [0, 1, 3])
def test_prompt_positions_are_get_rope_index(models, num_images):
    hf, _ = models
    grids = GRIDS[:num_images]
    ids = prompt_with_images(grids)
    ours, delta = prompt_positions(len(ids), spans_of(ids, grids))
    expected, expected_delta = hf_positions(hf, ids, grids) if grids else (None, 0)
    if expected is None:  # text alone: get_rope_index's text layout, delta 0
        expected = torch.arange(len(ids)).expand(3, -1)
    assert torch.equal(ours, expected)
    assert delta == expected_delta
    assert (num_images == 0) == (delta == 0)
    # a request's later tokens: the prompt's own positions, then index + delta on every axis
    assert torch.equal(step_positions(ours, delta, 1, 3), ours[:, 1:4])  # a chunk of the prompt
    steps = step_positions(ours, delta, len(ids) - 2, 4)
    assert torch.equal(steps[:, :2], ours[:, -2:])
    assert torch.equal(steps[:, 2:], torch.tensor([len(ids), len(ids) + 1]).expand(3, -1) + delta)


def test_mrope_equals_transformers_rotation():
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VLRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    config = AutoConfig.for_model("qwen2_5_vl_text", hidden_size=64, num_attention_heads=4)
    config.rope_parameters = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}
    theirs = Qwen2_5_VLRotaryEmbedding(config)
    ours = MRotaryEmbedding(16, 512, config.rope_parameters, [2, 3, 3])
    gen = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 512, (3, 20), generator=gen)
    q, k = torch.randn(20, 4, 16, generator=gen), torch.randn(20, 2, 16, generator=gen)
    cos, sin = theirs(q, positions[:, None, :])
    eq, ek = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    rq, rk = ours(positions, q, k)
    torch.testing.assert_close(rq, eq[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rk, ek[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    # text: equal axes as [3, T] or as [T] are plain RoPE
    plain = RotaryEmbedding(16, 512, config.rope_parameters)
    text = positions[0]
    expected = plain(text, q.clone(), k.clone())  # (a fused kernel may rotate in place)
    for axes in (text, text.expand(3, -1)):
        for a, b in zip(ours(axes, q.clone(), k.clone()), expected):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_vision_tower_equals_transformers(models):
    hf, ours = models
    grid = torch.tensor([[1, 8, 12], [1, 4, 4]])  # 6 windows of 2x2 groups (padded), then one
    gen = torch.Generator().manual_seed(1)
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14, generator=gen)
    with torch.inference_mode():
        expected = hf.model.visual(pixels, grid_thw=grid).pooler_output
        got = ours.encode_images(pixels, grid)
    assert got.shape == (24 + 4, 64)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def run(ours, chunks, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
    """Our logits of one request run in chunks [(start, n)] on blocks 0.., every row's."""
    out = []
    table = [list(range(-(-embeds.shape[0] // BLOCK)))]
    for start, n in chunks:
        meta, _ = AttentionMetadata.build([start], [n], table, BLOCK, torch.device("cpu"))
        ours.attention_layers()[0].backend.prepare(meta)
        ids = torch.zeros(n, dtype=torch.long)
        rows = slice(start, start + n)
        hidden = ours(ids, positions[:, rows], meta, inputs_embeds=embeds[rows])
        out.append(ours.compute_logits(hidden))
    return None if out[0] is None else torch.cat(out)  # None: a rank that does not sample


def test_language_model_logits_equal_transformers(models):
    """Random embeddings at the 3-D positions of a prompt with two images: one prefill, and two
    chunks then a decode row, give transformers' logits for every row."""
    hf, ours = models
    grids = GRIDS[:2]
    ids = prompt_with_images(grids)
    embeds = torch.randn(len(ids), 64, generator=torch.Generator().manual_seed(2))
    positions, _ = hf_positions(hf, ids, grids)
    with torch.inference_mode():
        lm = hf.model.language_model(inputs_embeds=embeds[None], position_ids=positions[:, None])
        expected = hf.lm_head(lm.last_hidden_state)[0]
        whole = run(ours, [(0, len(ids))], embeds, positions)
        cut, last = len(ids) // 2, len(ids) - 1
        chunked = run(ours, [(0, cut), (cut, last - cut), (last, 1)], embeds, positions)
    torch.testing.assert_close(whole, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(chunked, expected, rtol=1e-4, atol=1e-4)


def spliced_logits(ours, ids: list[int], pixels: torch.Tensor, grid: torch.Tensor):
    """Our logits of a prompt: the placeholders' embeddings replaced by the encoded images, at
    the prompt's 3-axis positions, one prefill."""
    input_ids = torch.tensor(ids)
    with torch.inference_mode():
        embeds = ours.model.embed_tokens(input_ids)
        embeds[input_ids == IMAGE_TOKEN] = ours.encode_images(pixels, grid)
        positions, _ = prompt_positions(len(ids), spans_of(ids, grid.tolist()))
        return run(ours, [(0, len(ids))], embeds, positions)


def whole_inputs() -> tuple[list[int], torch.Tensor, torch.Tensor]:
    ids = prompt_with_images(GRIDS)
    grid = torch.tensor(GRIDS)
    gen = torch.Generator().manual_seed(3)
    return ids, torch.randn(int(grid.prod(-1).sum()), 1176, generator=gen), grid


def test_whole_forward_equals_transformers(models):
    """Placeholders in the ids, the images through our tower, spliced: transformers' logits."""
    hf, ours = models
    ids, pixels, grid = whole_inputs()
    input_ids = torch.tensor(ids)
    with torch.inference_mode():
        expected = hf(
            input_ids=input_ids[None],
            pixel_values=pixels,
            image_grid_thw=grid,
            mm_token_type_ids=(input_ids == IMAGE_TOKEN).int()[None],
        ).logits[0]
    torch.testing.assert_close(
        spliced_logits(ours, ids, pixels, grid), expected, rtol=1e-4, atol=1e-4
    )


def tp_logits(rank: int, world: int, path: str) -> torch.Tensor | None:
    """A gloo_ranks job: the whole forward on this rank's shards (tower and language model split
    by heads); rank 0's logits."""
    init_tensor_parallel(rank, world, dist.group.WORLD)
    logits = spliced_logits(load(path), *whole_inputs())
    return logits if rank == 0 else None


@pytest.mark.slow
def test_two_ranks_match_one(checkpoint, models, gloo_ranks):
    """The vision tower's and the language model's linears split over two ranks: the same
    logits as one rank."""
    path, _ = checkpoint
    _, ours = models
    two = gloo_ranks(2).run(tp_logits, path)
    reset_tensor_parallel()
    torch.testing.assert_close(two, spliced_logits(ours, *whole_inputs()), rtol=1e-4, atol=1e-4)


def inputs(offset: int, length: int, grid: list[int], rows: int | None = None) -> MultiModalInputs:
    """One image's MultiModalInputs as the engine sends them (its arrays packed); `rows`
    pixel rows (default: the grid's patches)."""
    span = ImageSpan(offset, length, "ab" * 32)
    pixels = np.zeros((int(np.prod(grid)) if rows is None else rows, 1176), dtype=np.float32)
    arrays = (("pixel_values", pack(pixels)), ("image_grid_thw", pack(np.array([grid]))))
    return MultiModalInputs((ImageInput(span, arrays),))


def test_image_tokens_and_spans_from_processor_arrays(models):
    _, ours = models
    config = AutoConfig.for_model("qwen2_5_vl")
    arrays = {"image_grid_thw": np.array([[1, 6, 8]])}
    assert Qwen2_5_VLForConditionalGeneration.num_image_tokens(config, arrays) == 12
    assert config_image_token_id(config) == config.image_token_id
    assert ours.mrope_spans(inputs(7, 12, [1, 6, 8])) == [MRopeSpan(7, 1, 3, 4)]
    with pytest.raises(ValueError, match="images: an image of 11 tokens has a 1x3x4 grid"):
        ours.mrope_spans(inputs(7, 11, [1, 6, 8]))
    with pytest.raises(ValueError, match=r"pixel_values of shape \(47, 1176\)"):
        ours.mrope_spans(inputs(7, 12, [1, 6, 8], rows=47))


@pytest.mark.parametrize("bad", [*HUGE, 3, "4"])
def test_bad_image_grid_is_refused(bad):
    with pytest.raises(ValueError, match="image_grid_thw"):
        merged_grid({"image_grid_thw": np.array([[1, bad, 8]])}, 2)
    with pytest.raises(ValueError, match="image_grid_thw"):
        merged_grid({"pixel_values": np.zeros((4, 1176))}, 2)


@pytest.mark.parametrize("bad", HUGE)
def test_bad_mrope_values_are_refused(bad):
    with pytest.raises(ValueError, match="rope_parameters.mrope_section"):
        check_mrope_section([2, bad, 3], 16)
    with pytest.raises(ValueError, match="MRopeSpan.h"):
        MRopeSpan(0, 1, bad, 2)
    with pytest.raises(ValueError, match="rope_parameters.mrope_section"):
        check_mrope_section([2, 3, 4], 16)  # 9 pairs for a head of 8


def test_image_past_the_prompt_is_refused():
    with pytest.raises(ValueError, match="MRopeSpan"):
        prompt_positions(10, [MRopeSpan(8, 1, 2, 2)])
    with pytest.raises(ValueError, match="MRopeSpan"):
        prompt_positions(20, [MRopeSpan(2, 1, 2, 2), MRopeSpan(4, 1, 2, 2)])


def test_step_positions_of_a_mixed_batch():
    """A decode of a request with an image (index + delta), a text prefill chunk (plain) and a
    chunk over the image: one [3, T] set by prepare and read once; text alone sets nothing."""
    grid = [1, 4, 6]  # 6 tokens, 2 x 3: delta 3 - 6 = -3
    positions = MRopePositions(lambda mm: [MRopeSpan(2, 1, 2, 3)])
    ids = [5, 6] + [IMAGE_TOKEN] * 6 + [7]
    params = SamplingParams(max_tokens=4)
    for rid, mm in (("img", inputs(2, 6, grid)), ("text", None), ("img2", inputs(2, 6, grid))):
        positions.start(NewRequestData(rid, ids, params, [], 0, mm_inputs=mm))
    batch = Batch(req_ids=["img", "text", "img2"], starts=[10, 4, 1], query_lens=[1, 2, 4])
    assert positions.prepare(batch)
    got = positions.take(torch.arange(7))
    # token 1 (text), then the grid's first row from position 2: (t, h, w) = (2, 2, 2..4)
    img_rows = torch.tensor([[1, 2, 2, 2], [1, 2, 2, 2], [1, 2, 3, 4]])
    decode, text = torch.full((3, 1), 10 - 3), torch.tensor([4, 5]).expand(3, 2)
    expected = torch.cat([decode, text, img_rows], 1)
    assert torch.equal(got, expected)
    runner = torch.arange(2)
    assert positions.take(runner) is runner  # read once
    positions.finish("img")
    positions.finish("img2")
    assert not positions.prepare(Batch(req_ids=["text"], starts=[5], query_lens=[1]))
    assert positions.take(runner) is runner


@pytest.mark.parametrize("bad", [*HUGE, 1.5, "8"])
@pytest.mark.parametrize(
    "field", ["window_size", "depth", "spatial_merge_size", "patch_size", "fullatt_block_indexes"]
)
def test_bad_vision_config_is_refused(field, bad):
    """Every integer the tower reads from its config is bounded before anything is built
    (whatever transformers' own config checks let through: a namespace stands in for it)."""
    from types import SimpleNamespace

    from transformers import Qwen2_5_VLConfig

    from tests.workers.qwen2_vl_checkpoint import TINY_QWEN2_VL

    fields = Qwen2_5_VLConfig(**TINY_QWEN2_VL).vision_config.to_dict()
    fields[field] = [1, bad] if field == "fullatt_block_indexes" else bad
    with pytest.raises(ValueError, match=f"vision_config.{field}"):
        VisionArgs.from_hf_config(SimpleNamespace(**fields))  # type: ignore[arg-type]
