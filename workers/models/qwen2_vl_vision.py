"""The Qwen2.5-VL vision tower: pixels of any size in, one embedding per 2x2 patch group out.

The image processor cuts an image into 14x14 patches (two frames deep: a still image is repeated)
and orders them by 2x2 groups. The tower embeds each patch, runs pre-norm blocks whose attention
turns q and k with a 2-D rotary (the patch's row and column) and stays inside windows of
`window_size` pixels, except on the `fullatt_block_indexes` blocks, which see the whole image;
the merger then folds each 2x2 group into one vector of the language model's width. Every
linear is tensor-parallel like the language model's; every rank computes the whole output.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.vision_utils import (
    get_vision_cu_seqlens,
    get_vision_position_ids,
    get_vision_window_index,
)

from workers.layers.activation import SiluAndMul
from workers.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from workers.layers.norm import RMSNorm
from workers.layers.quantized import AnyWeight, float_only, load_param
from workers.layers.rotary import apply_rotary, rope_inv_freq


@dataclass(slots=True)
class VisionArgs:
    """The vision_config fields the tower reads."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    out_hidden_size: int
    fullatt_block_indexes: tuple[int, ...]
    rope_theta: float

    def __post_init__(self) -> None:
        for name, (low, high) in _LIMITS.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(
                    f"vision_config.{name}: must be an integer in [{low}, {high}], got {value!r}"
                )
        blocks = self.fullatt_block_indexes
        if not all(isinstance(i, int) and 0 <= i < self.depth for i in blocks):
            raise ValueError(
                f"vision_config.fullatt_block_indexes: block indexes below depth {self.depth}, "
                f"got {blocks!r}"
            )
        if not math.isfinite(self.rope_theta) or self.rope_theta <= 1:
            raise ValueError(
                f"vision_config.rope_parameters.rope_theta: must be finite and > 1, "
                f"got {self.rope_theta!r}"
            )
        self._check_shapes()

    def _check_shapes(self) -> None:
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(
                f"vision_config.num_heads: hidden_size {self.hidden_size} must split into heads "
                f"whose width is a multiple of 4 (two rotary axes), got {self.num_heads} heads"
            )
        if self.window_size < self.patch_size * self.spatial_merge_size:
            raise ValueError(
                f"vision_config.window_size: must cover a merged patch group "
                f"({self.patch_size * self.spatial_merge_size} pixels), got {self.window_size}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf_config(cls, config: PretrainedConfig) -> VisionArgs:
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"vision_config.hidden_act: only 'silu', got {config.hidden_act!r}")
        rope = getattr(config, "rope_parameters", None) or {}
        return cls(
            depth=config.depth,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=config.num_heads,
            in_channels=config.in_channels,
            patch_size=config.patch_size,
            temporal_patch_size=config.temporal_patch_size,
            spatial_merge_size=config.spatial_merge_size,
            window_size=config.window_size,
            out_hidden_size=config.out_hidden_size,
            fullatt_block_indexes=_indexes(config.fullatt_block_indexes),
            rope_theta=_number(rope.get("rope_theta", 10000.0)),
        )


# Each integer field's bounds: past them a checkpoint's config is refused before anything is
# allocated (a window of 2^64 pixels would pad every image to that size).
_SIDE, _WIDTH = 1 << 12, 1 << 16
_LIMITS = {
    "depth": (1, 256),
    "hidden_size": (4, _WIDTH),
    "intermediate_size": (1, 1 << 18),
    "num_heads": (1, 1024),
    "in_channels": (1, 16),
    "patch_size": (1, 1024),
    "temporal_patch_size": (1, 16),
    "spatial_merge_size": (1, 16),
    "window_size": (1, _SIDE * 16),
    "out_hidden_size": (1, _WIDTH),
}


def _indexes(value: object) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"vision_config.fullatt_block_indexes: a list of blocks, got {value!r}")
    return tuple(value)


def _number(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"vision_config.rope_parameters.rope_theta: a number, got {value!r}")
    return float(value)


class PatchEmbed(nn.Module):
    """Each flattened patch (channels x frames x 14 x 14) times the checkpoint's Conv3d kernel:
    the convolution's stride equals its kernel, so it is one matrix product."""

    def __init__(self, a: VisionArgs) -> None:
        super().__init__()
        kernel = (a.temporal_patch_size, a.patch_size, a.patch_size)
        # Holds the checkpoint's kernel under its name; never run as a convolution.
        self.proj = nn.Conv3d(a.in_channels, a.hidden_size, kernel, kernel, bias=False)
        self.proj.weight.requires_grad_(False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixels.to(weight.dtype), weight.flatten(1))


class VisionAttention(nn.Module):
    """Bidirectional attention inside each segment of the token rows (a window or an image)."""

    def __init__(self, a: VisionArgs) -> None:
        super().__init__()
        self.qkv = QKVParallelLinear(a.hidden_size, a.head_dim, a.num_heads, a.num_heads, True)
        self.proj = RowParallelLinear(a.hidden_size, a.hidden_size, bias=True)
        self.head_dim = a.head_dim

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: torch.Tensor
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x).view(t, 3, -1, self.head_dim).unbind(1)
        # The vision rotary is applied in float32 whatever the weights' dtype, as transformers does.
        q, k = (y.to(x.dtype) for y in apply_rotary(q.float(), k.float(), cos, sin))
        return self.proj(segment_attention(q, k, v, bounds).reshape(t, -1))


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: torch.Tensor
) -> torch.Tensor:
    """Rows attend to every row of their segment [bounds[i], bounds[i+1]) and to no other.
    q, k, v: [T, H, D]. The segments run as one padded batch; pad keys are masked out."""
    lengths = bounds[1:] - bounds[:-1]
    width = int(lengths.max())
    cols = torch.arange(width, device=q.device)
    valid = cols < lengths[:, None]  # [segments, width]
    rows = torch.where(valid, bounds[:-1, None] + cols, 0)

    def padded(x: torch.Tensor) -> torch.Tensor:
        return x[rows].transpose(1, 2)  # [segments, H, width, D]

    # Segments of one length (one image, or equal windows) need no mask: SDPA's fused kernels.
    mask = None if bool(valid.all()) else valid[:, None, None, :]
    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=mask)
    return out.transpose(1, 2)[valid]


