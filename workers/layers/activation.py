"""Gated activations over a merged [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.layers.fused import fused_ops


class SiluAndMul(nn.Module):
    """silu(gate) * up, where the input holds gate and up side by side in its last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = fused_ops(x)
        if ops is not None:
            return ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
