"""Image embeddings spliced into a language model's input embeddings at placeholder positions.

A vision model attaches an `ImageSplice` to its token embedding (a forward hook): the runner's
vision feature (workers/features/vision.py) sets the step's rows and embeddings before the
forward, the hook writes them over the placeholder tokens' embeddings and clears itself. The
model's forward signature stays the text model's, so the runner loop and the decode graphs see
no difference.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class ImageSplice:
    """The embeddings to write over some rows of the next forward's input embeddings."""

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None
        self.embeds: torch.Tensor | None = None
        # Each image's flat [lo, hi) in the step (a family that attends within an image both
        # ways reads them before the forward: Gemma 3).
        self.spans: list[tuple[int, int]] = []

    def set(
        self, rows: torch.Tensor, embeds: torch.Tensor, spans: list[tuple[int, int]] | None = None
    ) -> None:
        """rows: flat batch positions [n]; embeds: [n, hidden]; spans: each image's range of
        rows, for the next forward only."""
        if rows.shape[0] != embeds.shape[0]:
            raise ValueError(f"{rows.shape[0]} rows for {embeds.shape[0]} image embeddings")
        self.rows, self.embeds, self.spans = rows, embeds, list(spans or ())

    def attach(self, embedding: nn.Module) -> None:
        embedding.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return self.apply(output)

    def apply(self, output: torch.Tensor) -> torch.Tensor:
        """output with the rows set written over it (and the splice cleared); unchanged when
        none are set."""
        rows, embeds = self.rows, self.embeds
        if rows is None or embeds is None:
            return output
        self.rows = self.embeds = None
        self.spans = []
        output = output.clone()
        output[rows.to(output.device)] = embeds.to(output.dtype)
        return output
