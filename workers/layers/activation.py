"""Gated activations over a merged [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.layers.fused import fused_ops


class SiluAndMul(nn.Module):
    """silu(gate) * up, where the input holds gate and up side by side in its last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = fused_ops(x, "silu_and_mul")
        if ops is not None:
            return ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


# transformers' activation names -> torch's GELU approximation ("gelu_new" is the tanh formula).
GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}


class GeluAndMul(nn.Module):
    """gelu(gate) * up over a merged [gate | up] input (GeGLU, Gemma's MLP)."""

    def __init__(self, activation: str = "gelu_pytorch_tanh") -> None:
        super().__init__()
        if activation not in GELU_APPROXIMATIONS:
            raise ValueError(
                f"hidden_activation: {activation!r} is not supported "
                f"(supported: {sorted(GELU_APPROXIMATIONS)})"
            )
        self.approximate = GELU_APPROXIMATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up


class ClampedSwiGLU(nn.Module):
    """gpt-oss's expert activation over a merged [gate | up] input: gate clamped above at
    `limit`, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""

    def __init__(self, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
