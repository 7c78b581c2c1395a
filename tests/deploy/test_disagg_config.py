"""deploy.yaml's `disaggregation:` section: bounded fields, per-phase engine settings, and the
settings both phases must share (no KV resharding) as errors naming the field."""

from __future__ import annotations

import math

import pytest

from deploy.config import AppConfig


def app(**disagg) -> AppConfig:
    return AppConfig.from_args({"model": "default", "disaggregation": disagg})


def test_each_phase_gets_the_model_s_engine_with_its_own_settings_over_it():
    config = app(
        prefill_replicas=2, decode={"max_num_seqs": 64}, prefill={"max_num_batched_tokens": 2048}
    )
    prefill, decode = config.phase_engine("prefill"), config.phase_engine("decode")
    assert config.disaggregation is not None and config.disaggregation.prefill_replicas == 2
    assert decode.scheduler.max_num_seqs == 64
    assert prefill.scheduler.max_num_seqs == config.engine.scheduler.max_num_seqs
    assert prefill.scheduler.max_num_batched_tokens == 2048
    assert decode.cpu_threads == prefill.cpu_threads == config.engine.cpu_threads


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("prefill_replicas", 2**64, ": must fit in 64 bits"),
        ("prefill_replicas", -1, ": must be >= 1"),
        ("decode_replicas", 100_000, ": must be <= 1024"),
        ("decode_replicas", 1.5, ": must be an integer"),
        ("transfer_timeout_s", math.nan, ": must be finite"),
        ("transfer_timeout_s", -1, ": must be > 0"),
        ("transfer_timeout_s", 100_000, ": must be <= 600"),
        ("prefill", 5, ": must be a mapping"),
        ("decode", {"max_num_seqs": -1}, r"\.scheduler\.max_num_seqs: must be >= 1"),
        ("decode", {"max_num_seqs": 2**64}, r"\.scheduler\.max_num_seqs: must fit in 64 bits"),
        ("decode", {"x" * 10_000_000: 1}, r"\.xxx+\.\.\.: unknown setting"),
    ],
)
def test_a_bad_value_is_a_value_error_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=rf"disaggregation\.{field}{message}"):
        app(**{field: value})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"decode": {"block_size": 32}},
            r"disaggregation\.decode\.block_size: 32 differs from the prefill replicas' 16; "
            r".*only their KV heads are re-split",
        ),
        ({"prefill": {"dtype": "bfloat16"}}, r"disaggregation\.decode\.dtype: 'float32' differs"),
        (
            {
                "prefill": {"tensor_parallel_size": 2, "step_transport": "compiled_graph"},
                "decode": {"tensor_parallel_size": 2},
            },
            r"disaggregation\.prefill\.step_transport: .* use socket or actor_calls",
        ),
        (
            {"decode": {"enable_prefix_caching": False}},
            r"disaggregation\.decode\.enable_prefix_caching: .* must be on",
        ),
    ],
)
def test_what_makes_a_kv_block_must_match_between_the_phases(overrides, message):
    with pytest.raises(ValueError, match=message):
        app(**overrides)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 2), (2, 1), (1, 2)])
def test_the_phases_may_run_any_tensor_parallel_sizes(prefill_tp, decode_tp):
    """A decode rank takes its KV heads from the prefill ranks that hold them (re-split)."""
    config = app(
        prefill={"tensor_parallel_size": prefill_tp}, decode={"tensor_parallel_size": decode_tp}
    )
    assert config.phase_engine("prefill").tensor_parallel_size == prefill_tp
    assert config.phase_engine("decode").tensor_parallel_size == decode_tp


@pytest.mark.parametrize(
    "extra", [{"num_replicas": 2}, {"autoscaling": {"max_replicas": 2}}, {"router": "power_of_two"}]
)
def test_disaggregation_replaces_the_model_s_replica_count_and_needs_the_fleet_router(extra):
    with pytest.raises(ValueError, match=r"(num_replicas|autoscaling|disaggregation): "):
        AppConfig.from_args({"model": "default", "disaggregation": {}, **extra})


@pytest.mark.parametrize(
    ("model_level", "overrides", "phase"),
    [
        ({"speculative": {"method": "draft", "draft_model": "default"}}, {}, "decode"),
        ({}, {"decode": {"speculative": {"method": "draft", "draft_model": "default"}}}, "decode"),
        (
            {},
            {"prefill": {"speculative": {"method": "draft", "draft_model": "default"}}},
            "prefill",
        ),
        ({"speculative": {"method": "ngram"}}, {}, "decode"),
    ],
)
def test_speculation_is_allowed_with_disaggregation(model_level, overrides, phase):
    """A draft model's KV is recomputed over transferred blocks (workers/features/draft.py), so
    either phase may speculate with a draft, as with n-gram lookup (docs/features.md)."""
    config = AppConfig.from_args({"model": "default", **model_level, "disaggregation": overrides})
    spec = config.phase_engine(phase).speculative
    assert (
        spec is not None
        and spec.method == (model_level or overrides[phase])["speculative"]["method"]
    )
