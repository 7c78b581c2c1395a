"""Pipeline stages: which layers each stage holds, which checkpoint tensors it reads, and what the
settings accept (pipeline_parallel_size, pipeline_layer_split) and refuse."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import AutoConfig

from engine.config import EngineConfig
from tests.random_checkpoint import ModelSpec, write_random_checkpoint
from workers.loader import load_model
from workers.pipeline import (
    MissingLayer,
    PipelineStage,
    current_stage,
    init_pipeline,
    reset_pipeline,
    set_stage_layers,
    stage_weights,
)
from workers.pipeline_split import (
    MAX_PART_COST,
    MAX_PIPELINE_STAGES,
    StageCosts,
    cheapest_split,
    split_layers,
)
from workers.runner import ModelRunner

# Six layers (PP=2 and PP=3 stages of two), 6 heads and 3 KV heads (TP=3), tied embeddings (the
# last stage holds a copy of the embedding as its LM head), sharp logits for greedy decoding.
TINY_PP_LLAMA = ModelSpec(
    "LlamaConfig",
    dict(
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=3,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        vocab_size=250,
        tie_word_embeddings=True,
    ),
    matrix_std=0.15,
    head_std=0.6,
)


@pytest.fixture(scope="module")
def tiny_pp(tmp_path_factory):
    """(checkpoint directory, the Hugging Face model)."""
    from transformers import AutoModelForCausalLM

    path = write_random_checkpoint(TINY_PP_LLAMA, str(tmp_path_factory.mktemp("pp"))).path
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture
def stage_state():
    """The process's stage is module state (like the TP rank): every test leaves it reset."""
    yield
    reset_pipeline()


def test_layers_split_by_count_alone_the_first_stages_taking_the_most():
    assert split_layers(30, 2) == [range(0, 15), range(15, 30)]
    assert split_layers(30, 4) == [range(0, 8), range(8, 16), range(16, 24), range(24, 30)]
    assert split_layers(4, 3) == [range(0, 2), range(2, 3), range(3, 4)]
    assert split_layers(7, 1) == [range(0, 7)]


def test_the_last_stage_takes_fewer_layers_by_what_its_head_costs():
    """Six layers of 10 and a head of 25 on the last stage: 4 + 2 layers (40 / 45) beats 3 + 3
    (30 / 55); the first stage's embedding moves a layer back the other way."""
    assert cheapest_split(StageCosts((10,) * 6, last=25), 2) == [4, 2]
    assert cheapest_split(StageCosts((10,) * 6, first=25, last=25), 2) == [3, 3]
    assert cheapest_split(StageCosts((10,) * 6, last=25), 3) == [3, 2, 1]
    # Uneven layers: a heavy MoE layer 2 gets a stage of its own among three.
    assert cheapest_split(StageCosts((1, 1, 30, 1, 1, 1), last=2), 3) == [2, 1, 3]


