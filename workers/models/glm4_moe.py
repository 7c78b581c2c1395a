"""GLM-4-MoE (GLM-4.5 / 4.6): Llama attention (q/k/v bias, optional q/k RMSNorm, no o_proj bias)
with rotary on part of each head (`partial_rotary_factor`), and DeepSeek-V3's MoE block: grouped
sigmoid routing with a correction bias, shared experts, dense first layers
(workers/models/deepseek.py)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from workers.layers.embedding import ParallelLMHead
from workers.layers.fused import fused_ops
from workers.layers.quantized import AnyWeight
from workers.layers.rotary import RotaryEmbedding, rotary_torch
from workers.models.deepseek import DeepseekMoE, GroupedMoEArgs, without_mtp_layers
from workers.models.llama import LlamaArgs, LlamaModel
from workers.models.moe import MoEForCausalLM


class PartialRotary(nn.Module):
    """Rotary over the first `table.cos.shape[1]` numbers of each head (neox-style within them);
    the rest of the head passes through."""

    def __init__(self, table: RotaryEmbedding) -> None:
        super().__init__()
        self.table = table
        self.width = table.cos.shape[1]

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ops = fused_ops(q, "rotary")
        if ops is not None:  # the fused kernel rotates a narrower table's width only
            return ops.rotary_(q, k, positions, self.table.cos, self.table.sin)
        w = self.width
        q_rot, k_rot = rotary_torch(
            q[..., :w], k[..., :w], positions, self.table.cos, self.table.sin
        )
        return torch.cat([q_rot, q[..., w:]], -1), torch.cat([k_rot, k[..., w:]], -1)


def partial_rotary(a: LlamaArgs) -> PartialRotary | None:
    """The partial table for a's rope parameters, or None when rotary covers the whole head; a's
    rope parameters lose the factor (the Llama table is then built whole, then replaced)."""
    factor = a.rope_parameters.pop("partial_rotary_factor", 1.0)
    if not isinstance(factor, int | float) or not 0 < factor <= 1:
        raise ValueError(f"partial_rotary_factor: must be in (0, 1], got {factor!r}")
    width = int(a.head_dim * factor)
    if width == a.head_dim:
        return None
    if width < 2 or width % 2:
        raise ValueError(f"partial_rotary_factor: {factor} leaves an odd rotary width {width}")
    return PartialRotary(RotaryEmbedding(width, a.max_position, a.rope_parameters))


class Glm4MoeForCausalLM(MoEForCausalLM):
    family = "glm4_moe"

    def __init__(self, config: PretrainedConfig, max_model_len: int | None = None) -> None:
        # As DeepseekForCausalLM: this family's layers differ from the Llama base's (the MoE
        # block, the partial rotary), so it builds them from nn.Module up.
        nn.Module.__init__(self)
        self.grouped = GroupedMoEArgs.from_hf_config(config, sigmoid=True)
        use_qk_norm = bool(getattr(config, "use_qk_norm", False))
        self.args = LlamaArgs.from_hf_config(config, qk_norm=use_qk_norm)
        self.args.o_bias = False  # attention_bias is q/k/v's only
        if max_model_len is not None:
            self.args.max_position = min(self.args.max_position, max_model_len)
        rotary = partial_rotary(self.args)
        self.model = LlamaModel(self.args, self.make_mlp)
        if rotary is not None:
            for block in self.attention_blocks():
                block.rotary = rotary  # type: ignore[assignment]  # same call signature
        self.lm_head = ParallelLMHead(self.args.vocab_size, self.args.hidden_size)
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # type: ignore[assignment]

    def make_mlp(self, layer: int) -> nn.Module | None:
        if layer < self.grouped.first_k_dense_replace:
            return None
        return DeepseekMoE(self.args, self.grouped)

    def load_weights(self, weights: Iterable[tuple[str, AnyWeight]]) -> set[str]:
        return super().load_weights(without_mtp_layers(weights, self.args.num_layers))
