"""DeepSeek's expert routing: experts in groups, the token's best groups first, then top-k inside.

Two methods, as the checkpoints' configs name them (`topk_method`):

- "greedy" / "group_limited_greedy" (DeepSeek-V2): softmax scores; a group scores its best
  expert; experts outside the `topk_group` best of `n_group` groups are out.
- "noaux_tc" (DeepSeek-V3, Kimi-K2): sigmoid scores plus a learned per-expert correction bias
  decide the choice (a group scores the sum of its two best); the weights are the scores without
  the bias.

Either way the k weights may be renormalised (`norm_topk_prob`) and are then scaled by
`routed_scaling_factor`. The result feeds FusedMoE.experts like every other router's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True, slots=True)
class GroupedTopK:
    """How one DeepSeek MoE layer picks its experts."""

    num_experts: int
    top_k: int
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = "greedy"
    scoring_func: str = "softmax"
    renormalize: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(
                f"topk_method: must be one of {list(TOPK_METHODS)}, got {self.topk_method!r}"
            )
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(
                f"scoring_func: must be one of {list(SCORING_FUNCS)}, got {self.scoring_func!r}"
            )
        _positive_int("n_group", self.n_group, self.num_experts)
        if self.num_experts % self.n_group:
            raise ValueError(
                f"n_group: {self.n_group} does not divide n_routed_experts={self.num_experts}"
            )
        _positive_int("topk_group", self.topk_group, self.n_group)
        per_group = self.num_experts // self.n_group
        if self.top_k > self.topk_group * per_group:
            raise ValueError(
                f"num_experts_per_tok: {self.top_k} is more than the {self.topk_group * per_group}"
                " experts of topk_group groups"
            )
        if self.topk_method == "noaux_tc" and per_group < 2:
            raise ValueError("n_group: noaux_tc scores a group by its two best experts; need >= 2")
        f = self.routed_scaling_factor
        if not (isinstance(f, int | float) and 0 < f < 1e6 and math.isfinite(f)):
            raise ValueError(f"routed_scaling_factor: must be a positive number, got {f!r}")

    @property
    def grouped(self) -> bool:
        return self.topk_method != "greedy" and self.n_group > 1

    @property
    def uses_bias(self) -> bool:
        """noaux_tc: the checkpoint carries e_score_correction_bias."""
        return self.topk_method == "noaux_tc"


def _positive_int(name: str, value: object, most: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most:
        raise ValueError(f"{name}: must be an integer in [1, {most}], got {value!r}")


def grouped_topk(
    logits: torch.Tensor, cfg: GroupedTopK, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """([T, k] float32 weights, [T, k] expert ids) from router logits [T, E] (bias: [E] float32,
    noaux_tc's correction)."""
    logits = logits.float()
    scores = logits.softmax(-1) if cfg.scoring_func == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias
    if cfg.grouped:
        choice = _mask_groups(choice, cfg)
    ids = choice.topk(cfg.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if cfg.renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


def _mask_groups(choice: torch.Tensor, cfg: GroupedTopK) -> torch.Tensor:
    """choice with the experts outside each token's topk_group best groups set to -inf."""
    t = choice.shape[0]
    grouped = choice.view(t, cfg.n_group, -1)
    if cfg.topk_method == "noaux_tc":
        group_scores = grouped.topk(2, dim=-1)[0].sum(-1)
    else:
        group_scores = grouped.max(dim=-1).values
    best = group_scores.topk(cfg.topk_group, dim=-1, sorted=False)[1]
    drop = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, best, False)
    return grouped.masked_fill(drop[:, :, None], float("-inf")).view(t, -1)
