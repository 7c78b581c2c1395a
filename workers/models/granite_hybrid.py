"""Granite-4 hybrid (`GraniteMoeHybridForCausalLM`): Mamba-2 layers beside attention layers
(`layer_types`), each followed by a top-k MoE plus a shared MLP (the MLP alone when the model has
no experts), with Granite's scalars.

- Mamba-2 layers (workers/layers/mamba2.py) keep a fixed-size state per request in the slots the
  scheduler counts (scheduler/state_slots.py, workers/linear_state.py), as Qwen3-Next's DeltaNet
  layers do; only the attention layers have paged KV.
- Attention is Llama's, scaled by `attention_multiplier` instead of head_dim^-0.5, with rotary only
  when `position_embedding_type` is "rope" (Granite-4.0-H uses none).
- `embedding_multiplier` scales the embeddings, `residual_multiplier` each block's output before
  its residual add, and the logits are divided by `logits_scaling`.
- The router's top-k logits are softmaxed (the renormalised top-k of a softmax).
- Tensor parallelism splits the Mamba-2 layers by head (workers/layers/mamba2.py), attention by
  head, the shared MLP's fused gate and up piece by piece, and the experts as the MoE families do;
  pipeline stages are refused.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import cast

import torch
from torch import nn
from transformers import PretrainedConfig

from workers.layers.activation import SiluAndMul
from workers.layers.attention import AttentionMetadata
from workers.layers.embedding import VocabParallelEmbedding
from workers.layers.linear import RowParallelLinear
from workers.layers.mamba2 import Mamba2Mixer, MambaDims
from workers.layers.moe import FusedMoE, MoEConfig, ReplicatedLinear
from workers.layers.norm import RMSNorm
from workers.layers.pieces import PieceColumnLinear, shares
from workers.layers.quantized import AnyWeight
from workers.layers.rotary import RotaryEmbedding
from workers.models.llama import LlamaArgs, LlamaAttention, PreNormBlock, lm_head_of
from workers.models.moe import MoEForCausalLM
from workers.models.qwen3_next import HybridModel, layer_types_of
from workers.parallel import get_tp_rank, get_tp_world_size
from workers.pipeline import current_stage


def _scalar(config: PretrainedConfig, name: str) -> float:
    """A Granite multiplier: a finite positive number (1.0 when absent)."""
    value = getattr(config, name, None)
    value = 1.0 if value is None else value
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < 1e9:
        raise ValueError(f"{name}: must be a finite number in (0, 1e9), got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name}: must be finite, got {value!r}")
    return float(value)


def mamba_dims(config: PretrainedConfig) -> MambaDims:
    limit = tuple(getattr(config, "time_step_limit", None) or (0.0, math.inf))
    return MambaDims(
        hidden_size=config.hidden_size,
        num_heads=config.mamba_n_heads,
        head_dim=config.mamba_d_head,
        num_groups=config.mamba_n_groups,
        state_size=config.mamba_d_state,
        conv_kernel=config.mamba_d_conv,
        chunk_size=config.mamba_chunk_size,
        eps=config.rms_norm_eps,
        conv_bias=bool(config.mamba_conv_bias),
        proj_bias=bool(config.mamba_proj_bias),
        dt_limit=(float(limit[0]), float(limit[1])),
    )


class NoRotary(nn.Module):
    """Attention without positional rotation (position_embedding_type None)."""

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k


class ScaledEmbedding(VocabParallelEmbedding):
    """The vocab-parallel embedding times `embedding_multiplier`."""

    def __init__(self, vocab_size: int, hidden_size: int, scale: float) -> None:
        super().__init__(vocab_size, hidden_size)
        self.scale = scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.scale


class SharedMLP(nn.Module):
    """Granite's shared MLP: gate and up in one `input_linear` (a rank keeps its share of each),
    then `output_linear`."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        tp = get_tp_world_size()
        gate_up = shares([inter, inter], get_tp_rank(), tp, "shared_intermediate_size")
        self.input_linear = PieceColumnLinear(hidden, gate_up)
        self.output_linear = RowParallelLinear(inter, hidden)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_linear(self.act(self.input_linear(x)))


