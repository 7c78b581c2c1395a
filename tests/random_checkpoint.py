"""Random-weight checkpoints: the one writer of every model the tests and benchmarks make up.

A `ModelSpec` names a transformers config and how its weights are drawn; `write_random_checkpoint`
saves config.json + safetensors + a tokenizer into a directory, which then loads through the
normal code paths. The tiny specs keep the CPU tests fast; the published shapes exist because the
GPU machine has no hub access and no room for real weights.

Greedy-token tests depend on the exact weights: a spec, its seed and the order of the draws below
fix them, so change none of them without rerunning the tests that load the model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

BOS_ID, EOS_ID = 1, 2


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model to draw at random.

    Transformers' own initialisation gives nearly flat logits, so greedy choices are decided by
    rounding. A trained model's logits are far apart; `matrix_std` and `head_std` redraw the
    weights to get there.
    """

    config_class: str  # a transformers config class, e.g. "LlamaConfig"
    fields: dict[str, Any] = field(default_factory=dict)
    matrix_std: float | None = None  # every 2-D (and 3-D expert) weight ~ N(0, std), in order
    head_std: float | None = None  # then the LM head ~ N(0, std)
    # then every 1-D weight (norms, biases, sinks) ~ N(0, std); None: transformers' own values
    vector_std: float | None = None
    # then every floating buffer saved with the weights (DeepSeek-V3's e_score_correction_bias)
    buffer_std: float | None = None
    dtype: torch.dtype = torch.float32
    max_shard_size: str = "5GB"  # smaller than the weights: shards and an index

    def with_fields(self, **fields: Any) -> ModelSpec:
        return dataclasses.replace(self, fields={**self.fields, **fields})


@dataclass(frozen=True, slots=True)
class RandomCheckpoint:
    """Where a random checkpoint lives and what it is."""

    path: str
    vocab_size: int


# Two layers, four query heads over two KV heads: tensor parallelism at 2 splits the KV heads and
# at 4 replicates them.
_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


def _tiny(config_class: str, **fields: Any) -> ModelSpec:
    """A tiny model with sharp logits: greedy decoding is decided by clear margins."""
    return ModelSpec(config_class, {**_TINY, **fields}, matrix_std=0.15, head_std=0.6)


# One per model family the loader knows, each with what sets it apart.
TINY_FAMILIES: dict[str, ModelSpec] = {
    # Llama 3 with llama3 rope scaling, untied head, bias-free.
    "llama": _tiny(
        "LlamaConfig",
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
    ),
    # Qwen2: qkv bias, tied embeddings; saved in shards with an index.
    "qwen2": dataclasses.replace(
        _tiny("Qwen2Config", tie_word_embeddings=True), max_shard_size="2MB"
    ),
    # Qwen3: q/k RMSNorm, head_dim not hidden/heads.
    "qwen3": _tiny("Qwen3Config", head_dim=32, tie_word_embeddings=False),
    "mistral": _tiny("MistralConfig", sliding_window=None, head_dim=16, tie_word_embeddings=False),
    # One KV head: tensor parallelism must replicate it.
    "llama_mqa": _tiny(
        "LlamaConfig", num_key_value_heads=1, attention_bias=True, tie_word_embeddings=False
    ),
}

# Mixtures of experts: 8 experts, top-2 and top-4, a shared expert where the family has one.
TINY_MOE_FAMILIES: dict[str, ModelSpec] = {
    # Mixtral: every layer sparse, top-2 renormalised; intermediate_size is per expert.
    "mixtral": _tiny(
        "MixtralConfig",
        num_local_experts=8,
        num_experts_per_tok=2,
        intermediate_size=64,
        sliding_window=None,
        tie_word_embeddings=False,
    ),
    # Qwen2-MoE: top-4 without renormalisation, a gated shared expert, q/k/v bias, and a dense
    # MLP on layer 1 (mlp_only_layers).
    "qwen2_moe": _tiny(
        "Qwen2MoeConfig",
        num_hidden_layers=3,
        num_experts=8,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=96,
        mlp_only_layers=[1],
        norm_topk_prob=False,
        tie_word_embeddings=False,
    ),
    # Qwen3-MoE: top-2 renormalised (norm_topk_prob), q/k RMSNorm, head_dim not hidden/heads.
    "qwen3_moe": _tiny(
        "Qwen3MoeConfig",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        head_dim=32,
        tie_word_embeddings=False,
    ),
}

