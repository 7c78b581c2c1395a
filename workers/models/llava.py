"""LLaVA (`LlavaForConditionalGeneration`): a CLIP or SigLIP vision tower, a two-layer projector
and the Llama language model raylm already runs.

An image becomes one embedding row per patch (the CLS row dropped under the "default" feature
strategy); the runner's vision feature (workers/features/vision.py) encodes it with
`encode_image` and splices the rows over the prompt's image tokens through `image_splice`. The
language model is `LlamaForCausalLM` itself, sharded as ever; the tower and the projector are
small and run replicated on every tensor-parallel rank (each rank splices the same full-width
rows into its full-width input embeddings).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from workers.layers.quantized import AnyWeight, float_only
from workers.models.image_splice import ImageSplice
from workers.models.llama import LlamaForCausalLM, _copy_plain
from workers.models.vision_family import refuse_pipeline_stages
from workers.models.vision_tower import VisionTower, has_class_token

# Checkpoint prefixes, old (llava-hf) and new (transformers 5) layouts, to ours.
_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)
_STRATEGIES = ("default", "full")


class LlavaProjector(nn.Module):
    """Vision features to the language model's width: linear, activation, linear."""

    def __init__(self, config: PretrainedConfig, vision_width: int) -> None:
        super().__init__()
        text_width = config.get_text_config().hidden_size
        bias = bool(getattr(config, "multimodal_projector_bias", True))
        self.linear_1 = nn.Linear(vision_width, text_width, bias=bias)
        self.act = ACT2FN[config.projector_hidden_act]
        self.linear_2 = nn.Linear(text_width, text_width, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """The Llama language model with a CLIP or SigLIP tower and a projector beside it."""

    def __init__(self, config: PretrainedConfig, max_model_len: int | None = None) -> None:
        super().__init__(config.get_text_config(), max_model_len)
        refuse_pipeline_stages("LLaVA")
        self.strategy = config.vision_feature_select_strategy
        if self.strategy not in _STRATEGIES:
            raise ValueError(
                f"vision_feature_select_strategy: must be one of {_STRATEGIES}, "
                f"got {self.strategy!r}"
            )
        layers = config.vision_feature_layer
        layers = [layers] if isinstance(layers, int) else list(layers)
        vision = config.vision_config
        self.vision_tower = VisionTower(vision, layers)
        self.multi_modal_projector = LlavaProjector(config, vision.hidden_size * len(layers))
        self.image_splice = ImageSplice()
        self.image_splice.attach(self.model.embed_tokens)

    # ---- what the engine asks of a vision family (engine/multimodal.VisionFamily) -------------
    @classmethod
    def num_image_tokens(cls, hf_config: PretrainedConfig, arrays: dict[str, np.ndarray]) -> int:
        pixels = arrays.get("pixel_values")
        if pixels is None or pixels.ndim != 4 or pixels.shape[0] != 1:
            shape = None if pixels is None else pixels.shape
            raise ValueError(
                f"images: expected pixel_values of one image [1, C, H, W], got {shape}"
            )
        vision = hf_config.vision_config
        patches = (pixels.shape[2] // vision.patch_size) * (pixels.shape[3] // vision.patch_size)
        # "default" drops the first row (CLIP's class token), as transformers does for any tower.
        dropped = 1 if hf_config.vision_feature_select_strategy == "default" else 0
        return patches + int(has_class_token(vision)) - dropped

    # ---- the runner's vision feature -----------------------------------------------------------
    def encode_image(self, arrays: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's [num_image_tokens, hidden] embeddings from its preprocessed arrays."""
        features = self.vision_tower(arrays["pixel_values"])
        if self.strategy == "default":
            features = features[:, 1:]  # the CLS row carries no patch
        return self.multi_modal_projector(features)[0]

    # ---- weights -------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, AnyWeight]]) -> set[str]:
        """The language model's tensors through Llama's loader (fused, sharded); the tower's and
        the projector's copied whole (replicated, and their q/k/v stay apart)."""
        return load_beside_text(
            self,
            self._ours(weights),
            ("vision_tower.", "multi_modal_projector."),
            super().load_weights,
        )

    def _ours(self, weights: Iterable[tuple[str, AnyWeight]]) -> Iterator[tuple[str, AnyWeight]]:
        """Checkpoint names in our layout; the tower's unused layers and final norm skipped."""
        kept = self.vision_tower.num_layers
        for name, tensor in renamed(weights, _RENAMES):
            if name.startswith(("vision_tower.post_layernorm.", "vision_tower.head.")):
                continue  # after the layers a LLaVA model reads
            layer = name.startswith("vision_tower.encoder.layers.")
            if layer and int(name.split(".")[3]) >= kept:
                continue
            yield name, tensor


def renamed(
    weights: Iterable[tuple[str, AnyWeight]], renames: tuple[tuple[str, str], ...]
) -> Iterator[tuple[str, AnyWeight]]:
    """Checkpoint names with each matching prefix replaced, in order (a name may need two)."""
    for name, tensor in weights:
        for old, new in renames:
            if name.startswith(old):
                name = new + name[len(old) :]
        yield name, tensor


def load_beside_text(
    model: nn.Module,
    weights: Iterable[tuple[str, AnyWeight]],
    whole: tuple[str, ...],
    load_text: Callable[[Iterable[tuple[str, AnyWeight]]], set[str]],
) -> set[str]:
    """Tensors named under `whole` (a tower, a projector) copied whole into model's parameters
    (replicated on every rank); the others through `load_text` (the language model's fused,
    sharded loader: `super().load_weights`). The names loaded."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()

    def text_weights() -> Iterator[tuple[str, AnyWeight]]:
        for name, tensor in weights:
            if not name.startswith(whole):
                yield name, tensor
            elif name not in params:
                raise ValueError(f"weights: checkpoint tensor {name!r} has no parameter")
            else:
                _copy_plain(params[name], float_only(tensor, name), name)
                loaded.add(name)

    return load_text(text_weights()) | loaded
