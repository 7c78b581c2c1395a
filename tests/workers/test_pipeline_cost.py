"""What a decode step costs each part of a model (workers/pipeline_cost.py), read from its config:
each layer's figure is the weight matrices transformers itself builds for that layer (plus the
fixed LAYER_OVERHEAD), for every family with its own per-layer sizes (MoE with dense layers,
hybrids' mixers, MLA), and the LM head is vocab x hidden. And the default split those figures
give."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from tests.random_checkpoint import (
    SHAPES,
    TINY_DEEPSEEK,
    TINY_FAMILIES,
    TINY_GEMMA,
    TINY_GLM4_MOE,
    TINY_GPT_OSS,
    TINY_MOE_FAMILIES,
    TINY_PHI3,
    ModelSpec,
)
from tests.workers.test_granite_hybrid import TINY_GRANITE_HYBRID
from tests.workers.test_qwen3_next import TINY_QWEN3_NEXT
from workers.pipeline_cost import LAYER_OVERHEAD, MAX_WIDTH, decode_costs
from workers.pipeline_split import StageCosts, cheapest_split, split_layers

SPECS = {
    **TINY_FAMILIES,
    **TINY_MOE_FAMILIES,
    **TINY_GEMMA,
    **TINY_DEEPSEEK,
    "phi3": TINY_PHI3,
    "gpt_oss": TINY_GPT_OSS,
    "glm4_moe": TINY_GLM4_MOE,
    "qwen3_next": TINY_QWEN3_NEXT,
    "granite_hybrid": TINY_GRANITE_HYBRID,
}


def _config(spec: ModelSpec) -> transformers.PretrainedConfig:
    """The spec's config with a small vocabulary: transformers builds the model in milliseconds."""
    return getattr(transformers, spec.config_class)(**{**spec.fields, "vocab_size": 96})


def _matrices(module: torch.nn.Module) -> int:
    """Parameters of the weight matrices (2-D, 3-D fused experts and convs): not norms or biases."""
    return sum(
        p.numel() for name, p in module.named_parameters() if p.dim() >= 2 and "bias" not in name
    )


@pytest.mark.parametrize("family", sorted(SPECS))
def test_each_layer_costs_the_weight_matrices_transformers_builds_for_it(family):
    config = _config(SPECS[family])
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config)
    costs = decode_costs(config)
    text = config.get_text_config()
    assert costs.layers == tuple(_matrices(layer) + LAYER_OVERHEAD for layer in hf.model.layers)
    head = hf.get_output_embeddings().weight
    assert costs.last == head.numel() + text.vocab_size + text.hidden_size
    assert costs.first == text.hidden_size


def test_dense_and_sparse_layers_of_one_model_cost_what_each_holds():
    """Qwen2-MoE's layer 1 is dense (mlp_only_layers): 3 x hidden x intermediate, against the
    sparse layers' 8 experts, router, and gated shared expert."""
    costs = decode_costs(_config(TINY_MOE_FAMILIES["qwen2_moe"]))
    attention = 64 * 16 * (4 + 2 * 2 + 4)  # hidden x head_dim x (q + k + v + o heads)
    dense = attention + 3 * 64 * 128 + LAYER_OVERHEAD
    sparse = attention + 3 * 64 * (8 * 32 + 96) + 64 * (8 + 1) + LAYER_OVERHEAD
    assert costs.layers == (sparse, dense, sparse)


def test_smollm2_default_split_weighs_its_lm_head_as_five_and_a_half_layers():
    """SmolLM2-135M (the default model's shape): a layer 3.54 M weights and LAYER_OVERHEAD, the
    tied LM head 28.3 M (5.6 layers; 8.0 by weights alone). PP=2 gives the last stage 12 layers
    and the head (19, 11 by weights alone)."""
    config = AutoConfig.for_model("llama", **SHAPES["smollm2-135m"].fields)
    costs = decode_costs(config)
    assert costs.layers == (3_538_944 + LAYER_OVERHEAD,) * 30
    assert costs.last == 49152 * 576 + 49152 + 576
    assert cheapest_split(costs, 2) == [18, 12]
    assert cheapest_split(costs, 3) == [12, 12, 6]
    assert cheapest_split(costs, 4) == [9, 9, 9, 3]
    weights_alone = StageCosts((3_538_944,) * 30, costs.first, costs.last)
    assert cheapest_split(weights_alone, 2) == [19, 11]
    # An explicit split overrides the costs.
    assert split_layers(costs, 2, [15, 15]) == [range(0, 15), range(15, 30)]


@pytest.mark.parametrize("field", ["hidden_size", "vocab_size", "intermediate_size"])
@pytest.mark.parametrize("bad", [2**64, -1, math.nan, MAX_WIDTH + 1, "64", True])
def test_a_config_size_out_of_bounds_is_refused_naming_it(field, bad):
    """Read as a config file could say it (transformers' own classes refuse some at setattr)."""
    config = SimpleNamespace(**_config(TINY_FAMILIES["llama"]).to_dict())
    setattr(config, field, bad)
    with pytest.raises(ValueError, match=f"^{field}: must be an integer"):
        decode_costs(config)


def test_layer_types_of_the_wrong_length_are_refused():
    config = SimpleNamespace(**_config(TINY_QWEN3_NEXT).to_dict())
    config.layer_types = config.layer_types[:-1]
    with pytest.raises(ValueError, match="^layer_types: needs one entry per layer"):
        decode_costs(config)
