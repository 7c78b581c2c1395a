"""The mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE): the Llama decoder with a sparse
MoE block in place of the dense MLP on some or all layers.

Variants differ by flags read from the HF config, as in workers/models/llama.py: Mixtral always
renormalises the top-k weights; Qwen renormalises when `norm_topk_prob` says so, keeps dense MLPs on
`mlp_only_layers` and off the `decoder_sparse_step` rhythm, and Qwen2-MoE adds a shared expert
scaled by a sigmoid gate. Attention is Llama's (q/k/v bias for Qwen2-MoE, q/k norm for Qwen3-MoE).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from workers.layers.moe import FusedMoE, MoEConfig, ReplicatedLinear
from workers.layers.quantized import AnyWeight, float_only
from workers.models.llama import LlamaArgs, LlamaForCausalLM, LlamaMLP


@dataclass(frozen=True, slots=True)
class MoEArgs:
    """The MoE fields of an HF config, normalised across families."""

    experts: MoEConfig
    shared_intermediate_size: int  # 0: no shared expert
    sparse_layers: frozenset[int]

    @classmethod
    def from_hf_config(cls, config: PretrainedConfig, *, family: str) -> MoEArgs:
        n = config.num_hidden_layers
        if family == "mixtral":
            experts = MoEConfig(
                num_experts=config.num_local_experts,
                top_k=config.num_experts_per_tok,
                hidden_size=config.hidden_size,
                intermediate_size=config.intermediate_size,
                renormalize=True,
                activation=getattr(config, "hidden_act", "silu"),
            )
            return cls(experts, 0, frozenset(range(n)))
        experts = MoEConfig(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
            activation=getattr(config, "hidden_act", "silu"),
        )
        step = getattr(config, "decoder_sparse_step", 1) or 1
        if not isinstance(step, int) or step < 1:
            raise ValueError(f"decoder_sparse_step: must be a positive integer, got {step!r}")
        dense = set(getattr(config, "mlp_only_layers", None) or [])
        sparse = frozenset(i for i in range(n) if i not in dense and (i + 1) % step == 0)
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        return cls(experts, shared if family == "qwen2_moe" else 0, sparse)


class SparseMoeBlock(nn.Module):
    """Router, experts and (Qwen2-MoE) a shared expert whose output is scaled by sigmoid(gate)."""

    def __init__(self, a: LlamaArgs, m: MoEArgs) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(a.hidden_size, m.experts.num_experts)
        self.experts = FusedMoE(m.experts)
        if m.shared_intermediate_size:
            self.shared_expert: LlamaMLP | None = LlamaMLP(a, m.shared_intermediate_size)
            self.shared_expert_gate: ReplicatedLinear | None = ReplicatedLinear(a.hidden_size, 1)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.experts(x, self.gate(x))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y


# Per-expert checkpoint matrices: (layer prefix, expert, projection). Mixtral calls them w1 (gate),
# w3 (up) and w2 (down) under block_sparse_moe; Qwen gate_proj / up_proj / down_proj under mlp.
_EXPERT = re.compile(r"^(.*\.)(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
# All experts in one 3-D tensor (transformers' in-memory layout): gate_up_proj or down_proj.
_FUSED = re.compile(r"^(.*\.)(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)$")
_PARTS = {
    "w1": "gate",
    "w3": "up",
    "w2": "down",
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
}


class MoEForCausalLM(LlamaForCausalLM):
    """A Llama decoder whose `sparse_layers` run a SparseMoeBlock; family is set by subclasses."""

    family = ""

    def __init__(self, config: PretrainedConfig, max_model_len: int | None = None) -> None:
        # Read before the base class builds the layers, which asks make_mlp for each one.
        self.moe = MoEArgs.from_hf_config(config, family=self.family)
        super().__init__(config, max_model_len)

    def make_mlp(self, layer: int) -> nn.Module | None:
        return SparseMoeBlock(self.args, self.moe) if layer in self.moe.sparse_layers else None

    def moe_blocks(self) -> list[FusedMoE]:
        return [m for m in self.modules() if isinstance(m, FusedMoE)]

    def expert_rows_per_rank(self) -> list[int]:
        """(token, expert) rows each rank of the group computed in the last forward, summed over
        layers: the expert-parallel load balance (every rank computes the same figures); empty
        for a model whose layers are all dense (a hybrid's `mlp_only_layers`, say)."""
        blocks = self.moe_blocks()
        if not blocks:
            return []
        return [
            sum(b.rows_per_rank[r] for b in blocks) for r in range(len(blocks[0].rows_per_rank))
        ]

    def load_weights(self, weights: Iterable[tuple[str, AnyWeight]]) -> set[str]:
        loaded: set[str] = set()
        modules = dict(self.named_modules())

        def dense(items: Iterable[tuple[str, AnyWeight]]) -> Iterator[tuple[str, AnyWeight]]:
            for name, tensor in items:
                name = name.replace(".block_sparse_moe.", ".mlp.")
                if (hit := _EXPERT.match(name)) and hit.group(3) in _PARTS:
                    prefix, expert, part = hit.group(1), int(hit.group(2)), _PARTS[hit.group(3)]
                    self._experts_of(modules, prefix, name).load_expert(
                        expert, part, float_only(tensor, name)
                    )
                    loaded.update({f"{prefix}mlp.experts.w13", f"{prefix}mlp.experts.w2"})
                elif hit := _FUSED.match(name):
                    self._experts_of(modules, hit.group(1), name).load_fused(
                        hit.group(2), float_only(tensor, name)
                    )
                    loaded.add(f"{hit.group(1)}mlp.experts." + ("w2" if "down" in name else "w13"))
                else:
                    yield name, tensor

        return loaded | super().load_weights(dense(weights))

    def _experts_of(self, modules: dict[str, nn.Module], prefix: str, name: str) -> FusedMoE:
        experts = modules.get(f"{prefix}mlp.experts")
        if not isinstance(experts, FusedMoE):
            raise ValueError(
                f"weights: checkpoint tensor {name!r} has no parameter in {type(self).__name__}"
            )
        return experts


class MixtralForCausalLM(MoEForCausalLM):
    """Mixtral: every layer sparse, top-k weights renormalised."""

    family = "mixtral"


class Qwen2MoeForCausalLM(MoEForCausalLM):
    """Qwen2-MoE: q/k/v bias, a sigmoid-gated shared expert beside the routed ones."""

    family = "qwen2_moe"
    qkv_bias = True


class Qwen3MoeForCausalLM(MoEForCausalLM):
    """Qwen3-MoE: q/k RMSNorm, no shared expert."""

    family = "qwen3_moe"
    qk_norm = True