class GraniteMoE(nn.Module):
    """The routed experts (`router`, `experts`): the checkpoint's block_sparse_moe, loaded as
    `mlp`."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.router = ReplicatedLinear(cfg.hidden_size, cfg.num_experts)
        self.experts = FusedMoE(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))


class GraniteHybridLayer(PreNormBlock):
    """Pre-norm block: Mamba-2 (`mamba`) or attention (`self_attn`), then routed experts plus the
    shared MLP, each output scaled by the residual multiplier before its residual add."""

    def __init__(
        self,
        a: LlamaArgs,
        mixer: nn.Module,
        kind: str,
        moe: MoEConfig | None,
        shared: int,
        m: float,
    ) -> None:
        super().__init__()
        # Registered first under the checkpoint's name, so that name is the parameters' own.
        if kind == "linear_attention":
            self.mamba = mixer
        else:
            self.self_attn = mixer
        self.mixer = mixer
        # None: a layer of the shared MLP alone (feed_forward reads it so).
        self.mlp = GraniteMoE(moe) if moe is not None else None  # type: ignore[assignment]
        self.shared_mlp = SharedMLP(a.hidden_size, shared)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.multiplier = m

    def mix(
        self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.mixer(positions, x, meta) * self.multiplier

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.shared_mlp(x)
        if self.mlp is not None:
            y = y + self.mlp(x)
        return y * self.multiplier


class GraniteMoeHybridForCausalLM(MoEForCausalLM):
    family = "granitemoehybrid"

    def __init__(self, config: PretrainedConfig, max_model_len: int | None = None) -> None:
        nn.Module.__init__(self)
        if current_stage().size > 1:
            raise ValueError("pipeline_parallel_size: Granite-4 hybrid runs on one stage")
        self.args = a = LlamaArgs.from_hf_config(config)
        if max_model_len is not None:
            a.max_position = min(a.max_position, max_model_len)
        self.logits_scaling = _scalar(config, "logits_scaling")
        residual = _scalar(config, "residual_multiplier")
        scale = _scalar(config, "attention_multiplier")
        rotary: nn.Module = NoRotary()
        if getattr(config, "position_embedding_type", None) == "rope":
            rotary = RotaryEmbedding(a.head_dim, a.max_position, a.rope_parameters)
        experts = int(getattr(config, "num_local_experts", 0) or 0)
        moe = None
        if experts:
            moe = MoEConfig(
                num_experts=experts,
                top_k=config.num_experts_per_tok,
                hidden_size=a.hidden_size,
                intermediate_size=config.intermediate_size,
                renormalize=True,
                activation=getattr(config, "hidden_act", "silu"),
            )
        dims, shared = mamba_dims(config), config.shared_intermediate_size
        layers = []
        for kind in layer_types_of(config):
            mixer: nn.Module
            if kind == "linear_attention":
                mixer = Mamba2Mixer(dims)
            else:
                mixer = LlamaAttention(a, rotary, scale=scale)  # type: ignore[arg-type]
            layers.append(GraniteHybridLayer(a, mixer, kind, moe, shared, residual))
        embed = ScaledEmbedding(
            a.vocab_size, a.hidden_size, _scalar(config, "embedding_multiplier")
        )
        norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.model = HybridModel(layers, embed, norm)  # type: ignore[assignment]
        self.lm_head = lm_head_of(a, self.model.embed_tokens)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        # In place: the logits are this call's own tensor, and a second [T, vocab] costs a fresh
        # allocation (~7 ms at batch 32 over 49,152 on one CPU thread).
        return None if logits is None else logits.div_(self.logits_scaling)

    def attention_blocks(self) -> list[LlamaAttention]:
        return cast(HybridModel, self.model).mixers(LlamaAttention)

    def load_weights(self, weights: Iterable[tuple[str, AnyWeight]]) -> set[str]:
        return super().load_weights((_renamed(name), w) for name, w in weights)


# Granite's own names for the routed experts (all experts in one tensor each) and the router.
_RENAMES = (
    (".block_sparse_moe.input_linear.weight", ".block_sparse_moe.experts.gate_up_proj"),
    (".block_sparse_moe.output_linear.weight", ".block_sparse_moe.experts.down_proj"),
    (".block_sparse_moe.router.layer.weight", ".block_sparse_moe.router.weight"),
)


def _renamed(name: str) -> str:
    for old, new in _RENAMES:
        if name.endswith(old):
            return name[: -len(old)] + new
    return name
