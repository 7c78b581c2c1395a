"""Gemma 2 and Gemma 3 (text): the Llama layout with Gemma's own twists, read from the HF config.

- sandwich norms: RMSNorm before and after both attention and the MLP, each scaling by
  (1 + weight) in float32;
- embeddings multiplied by sqrt(hidden_size), rounded to the model's dtype first;
- a GeGLU MLP (gelu with the tanh approximation);
- attention scaled by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
- sliding-window and global layers alternating per `layer_types` (Gemma 2: every other layer;
  Gemma 3: five local to one global);
- Gemma 2: tanh soft-capping of the attention scores (`attn_logit_softcapping`, applied in the
  attention backends) and of the final logits (`final_logit_softcapping`);
- Gemma 3: q/k RMSNorm per head, and a rope table per layer type (`rope_parameters` keyed by
  "sliding_attention" / "full_attention": the local layers' base is `rope_local_base_freq`).
  transformers' Gemma 3 does not cap attention scores even where the config names a cap; nor
  do we.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from workers.layers.activation import GeluAndMul
from workers.layers.attention import AttentionMetadata
from workers.layers.embedding import VocabParallelEmbedding
from workers.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from workers.layers.rotary import RotaryEmbedding
from workers.models.llama import (
    LlamaArgs,
    LlamaAttention,
    LlamaForCausalLM,
    first_norm,
    lm_head_of,
)
from workers.pipeline import MissingLayer, current_stage, run_stage


@dataclass(frozen=True, slots=True)
class GemmaArgs:
    """Gemma's fields beyond LlamaArgs."""

    activation: str
    query_pre_attn_scalar: float
    attn_softcap: float | None
    final_softcap: float | None
    qk_norm: bool
    # Per layer: its rope parameters (Gemma 3 keys them by layer type).
    layer_ropes: tuple[tuple[tuple[str, object], ...], ...]

    @classmethod
    def from_hf_config(
        cls, config: PretrainedConfig, num_layers: int, *, gemma3: bool
    ) -> GemmaArgs:
        scalar = getattr(config, "query_pre_attn_scalar", None) or config.head_dim
        if not isinstance(scalar, int | float) or isinstance(scalar, bool) or not scalar > 0:
            raise ValueError(f"query_pre_attn_scalar: must be a positive number, got {scalar!r}")
        activation = getattr(config, "hidden_activation", None) or getattr(
            config, "hidden_act", "gelu_pytorch_tanh"
        )
        if not isinstance(activation, str):
            raise ValueError(f"hidden_activation: must be a string, got {activation!r}")
        return cls(
            activation=activation,
            query_pre_attn_scalar=float(scalar),
            attn_softcap=None if gemma3 else _cap(config, "attn_logit_softcapping"),
            final_softcap=_cap(config, "final_logit_softcapping"),
            qk_norm=gemma3,
            layer_ropes=tuple(
                tuple(sorted(_rope_of(config, i).items())) for i in range(num_layers)
            ),
        )


def _cap(config: PretrainedConfig, name: str) -> float | None:
    value = getattr(config, name, None)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < 1e30:
        raise ValueError(f"{name}: must be a positive number or null, got {value!r}")
    return float(value)


def _rope_of(config: PretrainedConfig, layer: int) -> dict:
    """Layer `layer`'s rope parameters: per layer type where the config keys them so (Gemma 3),
    else the one set."""
    rope = getattr(config, "rope_parameters", None) or {
        "rope_type": "default",
        "rope_theta": getattr(config, "rope_theta", 10000.0),
    }
    types = getattr(config, "layer_types", None)
    if types is not None and types[layer] in rope:
        return dict(rope[types[layer]])
    return dict(rope)


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaling by (1 + weight), in float32 and cast once at the end (Gemma's order);
    with a residual, norm(x + residual) and x + residual."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual


def gemma_attention(a: LlamaArgs, g: GemmaArgs, rotary: RotaryEmbedding, layer: int) -> nn.Module:
    """Llama's attention with Gemma's score scale (query_pre_attn_scalar), soft-cap, (1 + w) q/k
    norms and the layer's window."""
    return LlamaAttention(
        a,
        rotary,
        a.sliding_windows[layer],
        scale=g.query_pre_attn_scalar**-0.5,
        logit_softcap=g.attn_softcap,
        qk_norm=GemmaRMSNorm if g.qk_norm else None,
    )


class GemmaMLP(nn.Module):
    """GeGLU: down(gelu(gate(x)) * up(x)), gate and up fused."""

    def __init__(self, a: LlamaArgs, g: GemmaArgs) -> None:
        super().__init__()
        inter = a.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(a.hidden_size, [inter] * 2, a.mlp_bias)
        self.down_proj = RowParallelLinear(inter, a.hidden_size, a.mlp_bias)
        self.act = GeluAndMul(g.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    """Sandwich norms; the residual add is fused into the norm that follows it."""

    def __init__(self, a: LlamaArgs, g: GemmaArgs, rotary: RotaryEmbedding, layer: int) -> None:
        super().__init__()
        self.self_attn = gemma_attention(a, g, rotary, layer)
        self.mlp = GemmaMLP(a, g)
        h, eps = a.hidden_size, a.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = first_norm(self.input_layernorm, x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x, meta))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaModel(nn.Module):
    def __init__(self, a: LlamaArgs, g: GemmaArgs) -> None:
        super().__init__()
        stage = current_stage()  # a pipeline stage builds its own layers only (LlamaModel)
        self.embed_tokens: nn.Module = (
            VocabParallelEmbedding(a.vocab_size, a.hidden_size)
            if stage.is_first
            else MissingLayer()
        )
        self.normalizer = float(a.hidden_size) ** 0.5
        tables: dict[tuple, RotaryEmbedding] = {}  # one cos/sin table per distinct rope
        for rope in g.layer_ropes:
            if rope not in tables:
                tables[rope] = RotaryEmbedding(a.head_dim, a.max_position, dict(rope))
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(a, g, tables[g.layer_ropes[i]], i)
            if stage.holds(i)
            else MissingLayer()
            for i in range(a.num_layers)
        )
        self.norm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps) if stage.is_last else MissingLayer()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # The scale is rounded to the model's dtype before the multiply, as transformers does.
        return x * torch.tensor(self.normalizer, dtype=x.dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return run_stage(self.layers, self.embed, self.norm, input_ids, positions, meta)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2; LlamaForCausalLM lends it weight loading (the same checkpoint names)."""

    gemma3 = False

    def __init__(self, config: PretrainedConfig, max_model_len: int | None = None) -> None:
        nn.Module.__init__(self)
        self.args = LlamaArgs.from_hf_config(config)
        if max_model_len is not None:
            self.args.max_position = min(self.args.max_position, max_model_len)
        self.gemma = GemmaArgs.from_hf_config(config, self.args.num_layers, gemma3=self.gemma3)
        self.model = GemmaModel(self.args, self.gemma)  # type: ignore[assignment]
        self.lm_head = lm_head_of(self.args, self.model.embed_tokens)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        cap = self.gemma.final_softcap
        if logits is None or cap is None:
            return logits
        return torch.tanh(logits / cap) * cap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text: q/k norm, local and global rope bases, no attention soft-cap."""

    gemma3 = True
