"""What a decode step costs each part of a model, from its (text) config alone: the weights it
reads, in parameters. The default pipeline split (workers/pipeline_split.py) balances the stages
by these figures.

Why weights: a decode step reads every weight of the layers it runs once per step, and on a GPU
(and at batch 1 on a CPU) that read is the step's time. So a decoder layer costs its attention (or
linear-attention / Mamba mixer) and MLP weights, and the last stage's LM head costs vocab x hidden
(tied or not: with tied embeddings the last stage holds a copy of its own), plus a vocabulary row
for sampling. The first stage's embedding reads one row per token. A MoE layer counts every
expert: a served batch of tens of tokens routes to nearly all of them, so a step reads them all
(and the stages' weight memory comes out balanced too). Per-layer sizes follow the config where
the layers differ: dense layers before `first_k_dense_replace`, `mlp_only_layers` and
`decoder_sparse_step` (Qwen2-MoE, DeepSeek), and `layer_types` mixers in hybrids.

Beside its weights a layer runs about twenty operations that are not its matrix products (norms,
rotary, attention, activation, residual adds), each a dispatch: LAYER_OVERHEAD counts them as
weights read. Where layers are large (billions of parameters) it is noise; where they are small
it decides the split: on the 2-core CPU, SmolLM2 fp32 at 8-16 tokens a step, the LM head and
sampling take 4.3-6.4 layers' CPU time against the 8.0 layers its weights say
(bench/results/2026-11-29-pipeline-microbatch.md), so the stages even out at 18, 12 where
weights alone give 19, 11. A GPU running stages without CUDA graphs pays more a dispatch, so there
the term errs small, in the same direction.

Not counted: the attention's KV read (it grows with the context and the batch, which no config
says).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from settings import shown
from workers.pipeline_split import StageCosts

# A bound for any one width read from a config (the widest real ones are ~2^18: vocabularies).
MAX_WIDTH = 1 << 24
# What a decoder layer costs beyond its weight matrices, in weights read (module docstring): from
# the CPU's 4.3-6.4 layers for SmolLM2's head, 28.4 M / (3.54 M + 1.5 M) = 5.6.
LAYER_OVERHEAD = 1_500_000


def decode_costs(config: PretrainedConfig) -> StageCosts:
    """Each decoder layer's weight matrices (its norms' vectors are noise beside them) and
    LAYER_OVERHEAD, the first stage's embedding row and the last stage's final norm, LM head and
    sampling row, in parameters read per decode step."""
    n = _width(config, "num_hidden_layers")
    hidden = _width(config, "hidden_size")
    vocab = _width(config, "vocab_size")
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * n
    if len(kinds) != n:
        raise ValueError(f"layer_types: needs one entry per layer ({n}), got {shown(kinds)}")
    layers = tuple(
        _mixer(config, kind) + _mlp(config, i) + LAYER_OVERHEAD for i, kind in enumerate(kinds)
    )
    return StageCosts(layers, first=hidden, last=vocab * hidden + vocab + hidden)


def _width(config: PretrainedConfig, name: str, default: int | None = None) -> int:
    """A config size in [0, MAX_WIDTH] (absent or null: default), or a ValueError naming it."""
    value = getattr(config, name, None)
    if value is None and default is not None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_WIDTH:
        raise ValueError(f"{name}: must be an integer in [0, {MAX_WIDTH}], got {shown(value)}")
    return value


def _mixer(config: PretrainedConfig, kind: str) -> int:
    """A layer's token mixer: softmax attention (MLA where the config has a KV latent), or the
    linear mixer a hybrid's `layer_types` names (Qwen3-Next's DeltaNet, Granite's Mamba-2)."""
    if kind in ("linear_attention", "mamba"):
        if getattr(config, "linear_num_key_heads", None) is not None:
            return _delta_net(config)
        return _mamba(config)
    if getattr(config, "kv_lora_rank", None) is not None:
        return _mla(config)
    return _attention(config)


