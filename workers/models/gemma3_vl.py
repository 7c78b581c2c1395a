"""Gemma 3 with images (`Gemma3ForConditionalGeneration`): a SigLIP tower, the multi-modal
projector and the Gemma 3 language model raylm already runs (workers/models/gemma.py).

An image is `image_size` pixels square (the processor resizes it; pan-and-scan crops are
refused). The tower's last hidden states (after its final LayerNorm) are average-pooled from the
patch grid to `mm_tokens_per_image` rows (256: 64x64 patches pooled 4x4), normalised (Gemma's
(1 + w) RMSNorm) and projected by one matrix to the language model's width. They replace the
`<image_soft_token>` rows *after* the embedding's sqrt(hidden) scale, as transformers does.

The prompt holds, per image, `\\n\\n<start_of_image><image_soft_token><end_of_image>\\n\\n` (the
sender writes one soft token, frontend/images.image_text; the engine repeats it once per
image row). Inside an otherwise causal prompt, the soft tokens of one image attend to each other
both ways: the forward hands each image's step range to the attention backends
(`AttentionMetadata.bidirectional`); the scheduler never cuts an image across chunks, so a range
always lies whole in one chunk (or is the tail of an image whose head came from the prefix
cache, already computed with the whole image in view). On sliding-window layers the window still
bounds how far back a token reaches (transformers: sliding AND (causal OR same image)).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from workers.layers.attention import AttentionMetadata
from workers.layers.quantized import AnyWeight
from workers.models.gemma import Gemma3ForCausalLM, GemmaModel, GemmaRMSNorm
from workers.models.image_splice import ImageSplice
from workers.models.llava import load_beside_text, renamed
from workers.models.vision_family import config_image_token_id, refuse_pipeline_stages
from workers.models.vision_tower import VisionTower
from workers.pipeline import run_stage

# Checkpoint prefixes, transformers 5's layout and the hub's older one, to ours.
_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("vision_tower.post_layernorm.", "vision_post_layernorm."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)
_WHOLE = ("vision_tower.", "vision_post_layernorm.", "multi_modal_projector.")
MAX_IMAGE_TOKENS = 4096  # mm_tokens_per_image (Gemma 3 ships 256)


def pooling(config: PretrainedConfig) -> tuple[int, int]:
    """(patches per side, pooling kernel) of a Gemma 3 config; ValueError naming the field that
    does not make a square grid pooled evenly to mm_tokens_per_image."""
    v = config.vision_config
    if v.model_type != "siglip_vision_model":
        raise ValueError(f"vision_config.model_type: Gemma 3 needs SigLIP, got {v.model_type!r}")
    size, patch = v.image_size, v.patch_size
    if not all(isinstance(x, int) and 1 <= x <= 65536 for x in (size, patch)) or size % patch:
        raise ValueError(
            f"vision_config.image_size: must be a multiple of patch_size in [1, 65536], "
            f"got {size!r} and {patch!r}"
        )
    tokens = config.mm_tokens_per_image
    ok = (
        isinstance(tokens, int) and not isinstance(tokens, bool) and 1 <= tokens <= MAX_IMAGE_TOKENS
    )
    side = math.isqrt(tokens) if ok else 0
    if not ok or side * side != tokens or (size // patch) % side:
        raise ValueError(
            f"mm_tokens_per_image: must be a square in [1, {MAX_IMAGE_TOKENS}] whose side divides "
            f"the {size // patch} patches per side, got {tokens!r}"
        )
    return size // patch, size // patch // side


class Gemma3Projector(nn.Module):
    """The tower's patch grid average-pooled to mm_tokens_per_image rows, RMS-normalised and
    projected to the language model's width (transformers' Gemma3MultiModalProjector)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        v, t = config.vision_config, config.get_text_config()
        self.side, self.kernel = pooling(config)
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(v.hidden_size, t.hidden_size), requires_grad=False
        )
        self.mm_soft_emb_norm = GemmaRMSNorm(v.hidden_size, v.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[images, patches, vision hidden] -> [images, tokens, text hidden]."""
        b, _, h = x.shape
        grid = x.transpose(1, 2).reshape(b, h, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).to(
            x.dtype
        )


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The Gemma 3 language model over `text_config`, a SigLIP tower and the projector beside it
    (both replicated on every tensor-parallel rank, as LLaVA's)."""

    images_attend_both_ways = True  # the vision feature refuses settings that cannot at start

    def __init__(self, config: PretrainedConfig, max_model_len: int | None = None) -> None:
        super().__init__(config.get_text_config(), max_model_len)
        refuse_pipeline_stages("Gemma 3")
        vision = config.vision_config
        self.multi_modal_projector = Gemma3Projector(config)  # checks the tower's shape first
        self.vision_tower = VisionTower(vision, [-1])
        self.vision_post_layernorm = nn.LayerNorm(vision.hidden_size, eps=vision.layer_norm_eps)
        # `<image_soft_token>`: the sender writes one per image, the engine repeats it.
        self.image_token = config_image_token_id(config)
        # Spliced after the embedding's scale (not a hook on embed_tokens, which runs before it).
        self.image_splice = ImageSplice()

    # ---- what the engine asks of a vision family (engine/multimodal.VisionFamily) -------------
    @classmethod
    def num_image_tokens(cls, hf_config: PretrainedConfig, arrays: dict[str, np.ndarray]) -> int:
        pixels = arrays.get("pixel_values")
        size = hf_config.vision_config.image_size
        if pixels is None or pixels.shape[0:1] != (1,) or pixels.shape[2:] != (size, size):
            shape = None if pixels is None else pixels.shape
            raise ValueError(
                f"images: expected pixel_values of one {size}x{size} image, got {shape} "
                "(pan-and-scan crops are not supported)"
            )
        return int(hf_config.mm_tokens_per_image)

    # ---- the runner's vision feature -----------------------------------------------------------
    def encode_image(self, arrays: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's [mm_tokens_per_image, hidden] embeddings from its preprocessed arrays."""
        states = self.vision_post_layernorm(self.vision_tower(arrays["pixel_values"]))
        return self.multi_modal_projector(states)[0]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        # Read before the embedding applies (and clears) the splice.
        meta.bidirectional = list(self.image_splice.spans)
        m = self.model
        return run_stage(m.layers, self._embed, m.norm, input_ids, positions, meta)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.image_token >= self.args.vocab_size:  # out of the table: any row, then spliced
            input_ids = input_ids.masked_fill(input_ids == self.image_token, 0)
        return self.image_splice.apply(cast(GemmaModel, self.model).embed(input_ids))

    # ---- weights -------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, AnyWeight]]) -> set[str]:
        """The language model's tensors through Gemma's loader; the tower's, its final norm's
        and the projector's copied whole."""
        return load_beside_text(self, self._ours(weights), _WHOLE, super().load_weights)

    def _ours(self, weights: Iterable[tuple[str, AnyWeight]]) -> Iterator[tuple[str, AnyWeight]]:
        for name, tensor in renamed(weights, _RENAMES):
            if not name.startswith("vision_tower.head."):  # SigLIP's pooling head: unused
                yield name, tensor