class VisionMLP(nn.Module):
    """SwiGLU with biases; gate and up fused in one column-parallel matrix."""

    def __init__(self, a: VisionArgs) -> None:
        super().__init__()
        inter = a.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(a.hidden_size, [inter] * 2, bias=True)
        self.down_proj = RowParallelLinear(inter, a.hidden_size, bias=True)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class VisionBlock(nn.Module):
    def __init__(self, a: VisionArgs) -> None:
        super().__init__()
        self.norm1 = RMSNorm(a.hidden_size, 1e-6)
        self.norm2 = RMSNorm(a.hidden_size, 1e-6)
        self.attn = VisionAttention(a)
        self.mlp = VisionMLP(a)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, bounds)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """RMSNorm, then each 2x2 group's four vectors side by side through a GELU MLP."""

    def __init__(self, a: VisionArgs) -> None:
        super().__init__()
        self.width = a.hidden_size * a.spatial_merge_size**2
        self.ln_q = RMSNorm(a.hidden_size, 1e-6)
        self.mlp = nn.Sequential(
            ColumnParallelLinear(self.width, self.width, bias=True),
            nn.GELU(),
            RowParallelLinear(self.width, a.out_hidden_size, bias=True),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


# checkpoint name fragment -> (our fused parameter fragment, shard id)
_STACKED = ((".gate_proj.", ".gate_up_proj.", 0), (".up_proj.", ".gate_up_proj.", 1))


class Qwen2_5_VisionTransformer(nn.Module):
    """pixel_values [patches, C*T*P*P] and grid_thw [images, 3] (in patches) -> [patches / 4,
    out_hidden_size], the images' embeddings one after another."""

    inv_freq: torch.Tensor  # the 2-D rotary's frequencies: head_dim / 4 per axis

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.args = a = VisionArgs.from_hf_config(config)
        self.patch_embed = PatchEmbed(a)
        self.blocks = nn.ModuleList(VisionBlock(a) for _ in range(a.depth))
        self.merger = PatchMerger(a)
        inv_freq = rope_inv_freq(a.head_dim // 2, {"rope_theta": a.rope_theta})
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def patch_width(self) -> int:
        """A flattened patch's values: channels x frames x patch x patch."""
        a = self.args
        return a.in_channels * a.temporal_patch_size * a.patch_size**2

    @property
    def merge_unit(self) -> int:
        return self.args.spatial_merge_size**2

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        a, grid = self.args, grid_thw.cpu()
        order, window_bounds = get_vision_window_index(
            grid, a.spatial_merge_size, a.window_size, a.patch_size
        )
        image_bounds = get_vision_cu_seqlens(grid)
        x = self._grouped(self.patch_embed(pixel_values), order)
        cos, sin = (self._grouped(c, order) for c in self._rotary(grid))
        dev = x.device
        window_bounds, image_bounds = window_bounds.to(dev), image_bounds.to(dev)
        for i, block in enumerate(self.blocks):
            full = i in a.fullatt_block_indexes
            x = block(x, cos, sin, image_bounds if full else window_bounds)
        return self.merger(x)[torch.argsort(order).to(dev)]

    def _grouped(self, x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """Rows reordered window by window, each 2x2 group kept together (order: by group)."""
        groups = x.view(-1, self.merge_unit, x.shape[-1])
        return groups[order.to(x.device)].view(x.shape)

    def _rotary(self, grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each patch's cos and sin rows ([patches, head_dim], float32): the first quarter of the
        columns turns with its row, the second with its column, the second half repeats both."""
        rows_cols = get_vision_position_ids(grid, self.args.spatial_merge_size)
        freqs = rows_cols.to(self.inv_freq.device)[..., None].float() * self.inv_freq
        freqs = freqs.flatten(1)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    def load_weights(self, weights: Iterable[tuple[str, AnyWeight]]) -> set[str]:
        """Checkpoint tensors named from inside the tower (`blocks.0.attn.qkv.weight`); returns
        the parameter names loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            for target, part, shard_id in _split_stacked(name, tensor):
                if target not in params:
                    raise ValueError(f"weights: vision tensor {name!r} has no parameter")
                load_param(params[target], part, shard_id, name)
                loaded.add(target)
        return loaded


def _split_stacked(name: str, tensor: AnyWeight) -> list[tuple[str, AnyWeight, int | str | None]]:
    """(our parameter, tensor, shard id) for a checkpoint tensor: the fused qkv cut into its
    three parts, gate and up sent to their halves of gate_up_proj."""
    if ".attn.qkv." in name:
        q, k, v = float_only(tensor, name).chunk(3, dim=0)
        return [(name, q, "q"), (name, k, "k"), (name, v, "v")]
    for ckpt, ours, shard_id in _STACKED:
        if ckpt in name:
            return [(name.replace(ckpt, ours), tensor, shard_id)]
    return [(name, tensor, None)]
