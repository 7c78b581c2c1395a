"""Multimodal rotary embedding (M-RoPE, Qwen2-VL / Qwen2.5-VL): three position axes per token.

Each token has a temporal, a height and a width position. The rotary frequencies are split into
three sections (`mrope_section`, counted in frequency pairs); section i turns with axis i's
position. Text tokens carry the same position on all three axes, so a text-only prompt is plain
RoPE. An image's tokens take (start, start + row, start + column) over its merged patch grid, and
the text after it resumes from start + max(rows, columns): a prompt with images ends at a lower
position than its length, by a per-request `delta` that every later token adds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from scheduler.multimodal import MultiModalInputs
from scheduler.outputs import NewRequestData
from workers.layers.rotary import RotaryEmbedding, apply_rotary
from workers.step_state import Batch

# An image grid's side in tokens, at most: 65,536 merged tokens is 1.8 million pixels of Qwen's
# 28-pixel groups, far past any image a processor lets through; a bound before any allocation.
MAX_GRID_SIDE = 1 << 16


@dataclass(frozen=True, slots=True)
class MRopeSpan:
    """An image's placeholder tokens in a prompt: from `offset`, a t x h x w grid of tokens
    (the vision tower's merged grid: patches // spatial_merge_size per side)."""

    offset: int
    t: int
    h: int
    w: int

    def __post_init__(self) -> None:
        if not _is_int(self.offset) or not 0 <= self.offset < 1 << 62:
            raise ValueError(f"MRopeSpan.offset: must be an integer >= 0, got {self.offset!r}")
        for name in ("t", "h", "w"):
            value = getattr(self, name)
            if not _is_int(value) or not 1 <= value <= MAX_GRID_SIDE:
                raise ValueError(
                    f"MRopeSpan.{name}: must be an integer in [1, {MAX_GRID_SIDE}], got {value!r}"
                )

    @property
    def length(self) -> int:
        return self.t * self.h * self.w

    @property
    def end(self) -> int:
        return self.offset + self.length


def prompt_positions(num_tokens: int, spans: list[MRopeSpan]) -> tuple[torch.Tensor, int]:
    """A prompt's [3, num_tokens] positions and its delta (what every token after the prompt adds
    to its index), as transformers' Qwen2.5-VL get_rope_index lays them out for images."""
    out = torch.empty(3, num_tokens, dtype=torch.long)
    text_at, pos = 0, 0  # next text token's index, and its position
    for span in sorted(spans, key=lambda s: s.offset):
        if span.offset < text_at or span.end > num_tokens:
            raise ValueError(
                f"MRopeSpan: tokens {span.offset}..{span.end} overlap another image or pass the "
                f"prompt's {num_tokens} tokens"
            )
        out[:, text_at : span.offset] = torch.arange(pos, pos + span.offset - text_at)
        pos += span.offset - text_at
        out[:, span.offset : span.end] = _grid_positions(span, pos)
        pos += max(span.h, span.w)
        text_at = span.end
    out[:, text_at:] = torch.arange(pos, pos + num_tokens - text_at)
    return out, pos - text_at  # the last position + 1, less the prompt's length


def _grid_positions(span: MRopeSpan, start: int) -> torch.Tensor:
    t, h, w = torch.meshgrid(
        torch.arange(span.t), torch.arange(span.h), torch.arange(span.w), indexing="ij"
    )
    return torch.stack([t, h, w]).reshape(3, -1) + start


def step_positions(prompt: torch.Tensor, delta: int, start: int, num: int) -> torch.Tensor:
    """[3, num] positions of tokens start..start+num of a request whose prompt positions are
    `prompt` ([3, P]): the prompt's own, then index + delta for the generated tokens."""
    in_prompt = prompt[:, start : start + num]
    first_after = max(start, prompt.shape[1])
    after = torch.arange(first_after, max(start + num, first_after)) + delta
    return torch.cat([in_prompt, after.expand(3, -1)], dim=1)


class MRopePositions:
    """The 3-axis positions of requests with images, beside the model (as ImageSplice is).

    The runner's vision feature (workers/features/vision.py) calls `start` when a request
    arrives (its prompt's positions are laid out once), `finish` when it leaves, and `prepare`
    before each forward: when a request of the step has images, the step's [3, T] positions are
    set, and the model's forward reads them once (`take`) in place of the runner's [T]. Text
    requests alone leave the runner's positions, plain RoPE, as they are."""

    def __init__(self, spans_of: Callable[[MultiModalInputs], list[MRopeSpan]]) -> None:
        self.spans_of = spans_of  # a family's reading of its processor arrays
        self.prompts: dict[str, tuple[torch.Tensor, int]] = {}  # [3, P] positions, delta
        self.step: torch.Tensor | None = None

    def start(self, new: NewRequestData) -> None:
        """A request arrives (or is resent in full); raising fails it alone."""
        self.prompts.pop(new.req_id, None)
        if new.mm_inputs is not None:
            spans = self.spans_of(new.mm_inputs)
            self.prompts[new.req_id] = prompt_positions(len(new.prompt_token_ids), spans)

    def finish(self, req_id: str) -> None:
        self.prompts.pop(req_id, None)

    def prepare(self, batch: Batch) -> bool:
        """Set the step's positions if a request of it has images; whether they were set (the
        step then runs eagerly: the decode graphs derive plain positions)."""
        self.step = None
        if not any(rid in self.prompts for rid in batch.req_ids):
            return False
        rows = []
        for rid, start, n in zip(batch.req_ids, batch.starts, batch.query_lens):
            prompt, delta = self.prompts.get(rid, (_NO_PROMPT, 0))
            rows.append(step_positions(prompt, delta, start, n))
        self.step = torch.cat(rows, dim=1)
        return True

    def take(self, positions: torch.Tensor) -> torch.Tensor:
        """The step's positions: those `prepare` set (once), else the runner's."""
        step, self.step = self.step, None
        if step is None:
            return positions
        if step.shape[1] != positions.shape[0]:
            raise RuntimeError(f"M-RoPE: {step.shape[1]} positions set for {positions.shape[0]}")
        return step.to(positions.device)


_NO_PROMPT = torch.empty(3, 0, dtype=torch.long)  # a text request: index + 0 on every axis


class MRotaryEmbedding(RotaryEmbedding):
    """Rotary embedding over 3-axis positions: the same cos/sin table as RotaryEmbedding, each
    column's row picked by its section's axis."""

    axis: torch.Tensor  # [head_dim]: which of the three positions each column turns with

    def __init__(
        self, head_dim: int, max_position: int, rope_parameters: dict, mrope_section: object
    ) -> None:
        """mrope_section: as the config holds it (checked here)."""
        super().__init__(head_dim, max_position, rope_parameters)
        section = check_mrope_section(mrope_section, head_dim)
        half = torch.repeat_interleave(torch.arange(3), torch.tensor(section))
        self.register_buffer("axis", torch.cat([half, half]), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [3, T] (or [T]: text only, all axes equal); q: [T, Hq, D], k: [T, Hk, D]."""
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        rows = positions[self.axis].T  # [T, D]: column c's row is its axis' position
        cols = torch.arange(self.axis.numel(), device=positions.device)
        return apply_rotary(q, k, self.cos[rows, cols], self.sin[rows, cols])


def check_mrope_section(section: object, head_dim: int) -> list[int]:
    """The section as read from a config, if it is three positive integers that add up to half
    the head (its frequency pairs); else a ValueError naming it."""
    if (
        isinstance(section, (list, tuple))
        and len(section) == 3
        and all(_is_int(s) and s > 0 for s in section)
        and sum(section) == head_dim // 2
    ):
        return list(section)
    raise ValueError(
        f"rope_parameters.mrope_section: needs 3 positive integers adding up to "
        f"head_dim / 2 = {head_dim // 2}, got {section!r}"
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
