"""Gemma configs that cannot be served fail at construction, naming the field."""

from __future__ import annotations

import pytest
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


def test_both_architectures_are_registered():
    assert model_class(gemma2(architectures=["Gemma2ForCausalLM"])).__name__ == "Gemma2ForCausalLM"
    text = transformers.Gemma3TextConfig(**TINY)  # no architectures: found by model_type
    assert model_class(text).__name__ == "Gemma3ForCausalLM"


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