# Phi-3: q/k/v and gate/up fused in the checkpoint.
TINY_PHI3 = _tiny("Phi3Config", pad_token_id=0, tie_word_embeddings=False)

# Phi-3 with LongRoPE stretched from 32 to 512 positions: prompts of 45 and 70 tokens run long
# from the start, shorter ones cross 32 while decoding.
TINY_PHI3_LONGROPE = TINY_PHI3.with_fields(
    original_max_position_embeddings=32,
    rope_parameters={
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.05 * i for i in range(8)],
        "long_factor": [1.5 + 0.5 * i for i in range(8)],
    },
)

# Gemma 2 and 3 (text): a 24-token window on layer 0, a global layer 1, head_dim 32 (the CPU
# decode kernel's size) wider than hidden / heads, query_pre_attn_scalar not head_dim, random
# norm weights (Gemma scales by 1 + weight), an untied head (tied, the sqrt(hidden)-scaled
# embeddings make every token repeat itself). Gemma 2 caps attention scores at 3
# (most scores of these weights bend) and the logits at 8; Gemma 3 has q/k norms and a linear
# rope scaling on its global layer, another base on its local one.
TINY_GEMMA: dict[str, ModelSpec] = {
    "gemma2": dataclasses.replace(
        _tiny(
            "Gemma2Config",
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=24,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=8.0,
            tie_word_embeddings=False,
        ),
        vector_std=0.3,
    ),
    "gemma3": dataclasses.replace(
        _tiny(
            "Gemma3TextConfig",
            head_dim=32,
            query_pre_attn_scalar=48,
            sliding_window=24,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            },
            tie_word_embeddings=False,
        ),
        vector_std=0.3,
    ),
}

# gpt-oss: 8 experts top-2 (top-k of the router logits, then softmax), a 24-token window on layer
# 0 and full attention on layer 1, head_dim 32, yarn rope; random sinks, router and expert biases
# (vector_std). The SwiGLU limit is lowered to 1.5 so that these weights reach it.
TINY_GPT_OSS = dataclasses.replace(
    _tiny(
        "GptOssConfig",
        head_dim=32,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=24,
        swiglu_limit=1.5,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 128,
            "truncate": False,
        },
        tie_word_embeddings=False,
    ),
    vector_std=0.5,
)

# A 24-token sliding window on every layer: prompts of 30-60 tokens reach well past it.
TINY_SLIDING_MISTRAL = _tiny(
    "MistralConfig", sliding_window=24, head_dim=32, tie_word_embeddings=False
)

# The MoE tensor/expert-parallel tests' model: 12 heads, 48-wide experts and a 96-wide shared
# expert split at 2, 3 and 4 ranks; 8 experts split by 2 and 4 (and unevenly by 3).
TINY_TP_MOE = _tiny(
    "Qwen2MoeConfig",
    num_attention_heads=12,
    num_key_value_heads=12,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=48,
    shared_expert_intermediate_size=96,
    vocab_size=250,
    tie_word_embeddings=False,
)

