"""Qwen2.5-VL: the vision tower (workers/models/qwen2_vl_vision.py) and a Qwen2 language model
whose rotary turns with three position axes (M-RoPE, workers/layers/mrope.py).

The language model is Qwen2's (qkv bias, untied or tied head) with one change: its decoder layers
share an MRotaryEmbedding instead of a RotaryEmbedding. Image tokens enter as the tower's output
spliced over the `<|image_pad|>` placeholders; their positions follow the image's merged patch
grid, and the text after an image continues from the image's start + max(rows, columns).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from transformers import PretrainedConfig

from scheduler.multimodal import MultiModalInputs, PackedArray
from workers.layers.attention import AttentionMetadata
from workers.layers.mrope import MAX_GRID_SIDE, MRopePositions, MRopeSpan, MRotaryEmbedding
from workers.layers.quantized import AnyWeight
from workers.models.image_splice import ImageSplice
from workers.models.llama import Qwen2ForCausalLM
from workers.models.qwen2_vl_vision import Qwen2_5_VisionTransformer
from workers.models.vision_family import refuse_pipeline_stages
from workers.pipeline import run_stage

# Checkpoint prefixes: the hub's layout (what transformers saves) and transformers' in-memory one.
_VISION_PREFIXES = ("visual.", "model.visual.")
_TEXT_PREFIX, _HUB_TEXT_PREFIX = "model.language_model.", "model."


class Qwen2_5_VLForConditionalGeneration(Qwen2ForCausalLM):
    """Qwen2.5-VL: Qwen2ForCausalLM over `text_config` with M-RoPE, plus the vision tower.

    The runner's vision feature (workers/features/vision.py) encodes images with `encode_image`,
    splices the rows through `image_splice` and sets a step's 3-axis positions through
    `step_positions`, which `forward` reads."""

    def __init__(self, config: PretrainedConfig, max_model_len: int | None = None) -> None:
        super().__init__(config.get_text_config(), max_model_len)
        refuse_pipeline_stages("Qwen2.5-VL")
        a = self.args
        section = a.rope_parameters.get("mrope_section")
        mrope = MRotaryEmbedding(a.head_dim, a.max_position, a.rope_parameters, section)
        # Qwen2's layers, built by LlamaModel with a plain rotary, share this one instead.
        for block in self.attention_blocks():
            block.rotary = mrope
        self.visual = Qwen2_5_VisionTransformer(config.vision_config)
        self.merge_size = config.vision_config.spatial_merge_size
        self.image_splice = ImageSplice()
        self.image_splice.attach(self.model.embed_tokens)
        self.step_positions = MRopePositions(self.mrope_spans)

    # ---- what the engine asks of a vision family (engine/multimodal.py VisionFamily) ----------
    @classmethod
    def num_image_tokens(cls, hf_config: PretrainedConfig, arrays: dict[str, np.ndarray]) -> int:
        """An image's tokens: its patch grid (image_grid_thw) merged 2x2."""
        t, h, w = merged_grid(arrays, hf_config.vision_config.spatial_merge_size)
        return t * h * w

    # ---- the runner's vision feature -----------------------------------------------------------
    def encode_image(self, arrays: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's [num_image_tokens, hidden] embeddings from its processor arrays."""
        grid = arrays["image_grid_thw"].view(1, 3)
        return self.encode_images(arrays["pixel_values"], grid)

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Images' embeddings, one row per image token, the images one after another."""
        return self.visual(pixel_values, grid_thw)

    def mrope_spans(self, inputs: MultiModalInputs) -> list[MRopeSpan]:
        """Where a request's images sit in the position grid. Read when the request starts, so
        an image whose arrays disagree (its span's length, its pixel rows, and its grid) fails
        that request alone (ValueError naming `images`), never a step's forward."""
        spans = []
        for image in inputs.images:
            arrays = dict(image.arrays)
            grid = {k: as_numpy(a) for k, a in arrays.items() if k == "image_grid_thw"}
            span = MRopeSpan(image.span.offset, *merged_grid(grid, self.merge_size))
            pixels = arrays.get("pixel_values")
            patches = (span.length * self.merge_size**2, self.visual.patch_width)
            shape = None if pixels is None else pixels.shape
            if span.length != image.span.length or shape != patches:
                raise ValueError(
                    f"images: an image of {image.span.length} tokens has a {span.t}x{span.h}x"
                    f"{span.w} grid and pixel_values of shape {shape} (expected {patches})"
                )
            spans.append(span)
        return spans

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """positions: [T] (text: the three axes equal) or [3, T], unless a step's were set on
        `step_positions`; inputs_embeds: [T, hidden] in place of the token embeddings."""
        positions = self.step_positions.take(positions)
        if inputs_embeds is None:
            return self.model(input_ids, positions, meta)
        m = self.model
        return run_stage(m.layers, lambda _: inputs_embeds, m.norm, input_ids, positions, meta)

    def load_weights(self, weights: Iterable[tuple[str, AnyWeight]]) -> set[str]:
        """The tower's tensors to the tower, the language model's (either layout) to Qwen2's
        loader; the names loaded."""
        vision: list[tuple[str, AnyWeight]] = []
        text: list[tuple[str, AnyWeight]] = []
        for name, tensor in weights:
            prefix = next((p for p in _VISION_PREFIXES if name.startswith(p)), None)
            if prefix is not None:
                vision.append((name[len(prefix) :], tensor))
            else:
                text.append((name.replace(_TEXT_PREFIX, _HUB_TEXT_PREFIX, 1), tensor))
        return super().load_weights(text) | {
            "visual." + n for n in self.visual.load_weights(vision)
        }


def as_numpy(array: PackedArray) -> np.ndarray:
    return np.frombuffer(array.data, dtype=array.dtype).reshape(array.shape)


def merged_grid(arrays: dict[str, np.ndarray], merge: int) -> tuple[int, int, int]:
    """An image's token grid (t, h / merge, w / merge) from its processor arrays' patch grid
    (`image_grid_thw`, one row)."""
    grid = np.asarray(arrays.get("image_grid_thw"))
    if grid.shape not in ((1, 3), (3,)) or grid.dtype.kind not in "iu":
        raise ValueError("images: image_grid_thw must be one integer (t, h, w) row per image")
    t, h, w = (int(v) for v in grid.reshape(3))
    if not all(1 <= v <= MAX_GRID_SIDE * merge for v in (t, h, w)) or h % merge or w % merge:
        raise ValueError(
            f"images: image_grid_thw must be in [1, {MAX_GRID_SIDE * merge}], h and w "
            f"multiples of {merge}, got {(t, h, w)}"
        )
    return t, h // merge, w // merge
