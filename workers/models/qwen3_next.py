"""Qwen3-Next: gated DeltaNet linear attention on most layers, gated full attention every few
(`layer_types`), and Qwen2-MoE's sparse block (a sigmoid-gated shared expert beside the routed
ones) as the feed-forward.

- Linear layers (workers/layers/gated_delta.py) keep a fixed-size state per request instead of KV:
  the runner's state feature binds their slots each step (workers/linear_state.py), the scheduler
  counts them (scheduler/state_slots.py). Only the full-attention layers have paged KV.
- Full attention: `q_proj` yields each head's query and an output gate side by side; q and k are
  RMS-normed per head, rotary covers the first `partial_rotary_factor` of each head, and the
  attention output is multiplied by sigmoid(gate) before `o_proj`.
- Every RMSNorm but the DeltaNet's gated one scales by (1 + weight), as Gemma's do.
- Tensor parallelism splits both mixers by head (a DeltaNet rank holds whole key heads and their
  value heads; a gated-attention rank whole (query, gate) pairs) and the MoE as for Qwen2-MoE;
  pipeline stages are refused. The multi-token-prediction weights (`mtp.*`) are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar, cast

import torch
from torch import nn
from transformers import PretrainedConfig

from workers.layers.attention import Attention, AttentionMetadata
from workers.layers.embedding import VocabParallelEmbedding
from workers.layers.gated_delta import DeltaDims, GatedDeltaNet
from workers.layers.linear import QKVParallelLinear, RowParallelLinear
from workers.layers.quantized import AnyWeight
from workers.layers.rotary import RotaryEmbedding
from workers.models.gemma import GemmaRMSNorm
from workers.models.glm4_moe import PartialRotary, partial_rotary
from workers.models.llama import LlamaArgs, LlamaMLP, PreNormBlock, lm_head_of
from workers.models.moe import MoEArgs, MoEForCausalLM
from workers.parallel import divide, get_tp_world_size
from workers.pipeline import current_stage, run_stage

LAYER_TYPES = ("linear_attention", "full_attention")


def layer_types_of(config: PretrainedConfig) -> list[str]:
    """Each layer's token mixer, checked: one of LAYER_TYPES per layer."""
    types = getattr(config, "layer_types", None)
    n = config.num_hidden_layers
    if not isinstance(types, list | tuple) or len(types) != n:
        raise ValueError(f"layer_types: needs one entry per layer ({n}), got {types!r}")
    bad = sorted({t for t in types if t not in LAYER_TYPES}, key=str)
    if bad:
        raise ValueError(f"layer_types: {bad!r} are not among {LAYER_TYPES}")
    return list(types)


def delta_dims(config: PretrainedConfig) -> DeltaDims:
    return DeltaDims(
        hidden_size=config.hidden_size,
        num_k_heads=config.linear_num_key_heads,
        num_v_heads=config.linear_num_value_heads,
        k_dim=config.linear_key_head_dim,
        v_dim=config.linear_value_head_dim,
        conv_kernel=config.linear_conv_kernel_dim,
        eps=config.rms_norm_eps,
    )


class GatedAttention(nn.Module):
    """Full attention with a per-head output gate from the query projection."""

    def __init__(self, a: LlamaArgs, rotary: nn.Module) -> None:
        super().__init__()
        divide(a.num_heads, get_tp_world_size(), "num_attention_heads")
        # The query projection is [q_h, gate_h] per head: 2 * num_heads "heads" of head_dim,
        # so a pair always lands on the same rank.
        self.qkv_proj = QKVParallelLinear(
            a.hidden_size, a.head_dim, 2 * a.num_heads, a.num_kv_heads, a.qkv_bias
        )
        self.o_proj = RowParallelLinear(a.num_heads * a.head_dim, a.hidden_size, a.o_bias)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.head_dim = a.head_dim
        self.q_norm = GemmaRMSNorm(a.head_dim, a.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(a.head_dim, a.rms_norm_eps)
        self.rotary = rotary
        self.attn = Attention(
            self.qkv_proj.num_heads // 2, a.head_dim, self.qkv_proj.num_kv_heads, a.head_dim**-0.5
        )

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        t, hd = x.shape[0], self.head_dim
        qg, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = qg.view(t, -1, 2 * hd).chunk(2, dim=-1)
        q, k = self.q_norm(q.contiguous()), self.k_norm(k.view(t, -1, hd))
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v, meta)
        return self.o_proj(out * torch.sigmoid(gate.reshape(t, -1)))


