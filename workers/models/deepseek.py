"""DeepSeek-V2 and DeepSeek-V3 (and Kimi-K2, a DeepSeek-V3 config): multi-head latent attention
(workers/layers/mla.py) and a mixture of experts with grouped routing (workers/layers/
grouped_topk.py) and shared experts, dense MLPs on the first `first_k_dense_replace` layers.

The two differ only in what their configs say: V2 scores experts with a softmax (greedy or
group-limited), V3 with a sigmoid plus a correction bias (noaux_tc) and renormalises; V2 always
lays the rotary dimensions out in interleaved pairs, V3 when `rope_interleave` says so; V2 may
have no query compression (`q_lora_rank` None, V2-Lite). TP shards the attention heads (the
latent projections and the cache rows are replicated) and the experts as for every MoE family.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from workers.layers.attention import Attention, AttentionMetadata
from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from workers.layers.grouped_topk import GroupedTopK, grouped_topk
from workers.layers.linear import ColumnParallelLinear, RowParallelLinear
from workers.layers.mla import (
    KVUpProjection,
    LatentAttention,
    MLADims,
    mla_softmax_scale,
)
from workers.layers.moe import FusedMoE, MoEConfig, ReplicatedLinear
from workers.layers.norm import RMSNorm
from workers.layers.quantized import AnyWeight, load_param
from workers.layers.rotary import RotaryEmbedding
from workers.models.llama import LlamaArgs, LlamaMLP, PreNormBlock
from workers.models.moe import MoEForCausalLM
from workers.parallel import all_reduce, divide, get_tp_world_size

logger = logging.getLogger(__name__)

# The latent and query norms: transformers builds them with its RMSNorm's default epsilon.
_LATENT_NORM_EPS = 1e-6
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class GroupedMoEArgs:
    """The MoE fields DeepSeek's configs share with GLM-4-MoE's, checked: grouped routing, the
    routed experts, shared experts, dense first layers."""

    routing: GroupedTopK
    experts: MoEConfig
    shared_intermediate_size: int  # n_shared_experts * moe_intermediate_size; 0: none
    first_k_dense_replace: int

    @classmethod
    def from_hf_config(cls, config: PretrainedConfig, *, sigmoid: bool) -> GroupedMoEArgs:
        """sigmoid: the family's default when the config names no method (noaux_tc + sigmoid,
        as DeepSeek-V3 and GLM-4-MoE; else greedy softmax, as DeepSeek-V2)."""
        n = config.num_hidden_layers
        num_experts = _int_in("n_routed_experts", config, 1, 1 << 16, default=None)
        routing = GroupedTopK(
            num_experts=num_experts,
            top_k=_int_in("num_experts_per_tok", config, 1, num_experts, default=None),
            n_group=getattr(config, "n_group", None) or 1,
            topk_group=getattr(config, "topk_group", None) or 1,
            topk_method=getattr(config, "topk_method", None)
            or ("noaux_tc" if sigmoid else "greedy"),
            scoring_func=getattr(config, "scoring_func", None)
            or ("sigmoid" if sigmoid else "softmax"),
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
            routed_scaling_factor=getattr(config, "routed_scaling_factor", 1.0),
        )
        inter = _int_in("moe_intermediate_size", config, 1, 1 << 20, default=None)
        experts = MoEConfig(
            num_experts=num_experts,
            top_k=routing.top_k,
            hidden_size=config.hidden_size,
            intermediate_size=inter,
            renormalize=routing.renormalize,  # unused: grouped_topk routes
            activation=getattr(config, "hidden_act", "silu"),
        )
        shared = _int_in("n_shared_experts", config, 0, 1 << 10, default=0)
        first_dense = _int_in("first_k_dense_replace", config, 0, n, default=0)
        return cls(routing, experts, shared * inter, first_dense)


@dataclass(frozen=True, slots=True)
class DeepseekArgs:
    """The DeepSeek fields of an HF config, checked, beside the shared Llama ones."""

    mla: MLADims
    moe: GroupedMoEArgs
    rope_interleave: bool
    attention_bias: bool

    @classmethod
    def from_hf_config(cls, config: PretrainedConfig, *, family: str) -> DeepseekArgs:
        v3 = family == "deepseek_v3"
        return cls(
            mla=MLADims.from_hf_config(config),
            moe=GroupedMoEArgs.from_hf_config(config, sigmoid=v3),
            rope_interleave=bool(getattr(config, "rope_interleave", True)) if v3 else True,
            attention_bias=bool(getattr(config, "attention_bias", False)),
        )


def _int_in(name: str, config: PretrainedConfig, lo: int, hi: int, default: int | None) -> int:
    value = getattr(config, name, None)
    value = default if value is None else value
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ValueError(f"{name}: must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Interleaved rotary pairs (x0, x1), (x2, x3), ... of the last dimension as rotate-half's
    halves (x0, x2, ...), (x1, x3, ...), contiguous: applied to q and k alike, dot products are
    unchanged. One strided copy (an index gather plus the copy rotary needs cost two)."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).reshape(x.shape)


class DeepseekAttention(nn.Module):
    """MLA: query (optionally through a low-rank q_a/q_b pair), the latent and rotary key from
    kv_a_proj_with_mqa, attention over cached latents with kv_b_proj absorbed, o_proj."""

    def __init__(
        self, a: LlamaArgs, d: DeepseekArgs, rotary: RotaryEmbedding, scale: float
    ) -> None:
        super().__init__()
        m, bias = d.mla, d.attention_bias
        self.dims = m
        heads = m.num_heads * m.qk_head_dim
        self.num_heads = divide(m.num_heads, get_tp_world_size(), "num_attention_heads")
        self.q_proj: ColumnParallelLinear | None = None
        self.q_a_proj: ReplicatedLinear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: ColumnParallelLinear | None = None
        if m.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(a.hidden_size, heads)
        else:
            self.q_a_proj = ReplicatedLinear(a.hidden_size, m.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(m.q_lora_rank, heads)
        self.kv_a_proj_with_mqa = ReplicatedLinear(a.hidden_size, m.cache_width, bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = KVUpProjection(m)
        self.o_proj = RowParallelLinear(m.num_heads * m.v_head_dim, a.hidden_size, bias)
        self.rotary = rotary
        self.rope_interleave = d.rope_interleave
        self.attn = LatentAttention(self.num_heads, m, scale)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_proj is not None:
            return self.q_proj(x)
        assert self.q_a_proj and self.q_a_layernorm and self.q_b_proj  # built together
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        t, m = x.shape[0], self.dims
        q = self._query(x).view(t, self.num_heads, m.qk_head_dim)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
        latent = self.kv_a_layernorm(latent.contiguous())
        k_pe = k_pe.reshape(t, 1, m.qk_rope_head_dim)
        if self.rope_interleave:
            q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
        q_pe, k_pe = self.rotary(positions, q_pe.contiguous(), k_pe.contiguous())
        q_full = torch.cat([self.kv_b_proj.absorb_query(q_nope), q_pe], dim=-1)
        rows = torch.cat([latent, k_pe.view(t, -1)], dim=-1)
        return self.o_proj(self.kv_b_proj.expand_output(self.attn(q_full, rows, meta)))


class DeepseekGate(nn.Module):
    """The router: float32 logits (the checkpoints keep its weight in float32) and, for
    noaux_tc, the per-expert correction bias; forward returns ([T, k] weights, [T, k] ids)."""

    def __init__(self, hidden_size: int, routing: GroupedTopK) -> None:
        super().__init__()
        self.routing = routing
        e = routing.num_experts
        self.weight = nn.Parameter(
            torch.empty(e, hidden_size, dtype=torch.float32), requires_grad=False
        )
        self.e_score_correction_bias: nn.Parameter | None = None
        if routing.uses_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(e, dtype=torch.float32), requires_grad=False
            )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight)
        return grouped_topk(logits, self.routing, self.e_score_correction_bias)


class DeepseekMoE(nn.Module):
    """Grouped router, routed experts, shared experts (a dense MLP every token runs)."""

    def __init__(self, a: LlamaArgs, m: GroupedMoEArgs) -> None:
        super().__init__()
        self.gate = DeepseekGate(a.hidden_size, m.routing)
        self.experts = FusedMoE(m.experts)
        self.shared_experts = (
            LlamaMLP(a, m.shared_intermediate_size) if m.shared_intermediate_size else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        y = all_reduce(self.experts.experts(x, weights, ids))
        return y if self.shared_experts is None else y + self.shared_experts(x)


class DeepseekDecoderLayer(PreNormBlock):
    def __init__(self, a: LlamaArgs, d: DeepseekArgs, attn: DeepseekAttention, index: int) -> None:
        super().__init__()
        self.self_attn = attn
        dense = index < d.moe.first_k_dense_replace
        self.mlp: nn.Module = LlamaMLP(a) if dense else DeepseekMoE(a, d.moe)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class DeepseekModel(nn.Module):
    def __init__(self, a: LlamaArgs, d: DeepseekArgs) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(a.vocab_size, a.hidden_size)
        rotary = RotaryEmbedding(d.mla.qk_rope_head_dim, a.max_position, a.rope_parameters)
        scale = mla_softmax_scale(d.mla, a.rope_parameters)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(a, d, DeepseekAttention(a, d, rotary, scale), i)
            for i in range(a.num_layers)
        )
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class DeepseekForCausalLM(MoEForCausalLM):
    """The DeepSeek decoder with the MoE families' expert loading and load reporting."""

    family = ""

    def __init__(self, config: PretrainedConfig, max_model_len: int | None = None) -> None:
        # The Llama base's constructor builds Llama layers; this family builds its own, so it
        # starts from nn.Module and sets what the inherited methods read (args, model, lm_head).
        nn.Module.__init__(self)
        self.args = LlamaArgs.from_hf_config(config)
        if max_model_len is not None:
            self.args.max_position = min(self.args.max_position, max_model_len)
        self.deepseek = DeepseekArgs.from_hf_config(config, family=self.family)
        self.model = DeepseekModel(self.args, self.deepseek)  # type: ignore[assignment]
        self.lm_head = ParallelLMHead(self.args.vocab_size, self.args.hidden_size)
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # type: ignore[assignment]

    def make_mlp(self, layer: int) -> nn.Module | None:
        raise NotImplementedError("DeepseekModel builds its own feed-forward blocks")

    def attention_layers(self) -> list[Attention]:
        return [block.attn for block in self.mla_blocks()]

    def mla_blocks(self) -> list[DeepseekAttention]:
        return [m for m in self.model.modules() if isinstance(m, DeepseekAttention)]

    def load_weights(self, weights: Iterable[tuple[str, AnyWeight]]) -> set[str]:
        """Attention tensors go straight to their parameters (their names would otherwise meet
        the Llama q/k/v fusion); experts and the rest load as for the other MoE families. MTP
        layers (indices past num_hidden_layers) are skipped: they are not part of this model."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def rest() -> Iterator[tuple[str, AnyWeight]]:
            for name, tensor in without_mtp_layers(weights, self.args.num_layers):
                if ".self_attn." in name:
                    _load_direct(params, name, tensor, type(self).__name__)
                    loaded.add(name)
                else:
                    yield name, tensor

        loaded |= super().load_weights(rest())
        return loaded


def without_mtp_layers(
    weights: Iterable[tuple[str, AnyWeight]], num_layers: int
) -> Iterator[tuple[str, AnyWeight]]:
    """The checkpoint's tensors but those of layers past num_hidden_layers: multi-token
    prediction layers (DeepSeek-V3, GLM-4.5), not part of the model that generates."""
    skipped = 0
    for name, tensor in weights:
        hit = _LAYER.match(name)
        if hit and int(hit.group(1)) >= num_layers:
            skipped += 1
        else:
            yield name, tensor
    if skipped:
        logger.info("%d tensors of layers past num_hidden_layers (MTP) skipped", skipped)


def _load_direct(params: dict[str, nn.Parameter], name: str, tensor: AnyWeight, cls: str) -> None:
    param = params.get(name)
    if param is None:
        raise ValueError(f"weights: checkpoint tensor {name!r} has no parameter in {cls}")
    load_param(param, tensor, None, name)


class DeepseekV2ForCausalLM(DeepseekForCausalLM):
    """DeepSeek-V2 (and V2-Lite): softmax routing, greedy or group-limited; interleaved rope."""

    family = "deepseek_v2"


class DeepseekV3ForCausalLM(DeepseekForCausalLM):
    """DeepSeek-V3 / R1 and Kimi-K2: sigmoid routing with a correction bias (noaux_tc)."""

    family = "deepseek_v3"
