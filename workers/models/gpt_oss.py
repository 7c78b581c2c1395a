"""gpt-oss (bf16 or fp32 checkpoints): the Llama decoder with every feed-forward a mixture of
experts, read from the HF config.

- attention: biases on q/k/v/o, a learned sink logit per head in the softmax's denominator
  (applied in the attention backends), a 128-token window on the layers `layer_types` marks
  "sliding_attention" and full attention on the others, yarn rope;
- experts: a router with a bias; top-k of its logits, then softmax over those k; each expert a
  clamped SwiGLU ((up + 1) * gate * sigmoid(alpha * gate), gate <= limit, |up| <= limit) with
  biases on both matrices.

Checkpoint layout (transformers' and OpenAI's bf16 one): `mlp.experts.gate_up_proj`
[experts, hidden, 2 x intermediate] with gate and up interleaved column by column, its bias
[experts, 2 x intermediate] likewise, `mlp.experts.down_proj` [experts, intermediate, hidden]
(the transpose of a linear's weight), `mlp.router.{weight,bias}`, `self_attn.sinks`. MXFP4
checkpoints (`*_blocks`, `*_scales`) are refused.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from workers.layers.moe import FusedMoE, MoEConfig, ReplicatedLinear
from workers.layers.param_attrs import set_param_attr
from workers.layers.quantized import AnyWeight, float_only
from workers.models.llama import LlamaForCausalLM
from workers.models.moe import MoEForCausalLM
from workers.parallel import get_tp_rank

# layer prefix, projection, "_bias" or ""
_EXPERTS = re.compile(r"^(.*\.)mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")


def moe_config_of(config: PretrainedConfig) -> MoEConfig:
    if getattr(config, "quantization_config", None):
        raise ValueError(
            "quantization_config: quantized gpt-oss checkpoints (MXFP4) are not supported yet; "
            "use a bf16 checkpoint"
        )
    return MoEConfig(
        num_experts=config.num_local_experts,
        top_k=config.num_experts_per_tok,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        renormalize=False,
        activation="clamped_swiglu",
        scoring="topk_softmax",
        bias=True,
        swiglu_alpha=getattr(config, "swiglu_alpha", 1.702),
        swiglu_limit=getattr(config, "swiglu_limit", 7.0),
    )


class GptOssMoeBlock(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.router = ReplicatedLinear(cfg.hidden_size, cfg.num_experts, bias=True)
        self.experts = FusedMoE(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))


class GptOssForCausalLM(MoEForCausalLM):
    """gpt-oss-20b / -120b shapes; every layer sparse."""

    def __init__(self, config: PretrainedConfig, max_model_len: int | None = None) -> None:
        self.experts_cfg = moe_config_of(config)
        LlamaForCausalLM.__init__(self, config, max_model_len)  # MoEForCausalLM reads MoEArgs
        for attn in self.attention_blocks():
            attn.sinks = nn.Parameter(torch.empty(attn.qkv_proj.num_heads), requires_grad=False)
            set_param_attr(attn.sinks, "weight_loader", _load_sinks)

    def make_mlp(self, layer: int) -> nn.Module | None:
        return GptOssMoeBlock(self.experts_cfg)

    def load_weights(self, weights: Iterable[tuple[str, AnyWeight]]) -> set[str]:
        loaded: set[str] = set()
        modules = dict(self.named_modules())

        def others(items: Iterable[tuple[str, AnyWeight]]) -> Iterator[tuple[str, AnyWeight]]:
            for name, tensor in items:
                if name.endswith(("_blocks", "_scales")):
                    raise ValueError(
                        f"weights: {name!r} is MXFP4, not supported yet; use a bf16 checkpoint"
                    )
                hit = _EXPERTS.match(name)
                if hit is None:
                    yield name, tensor
                    continue
                prefix, proj, bias = hit.group(1), hit.group(2), hit.group(3) or ""
                experts = self._experts_of(modules, prefix, name)
                _load_experts(experts, proj, bool(bias), float_only(tensor, name))
                ours = ("w13" if proj == "gate_up_proj" else "w2") + bias
                loaded.add(f"{prefix}mlp.experts.{ours}")

        return loaded | super().load_weights(others(weights))


def _load_experts(experts: FusedMoE, proj: str, bias: bool, tensor: torch.Tensor) -> None:
    """One checkpoint tensor of every expert into this rank's share (see the module docstring
    for the layout)."""
    n = experts.cfg.num_experts
    if tensor.shape[0] != n:
        raise ValueError(f"{proj}: has {tensor.shape[0]} experts, num_experts={n}")
    whole = tensor.narrow(0, 0, n)
    for e in range(experts.first, experts.first + experts.num_local):
        w = whole[e]
        if proj == "down_proj":
            experts.load_expert(e, "down_bias" if bias else "down", w if bias else w.t())
        elif bias:
            experts.load_expert(e, "gate_bias", w[0::2])
            experts.load_expert(e, "up_bias", w[1::2])
        else:
            experts.load_expert(e, "gate", w[:, 0::2].t())
            experts.load_expert(e, "up", w[:, 1::2].t())


def _load_sinks(
    param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None
) -> None:
    """This rank's heads' sinks: query heads split evenly, in order."""
    n = param.shape[0]
    start = get_tp_rank() * n
    if loaded.shape[0] < start + n:
        raise ValueError(f"sinks: checkpoint has {loaded.shape[0]} heads, expected more")
    param.data.copy_(loaded.narrow(0, start, n))