class Qwen3NextDecoderLayer(PreNormBlock):
    """Pre-norm block whose token mixer is a DeltaNet (`linear_attn`) or gated attention
    (`self_attn`), named as the checkpoint names them."""

    def __init__(
        self, a: LlamaArgs, kind: str, dims: DeltaDims, rotary: nn.Module, mlp: nn.Module
    ) -> None:
        super().__init__()
        self.mixer: nn.Module
        if kind == "linear_attention":
            self.linear_attn = self.mixer = GatedDeltaNet(dims)
        else:
            self.self_attn = self.mixer = GatedAttention(a, rotary)
        self.mlp = mlp
        # Gemma's norm (1 + weight), called as PreNormBlock calls RMSNorm.
        self.input_layernorm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps)  # type: ignore[assignment]
        self.post_attention_layernorm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps)  # type: ignore[assignment]

    def mix(
        self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.mixer(positions, x, meta)


M = TypeVar("M", bound=nn.Module)


class HybridModel(nn.Module):
    """Embedding, decoder layers (positions, x, residual, meta) and final norm, run as one
    pipeline stage: the hybrid families' decoder (Granite-4 hybrid's too)."""

    def __init__(self, layers: Sequence[nn.Module], embed: nn.Module, norm: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed
        self.layers = nn.ModuleList(layers)
        self.norm = norm

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return run_stage(self.layers, self.embed_tokens, self.norm, input_ids, positions, meta)

    def mixers(self, kind: type[M]) -> list[M]:
        """The layers' token mixers of one kind (attention: the layers with paged KV)."""
        return [m for layer in self.layers if isinstance(m := getattr(layer, "mixer", None), kind)]


class Qwen3NextForCausalLM(MoEForCausalLM):
    family = "qwen3_next"

    def __init__(self, config: PretrainedConfig, max_model_len: int | None = None) -> None:
        # As Glm4MoeForCausalLM: the layers differ from the Llama base's, so built from nn.Module.
        nn.Module.__init__(self)
        if current_stage().size > 1:
            raise ValueError("pipeline_parallel_size: Qwen3-Next runs on one stage")
        self.args = LlamaArgs.from_hf_config(config, qk_norm=True)
        if max_model_len is not None:
            self.args.max_position = min(self.args.max_position, max_model_len)
        # The shared expert and its sigmoid gate are Qwen2-MoE's.
        self.moe = MoEArgs.from_hf_config(config, family="qwen2_moe")
        a, dims, types = self.args, delta_dims(config), layer_types_of(config)
        rotary: PartialRotary | RotaryEmbedding | None = partial_rotary(a)
        if rotary is None:
            rotary = RotaryEmbedding(a.head_dim, a.max_position, a.rope_parameters)
        layers = [
            Qwen3NextDecoderLayer(a, kind, dims, rotary, self._mlp(i))
            for i, kind in enumerate(types)
        ]
        embed = VocabParallelEmbedding(a.vocab_size, a.hidden_size)
        norm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps)
        # The base class's annotation is LlamaModel; this one has the same forward and layers.
        self.model = HybridModel(layers, embed, norm)  # type: ignore[assignment]
        self.lm_head = lm_head_of(a, self.model.embed_tokens)

    def _mlp(self, layer: int) -> nn.Module:
        return self.make_mlp(layer) or LlamaMLP(self.args)

    def attention_blocks(self) -> list[GatedAttention]:  # type: ignore[override]
        """The full-attention layers' blocks (the only ones with paged KV)."""
        return cast(HybridModel, self.model).mixers(GatedAttention)

    def load_weights(self, weights: Iterable[tuple[str, AnyWeight]]) -> set[str]:
        return super().load_weights(_without_mtp(weights))


def _without_mtp(weights: Iterable[tuple[str, AnyWeight]]) -> Iterator[tuple[str, AnyWeight]]:
    """The checkpoint without its multi-token-prediction module (`mtp.*`), which is not run."""
    return ((name, w) for name, w in weights if not name.startswith("mtp."))
