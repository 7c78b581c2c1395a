"""What the output-length probe reads: each prompt's final hidden state at its last token, made
small enough to cross the process boundary every step.

The scheduler's hidden-state probe (scheduler/length_probe.py, scheduler/length_live.py) learns
output length from the model's own state at the prompt's last token. That state is thousands of
floats; the runner sends `dim` of them instead: the state normalised to unit length (as the
offline probe saw it, through `LLM.embed(pooling="last")`), then multiplied by a fixed Gaussian
matrix drawn from PROJECTION_SEED (a random projection keeps distances and dot products, which is
all a linear probe needs). The seed is fixed, not a setting: a persisted probe is only valid for
the projection it learned under, and the scheduler's state file records this one.

Only the sampling rank extracts (under tensor parallelism every rank holds the same final hidden
states), and only when a length-aware setting asked for it (RunnerConfig.length_feature_dim > 0):
otherwise nothing here runs.
"""

from __future__ import annotations

import torch

PROJECTION_SEED = 35  # issue 35; fixed so that features stay comparable across restarts


class LengthFeatures:
    """The fixed projection of one model's hidden states to `dim` floats."""

    def __init__(self, hidden_size: int, dim: int, device: torch.device) -> None:
        gen = torch.Generator().manual_seed(PROJECTION_SEED)
        # Drawn on the CPU so every device gets the same matrix for the same seed.
        matrix = torch.randn(hidden_size, dim, generator=gen, dtype=torch.float32)
        self.matrix = (matrix / dim**0.5).to(device)
        self.dim = dim

    def extract(self, hidden: torch.Tensor, rows: list[int]) -> list[list[float]]:
        """The features of the given rows of a step's hidden states (one row per prompt)."""
        index = torch.tensor(rows, dtype=torch.long, device=hidden.device)
        states = torch.nn.functional.normalize(hidden.index_select(0, index).float(), dim=1)
        return (states @ self.matrix).cpu().tolist()


def ends_prompt(start: int, num_prompt: int, num_tokens: int) -> bool:
    """Whether a sampling row whose step began at `start` ends a fresh prompt: the step began
    inside the prompt and the request holds no outputs yet (a recomputed preemption re-runs prompt
    and outputs, so its last token is no longer the prompt's)."""
    return start < num_prompt and num_tokens == num_prompt
