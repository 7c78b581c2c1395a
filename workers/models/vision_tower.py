"""CLIP's and SigLIP's vision transformers (LLaVA's towers), run replicated on every
tensor-parallel rank.

Patches of the image are embedded by one convolution, learned positions are added (CLIP also
prepends a class token and normalises before the layers; SigLIP's convolution has a bias), and
pre-norm encoder layers follow (bidirectional attention over the image's patches). The tower
returns the hidden states of the layers a LLaVA model selects (`vision_feature_layer`), so layers
past the deepest selected one are never built and their checkpoint tensors are skipped (with the
final norm and SigLIP's pooling head). Parameter names follow transformers' `CLIPVisionTransformer`
and `SiglipVisionTransformer`, so checkpoints load by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

# transformers' model_type of each tower -> whether it has CLIP's class token (and pre-norm).
TOWERS = {"clip_vision_model": True, "siglip_vision_model": False}


def has_class_token(c: PretrainedConfig) -> bool:
    """Whether the tower of vision config c prepends a class token (ValueError for a tower
    raylm does not run)."""
    if c.model_type not in TOWERS:
        raise ValueError(
            f"vision_config.model_type: {c.model_type!r} is not supported (supported: "
            f"{sorted(TOWERS)})"
        )
    return TOWERS[c.model_type]


class PatchEmbeddings(nn.Module):
    def __init__(self, c: PretrainedConfig) -> None:
        super().__init__()
        self.cls = has_class_token(c)
        if self.cls:
            self.class_embedding = nn.Parameter(torch.empty(c.hidden_size))
        self.patch_embedding = nn.Conv2d(
            c.num_channels, c.hidden_size, c.patch_size, c.patch_size, bias=not self.cls
        )
        num_positions = (c.image_size // c.patch_size) ** 2 + int(self.cls)
        self.position_embedding = nn.Embedding(num_positions, c.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[images, channels, H, W] -> [images, (1 +) patches, hidden]."""
        dtype = self.patch_embedding.weight.dtype
        x = self.patch_embedding(pixels.to(dtype)).flatten(2).transpose(1, 2)
        if self.cls:
            x = torch.cat([self.class_embedding.expand(pixels.shape[0], 1, -1), x], dim=1)
        if x.shape[1] != self.position_embedding.num_embeddings:
            extra = int(self.cls)
            raise ValueError(
                f"images: pixel_values of {tuple(pixels.shape[2:])} give {x.shape[1] - extra} "
                f"patches, the tower has positions for "
                f"{self.position_embedding.num_embeddings - extra}"
            )
        return x + self.position_embedding.weight


class ClipAttention(nn.Module):
    def __init__(self, c: PretrainedConfig) -> None:
        super().__init__()
        self.num_heads = c.num_attention_heads
        self.q_proj = nn.Linear(c.hidden_size, c.hidden_size)
        self.k_proj = nn.Linear(c.hidden_size, c.hidden_size)
        self.v_proj = nn.Linear(c.hidden_size, c.hidden_size)
        self.out_proj = nn.Linear(c.hidden_size, c.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.num_heads, -1).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch
        return self.out_proj(out.transpose(1, 2).reshape(b, t, d))


class ClipMLP(nn.Module):
    def __init__(self, c: PretrainedConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(c.hidden_size, c.intermediate_size)
        self.fc2 = nn.Linear(c.intermediate_size, c.hidden_size)
        self.act = ACT2FN[c.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ClipEncoderLayer(nn.Module):
    def __init__(self, c: PretrainedConfig) -> None:
        super().__init__()
        self.self_attn = ClipAttention(c)
        self.layer_norm1 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.mlp = ClipMLP(c)
        self.layer_norm2 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ClipEncoder(nn.Module):
    def __init__(self, c: PretrainedConfig, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ClipEncoderLayer(c) for _ in range(num_layers))


class VisionTower(nn.Module):
    """CLIP's or SigLIP's vision transformer up to the deepest layer a LLaVA model reads.

    `feature_layers` index transformers' hidden states (0: the embeddings after the pre-norm, i:
    after layer i; negative from the end, -1 the last layer's output); `forward` returns those
    hidden states concatenated on the feature axis.
    """

    def __init__(self, c: PretrainedConfig, feature_layers: list[int]) -> None:
        super().__init__()
        total = c.num_hidden_layers
        self.feature_layers = [i if i >= 0 else total + 1 + i for i in feature_layers]
        if not all(0 <= i <= total for i in self.feature_layers):
            raise ValueError(
                f"vision_feature_layer: {feature_layers} outside the tower's {total} layers"
            )
        self.embeddings = PatchEmbeddings(c)
        # CLIP normalises the embeddings before the layers (its spelling); SigLIP does not.
        self.pre_layrnorm = (
            nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps) if self.embeddings.cls else None
        )
        self.encoder = ClipEncoder(c, max(self.feature_layers))

    @property
    def num_layers(self) -> int:
        return len(self.encoder.layers)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[images, channels, H, W] -> [images, tokens, hidden * len(feature_layers)]."""
        x = self.embeddings(pixels)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        states = [x]
        for layer in self.encoder.layers:
            x = layer(x)
            states.append(x)
        return torch.cat([states[i] for i in self.feature_layers], dim=-1)