def _compositions(n: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every way to write n as `parts` positive counts, in order."""
    for cuts in itertools.combinations(range(1, n), parts - 1):
        yield tuple(b - a for a, b in itertools.pairwise((0, *cuts, n)))


def _largest(costs: StageCosts, counts: Sequence[int]) -> int:
    bounds = list(itertools.accumulate(counts, initial=0))
    return max(
        costs.stage(a, b, i, len(counts)) for i, (a, b) in enumerate(itertools.pairwise(bounds))
    )


@settings(max_examples=300, deadline=None)
@given(
    layers=st.lists(st.integers(0, 1000), min_size=1, max_size=10),
    first=st.integers(0, 3000),
    last=st.integers(0, 3000),
    size=st.integers(1, 5),
)
def test_the_default_split_is_contiguous_complete_and_its_largest_stage_least(
    layers, first, last, size
):
    """Against every contiguous split: each layer on exactly one stage, no stage empty, and no
    split's costliest stage costs less than the default's."""
    assume(size <= len(layers))
    costs = StageCosts(tuple(layers), first, last)
    stages = split_layers(costs, size)
    assert len(stages) == size and all(len(r) >= 1 for r in stages)
    assert [i for r in stages for i in r] == list(range(len(layers)))
    best = min(_largest(costs, c) for c in _compositions(len(layers), size))
    assert _largest(costs, [len(r) for r in stages]) == best


@pytest.mark.parametrize("bad", [2**64, -1, math.nan, MAX_PART_COST + 1, True, "1"])
def test_a_stage_cost_out_of_bounds_is_refused(bad):
    for costs in (
        dict(layers=(1, bad)),
        dict(layers=(1, 1), first=bad),
        dict(layers=(1,), last=bad),
    ):
        with pytest.raises(ValueError, match="^pipeline cost: "):
            StageCosts(**costs)
    with pytest.raises(ValueError, match="^num_hidden_layers: "):
        StageCosts(())


def test_an_explicit_split_places_the_layers_in_order():
    assert split_layers(6, 3, [1, 4, 1]) == [range(0, 1), range(1, 5), range(5, 6)]


@pytest.mark.parametrize(
    "num_layers, size, split, field",
    [
        (2, 3, None, "pipeline_parallel_size"),  # a stage with no layer
        (6, 0, None, "pipeline_parallel_size"),
        (6, MAX_PIPELINE_STAGES + 1, None, "pipeline_parallel_size"),
        (6, 2, [3, 2], "pipeline_layer_split"),  # sums to 5, not 6
        (6, 2, [6, 0], "pipeline_layer_split"),  # an empty stage
        (6, 2, [2, 2, 2], "pipeline_layer_split"),  # three counts for two stages
    ],
)
def test_a_split_that_cannot_hold_the_model_is_refused_naming_the_setting(
    num_layers, size, split, field
):
    with pytest.raises(ValueError, match=f"^{field}: "):
        split_layers(num_layers, size, split)


@pytest.mark.parametrize("bad", [2**64, -1, math.nan, 10**12, 0, True, "2"])
def test_pipeline_parallel_size_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="^pipeline_parallel_size: "):
        EngineConfig.from_kwargs(pipeline_parallel_size=bad)


@pytest.mark.parametrize(
    "bad",
    [[2**64, 1], [-1, 1], [math.nan, 1], [10**12, 1], [1] * 10**6, [0, 2], [True, 1], "11", 3],
)
def test_pipeline_layer_split_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="^pipeline_layer_split: "):
        EngineConfig.from_kwargs(pipeline_parallel_size=2, pipeline_layer_split=bad)


def test_the_world_is_tensor_times_pipeline_ranks_and_runs_synchronously():
    config = EngineConfig.from_kwargs(
        tensor_parallel_size=3, pipeline_parallel_size=2, async_scheduling=True
    )
    assert config.world_size == 6
    assert not config.uses_async_scheduling()
    runner = config.runner_config("/m", 64)
    assert (runner.pipeline_parallel_size, runner.pipeline_layer_split) == (2, None)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(speculative={"method": "ngram", "num_tokens": 2}), "speculative"),
        (dict(max_loras=1), "max_loras"),
        (dict(kv_cpu_tier_gb=1.0), "kv_cpu_tier_gb"),
        (dict(num_cpu_tier_blocks=8), "kv_cpu_tier_gb"),
    ],
)
def test_features_not_built_for_stages_are_refused_naming_the_setting(kwargs, field):
    EngineConfig.from_kwargs(**kwargs)  # fine without stages
    with pytest.raises(ValueError, match=f"^{field}: not supported with pipeline_parallel_size=2"):
        EngineConfig.from_kwargs(pipeline_parallel_size=2, **kwargs)


def test_disaggregation_with_stages_is_refused_naming_the_phase():
    from deploy.config import AppConfig

    with pytest.raises(ValueError, match=r"disaggregation\.prefill\.pipeline_parallel_size: KV"):
        AppConfig.from_args(
            {
                "model": "default",
                "pipeline_parallel_size": 2,
                "disaggregation": {},
            }
        )


def test_a_stage_reads_only_the_tensors_of_what_it_holds():
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.2.input_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]
    weights = [(n, i) for i, n in enumerate(names)]
    first, middle, last = (PipelineStage(i, 3, i, i + 1) for i in range(3))
    assert [n for n, _ in stage_weights(weights, first, tied=False)] == names[:2]
    assert [n for n, _ in stage_weights(weights, middle, tied=False)] == [names[2]]
    assert [n for n, _ in stage_weights(weights, last, tied=False)] == names[3:]
    # Tied: the last stage loads the embedding as its own LM head.
    tied_last = list(stage_weights(weights, last, tied=True))
    assert ("lm_head.weight", 0) in tied_last and tied_last[0] == ("lm_head.weight", 0)
    assert list(stage_weights(weights, PipelineStage(), tied=True)) == weights


def held(linear: torch.nn.Module, width: int) -> torch.Tensor:
    """The weight a CPU linear multiplies by (its packed copy, the only one kept), read back
    exactly: identity rows times W^T."""
    with torch.no_grad():
        return linear(torch.eye(width)).t()


def _stage_model(model_dir: str, rank: int, size: int):
    config = AutoConfig.from_pretrained(model_dir)
    init_pipeline(rank, 1, size)
    set_stage_layers(config, size, None)
    return load_model(model_dir, config, torch.float32, torch.device("cpu"), progress=False)


def test_each_stage_builds_and_loads_only_its_layers(stage_state, tiny_pp):
    """Six tied layers in two stages: stage 0 the embedding and layers 0-2, stage 1 layers 3-5,
    the final norm and an LM head holding a copy of the embedding."""
    model_dir, hf = tiny_pp
    first = _stage_model(model_dir, 0, 2)
    last = _stage_model(model_dir, 1, 2)
    assert [isinstance(m, MissingLayer) for m in first.model.layers] == [False] * 3 + [True] * 3
    assert [isinstance(m, MissingLayer) for m in last.model.layers] == [True] * 3 + [False] * 3
    assert isinstance(first.model.norm, MissingLayer) and isinstance(first.lm_head, MissingLayer)
    assert isinstance(last.model.embed_tokens, MissingLayer)
    assert len(first.attention_layers()) == len(last.attention_layers()) == 3
    theirs = hf.state_dict()
    for i in range(6):
        layer = (first if i < 3 else last).model.layers[i]
        down = held(layer.mlp.down_proj, 192)
        assert torch.equal(down, theirs[f"model.layers.{i}.mlp.down_proj.weight"])
    embedding = theirs["model.embed_tokens.weight"]
    assert torch.equal(first.model.embed_tokens.weight, embedding)
    with torch.no_grad():
        assert torch.equal(last.compute_logits(torch.eye(96)).t(), embedding)
        assert first.compute_logits(torch.eye(96)) is None
    assert current_stage() == PipelineStage(1, 2, 3, 6)


def test_one_process_cannot_run_two_stages(stage_state, tiny_pp):
    model_dir, _ = tiny_pp
    config = EngineConfig(model=model_dir, device="cpu", load_progress=False)
    runner_config = config.runner_config(model_dir, 64)
    runner_config.pipeline_parallel_size = 2
    with pytest.raises(ValueError, match="^pipeline_parallel_size: 2 stages need a worker"):
        ModelRunner(runner_config)


def test_a_family_that_builds_every_layer_is_refused_naming_it(stage_state, tmp_path):
    """DeepSeek's decoder (workers/models/deepseek.py) does not read the stage as it builds."""
    from tests.random_checkpoint import TINY_DEEPSEEK

    path = write_random_checkpoint(TINY_DEEPSEEK["deepseek_v2"], str(tmp_path)).path
    with pytest.raises(ValueError, match="^pipeline_parallel_size: DeepseekV2ForCausalLM cannot"):
        _stage_model(path, 0, 2)