def _attention(config: PretrainedConfig) -> int:
    hidden = _width(config, "hidden_size")
    heads = _width(config, "num_attention_heads")
    kv_heads = _width(config, "num_key_value_heads", heads)
    head_dim = _width(config, "head_dim", hidden // max(heads, 1))
    # Qwen3-Next's query projection also yields a per-head output gate (models/qwen3_next.py).
    q_heads = 2 * heads if getattr(config, "model_type", None) == "qwen3_next" else heads
    return hidden * head_dim * (q_heads + 2 * kv_heads + heads)


def _mla(config: PretrainedConfig) -> int:
    """DeepSeek's multi-head latent attention (workers/layers/mla.py)."""
    hidden, heads = _width(config, "hidden_size"), _width(config, "num_attention_heads")
    rope, nope = _width(config, "qk_rope_head_dim"), _width(config, "qk_nope_head_dim")
    latent, v_dim = _width(config, "kv_lora_rank"), _width(config, "v_head_dim")
    q_rank = _width(config, "q_lora_rank", 0)
    q = heads * (rope + nope) * (q_rank if q_rank else hidden) + hidden * q_rank
    return q + hidden * (latent + rope) + latent * heads * (nope + v_dim) + heads * v_dim * hidden


def _delta_net(config: PretrainedConfig) -> int:
    """Qwen3-Next's gated DeltaNet (workers/layers/gated_delta.py)."""
    hidden = _width(config, "hidden_size")
    keys = _width(config, "linear_num_key_heads") * _width(config, "linear_key_head_dim")
    v_heads = _width(config, "linear_num_value_heads")
    values = v_heads * _width(config, "linear_value_head_dim")
    conv = (2 * keys + values) * _width(config, "linear_conv_kernel_dim")
    return hidden * (2 * keys + 2 * values + 2 * v_heads) + conv + values * hidden


def _mamba(config: PretrainedConfig) -> int:
    """Granite-4's Mamba-2 mixer (workers/layers/mamba2.py)."""
    hidden, heads = _width(config, "hidden_size"), _width(config, "mamba_n_heads")
    inner = heads * _width(config, "mamba_d_head")
    conv_dim = inner + 2 * _width(config, "mamba_n_groups") * _width(config, "mamba_d_state")
    conv = conv_dim * _width(config, "mamba_d_conv")
    return hidden * (inner + conv_dim + heads) + conv + inner * hidden


def _mlp(config: PretrainedConfig, layer: int) -> int:
    """A gated MLP (gate, up, down), or on a sparse layer every expert, the router and any shared
    expert (with Qwen's sigmoid gate for it)."""
    hidden = _width(config, "hidden_size")
    experts = max(
        _width(config, name, 0) for name in ("num_local_experts", "num_experts", "n_routed_experts")
    )
    if not experts or not _sparse(config, layer):
        return 3 * hidden * _width(config, "intermediate_size")
    inner = _width(config, "moe_intermediate_size", 0) or _width(config, "intermediate_size")
    gated = _width(config, "shared_expert_intermediate_size", 0)
    shared = (
        gated
        or _width(config, "n_shared_experts", 0) * inner
        or _width(config, "shared_intermediate_size", 0)
    )
    return 3 * hidden * (experts * inner + shared) + hidden * (experts + bool(gated))


def _sparse(config: PretrainedConfig, layer: int) -> bool:
    """Whether a MoE config's layer runs experts (the rules of workers/models/moe.py and
    deepseek.py: dense before first_k_dense_replace, in mlp_only_layers, and off the
    decoder_sparse_step rhythm)."""
    step = _width(config, "decoder_sparse_step", 1) or 1
    dense = getattr(config, "mlp_only_layers", None) or ()
    return (
        layer >= _width(config, "first_k_dense_replace", 0)
        and layer not in dense
        and (layer + 1) % step == 0
    )