# DeepSeek MLA: 4 heads of qk 16 + 16 (nope + rope) and v 24, a 48-wide latent (cache rows of
# 48 + 16 = 64, a size the CPU decode kernel compiles), a dense layer 0 then MoE layers of 8
# experts in 4 groups (top-k from the 2 best groups), shared experts, YaRN with DeepSeek's mscale.
# V2 is V2-Lite-shaped (no query compression, softmax group-limited routing, interleaved rope);
# V3 compresses queries (q_lora_rank), routes by sigmoid + a random correction bias (noaux_tc,
# renormalised, scaled by 2.5) and keeps rope_interleave.
_MLA = dict(
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=48,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=24,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    tie_word_embeddings=False,
)
_DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}
TINY_DEEPSEEK: dict[str, ModelSpec] = {
    "deepseek_v2": _tiny(
        "DeepseekV2Config",
        # top-3 of the 2 best groups: the limit can turn the third best expert away
        **{**_MLA, "num_experts_per_tok": 3},
        q_lora_rank=None,
        topk_method="group_limited_greedy",
        n_shared_experts=2,
        routed_scaling_factor=1.5,
        rope_parameters={**_DEEPSEEK_YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
    ),
    "deepseek_v3": dataclasses.replace(
        _tiny(
            "DeepseekV3Config",
            **_MLA,
            q_lora_rank=32,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            rope_parameters={**_DEEPSEEK_YARN, "mscale": 1.0, "mscale_all_dim": 1.0},
        ),
        buffer_std=0.5,
    ),
}

# GLM-4-MoE: rotary on half of each 16-wide head, q/k/v bias and q/k norms, and DeepSeek-V3's
# MoE block (8 experts in 4 groups, top-2 from the 2 best, sigmoid + a random correction bias,
# renormalised, scaled by 2.5, a shared expert) after a dense first layer.
TINY_GLM4_MOE = dataclasses.replace(
    _tiny(
        "Glm4MoeConfig",
        num_hidden_layers=3,
        head_dim=16,
        attention_bias=True,
        use_qk_norm=True,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    ),
    buffer_std=0.5,
)

# The model the serving tests put behind HTTP: a tied Llama left at transformers' initialisation.
TINY_SERVED_LLAMA = ModelSpec("LlamaConfig", {**_TINY, "tie_word_embeddings": True})

# The tensor-parallel tests' model: a vocabulary of 250 that no TP degree divides evenly.
TINY_TP_LLAMA = ModelSpec(
    "LlamaConfig", {**_TINY, "vocab_size": 250, "tie_word_embeddings": False}, matrix_std=0.15
)


def _published(config_class: str, **fields: Any) -> ModelSpec:
    """A published shape in bf16, its LM head rescaled so that logits have a standard deviation
    of about 4, as in a trained model."""
    head_std = 4.0 / fields["hidden_size"] ** 0.5
    return ModelSpec(config_class, fields, head_std=head_std, dtype=torch.bfloat16)


# Published shapes (random weights): Llama 3.2 1B (GQA 32/8), Qwen3 0.6B (q/k norm, head_dim 128),
# SmolLM2-135M.
SHAPES: dict[str, ModelSpec] = {
    "llama3-1b": _published(
        "LlamaConfig",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "qwen3-0.6b": _published(
        "Qwen3Config",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    ),
    # SmolLM2-135M (the embedded default model): what `sim calibrate --random-shape` times on a GPU.
    "smollm2-135m": _published(
        "LlamaConfig",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    ),
}


def write_random_checkpoint(
    spec: ModelSpec, path: str, *, seed: int = 0, tokenizer: Any = None, device: str = "cpu"
) -> RandomCheckpoint:
    """Draw `spec`'s weights from `seed` on `device` and save them with a tokenizer into `path`.

    `tokenizer` (a transformers tokenizer) is saved as it is and sets the vocabulary size unless
    the spec does; without one, a word-level tokenizer covers the whole vocabulary (every id
    decodes). The seed is for `device`'s generator: the same spec drawn on a GPU differs.
    """
    import transformers
    from transformers import AutoModelForCausalLM

    fields = dict(spec.fields)
    if tokenizer is not None:
        fields.setdefault("vocab_size", len(tokenizer))
    config = getattr(transformers, spec.config_class)(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, **fields
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=spec.dtype).eval()
    with torch.no_grad():
        if spec.matrix_std is not None:
            for p in model.parameters():
                if p.dim() >= 2:  # 3-D: transformers holds a layer's experts in one tensor
                    p.normal_(0.0, spec.matrix_std)
        if spec.head_std is not None:
            model.get_output_embeddings().weight.normal_(0.0, spec.head_std)
        if spec.vector_std is not None:
            for p in model.parameters():
                if p.dim() == 1:
                    p.normal_(0.0, spec.vector_std)
        if spec.buffer_std is not None:
            saved = model.state_dict()
            for name, b in model.named_buffers():
                if name in saved and b.is_floating_point():
                    b.normal_(0.0, spec.buffer_std)
    model.save_pretrained(path, max_shard_size=spec.max_shard_size)
    if tokenizer is None:
        write_word_tokenizer(path, config.vocab_size)
    else:
        tokenizer.save_pretrained(path)
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return RandomCheckpoint(path, config.vocab_size)


def write_word_tokenizer(path: str, vocab_size: int) -> None:
    """A whitespace word-level tokenizer whose vocabulary is exactly the model's ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": BOS_ID, "</s>": EOS_ID}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(path)


def random_prompts(
    num: int, vocab_size: int, min_len: int, max_len: int, seed: int = 0
) -> list[list[int]]:
    """`num` prompts of random token ids (specials excluded), lengths uniform in [min_len,
    max_len]."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num,), generator=gen).tolist()
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths]
