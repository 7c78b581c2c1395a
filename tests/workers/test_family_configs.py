"""Gemma and gpt-oss configs that cannot be served fail at construction, naming the field."""

from __future__ import annotations

import pytest
import torch
import transformers

from workers.models import model_class

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=300,
    max_position_embeddings=64,
)


def gemma2(**fields) -> transformers.Gemma2Config:
    return transformers.Gemma2Config(**{**TINY, **fields})


def gpt_oss(**fields) -> transformers.GptOssConfig:
    experts = {"intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2}
    return transformers.GptOssConfig(**{**TINY, **experts, **fields})


def test_the_architectures_are_registered():
    assert model_class(gemma2(architectures=["Gemma2ForCausalLM"])).__name__ == "Gemma2ForCausalLM"
    text = transformers.Gemma3TextConfig(**TINY)  # no architectures: found by model_type
    assert model_class(text).__name__ == "Gemma3ForCausalLM"
    assert model_class(gpt_oss()).__name__ == "GptOssForCausalLM"


@pytest.mark.parametrize(
    "field,value",
    [
        ("hidden_activation", "relu"),
        ("final_logit_softcapping", -1.0),
        ("final_logit_softcapping", float("nan")),
        ("attn_logit_softcapping", 0.0),
        ("query_pre_attn_scalar", -4),
    ],
)
def test_bad_fields_raise_value_error_naming_them(field, value):
    config = gemma2()
    setattr(config, field, value)  # set after construction: transformers validates some itself
    with pytest.raises(ValueError, match=field):
        model_class(config)(config)


@pytest.mark.parametrize(
    "field,value",
    [
        ("swiglu_limit", -1.0),
        ("swiglu_alpha", float("nan")),
        ("num_experts_per_tok", 5),
        ("quantization_config", {"quant_method": "mxfp4"}),
    ],
)
def test_bad_gpt_oss_fields_raise_value_error_naming_them(field, value):
    config = gpt_oss()
    setattr(config, field, value)
    with pytest.raises(ValueError, match=field):
        model_class(config)(config)


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_rope_matches_transformers(truncate):
    """gpt-oss's yarn: the inverse frequencies and the factor on cos/sin, as transformers computes
    them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from workers.layers.rotary import rope_attention_factor, rope_inv_freq

    rope = {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 4096,
        "truncate": truncate,
    }
    config = gpt_oss(head_dim=64, rope_parameters=dict(rope))
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config, None)
    assert torch.equal(rope_inv_freq(64, rope), inv_freq)
    assert rope_attention_factor(rope) == pytest.approx(factor, rel=1e-12)


def phi3_longrope() -> transformers.Phi3Config:
    fields = {k: v for k, v in TINY.items() if k != "head_dim"}
    return transformers.Phi3Config(
        **fields,
        original_max_position_embeddings=16,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0] * 8,
            "long_factor": [2.0] * 8,
        },
    )


@pytest.mark.parametrize(
    "key,value",
    [
        ("short_factor", [1.0] * 7),
        ("long_factor", [1.0] * 7 + [float("nan")]),
        ("long_factor", [1.0] * 7 + [-2.0]),
        ("short_factor", "many"),
        ("original_max_position_embeddings", -1),
    ],
)
def test_bad_longrope_fields_raise_value_error_naming_them(key, value):
    config = phi3_longrope()
    assert model_class(config)(config) is not None  # the valid one loads
    config.rope_parameters[key] = value
    with pytest.raises(ValueError, match=f"rope_parameters.{key}"):
        model_class(config)(config)
