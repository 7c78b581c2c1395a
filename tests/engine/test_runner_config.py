"""EngineConfig.runner_config: a worker's settings are the engine's, passed by name or resolved
in one place, so a setting cannot reach the runner with a value of its own."""

from __future__ import annotations

from dataclasses import fields

from engine.config import RUNNER_FROM_ENGINE, RUNNER_FROM_SCHEDULER, EngineConfig
from workers.runner_config import RunnerConfig

# Resolved by runner_config from several settings or its arguments; num_state_checkpoints is
# set by EngineCore, which sizes the state slots.
RESOLVED = {
    "model_dir",
    "device",
    "max_model_len",
    "encoder_cache_bytes",
    "async_scheduling",
    "gguf_file",
    "max_loras",
    "max_cpu_loras",
    "kv_tiers",
    "length_feature_dim",
    "draft_model_dir",
    "draft_gguf_file",
    "num_state_checkpoints",
}


def test_every_runner_field_comes_from_one_place() -> None:
    names = [f.name for f in fields(RunnerConfig)]
    passed = [*RUNNER_FROM_ENGINE, *RUNNER_FROM_SCHEDULER]
    assert len(set(passed)) == len(passed)  # none listed twice
    assert not set(passed) & RESOLVED
    assert sorted(names) == sorted([*passed, *RESOLVED])


def test_settings_pass_by_name_and_resolved_ones_resolve() -> None:
    config = EngineConfig.from_kwargs(
        device="cpu",
        seed=7,
        enforce_eager=True,
        max_lora_rank=32,
        grammar_timeout_s=3.5,
        block_size=32,
        max_num_seqs=5,
        encoder_cache_gb=0.25,
        max_loras=2,
        load_progress=False,
    )
    rc = config.runner_config("/models/m", 320)
    for name in RUNNER_FROM_ENGINE:
        assert getattr(rc, name) == getattr(config, name), name
    assert (rc.seed, rc.enforce_eager, rc.max_lora_rank, rc.grammar_timeout_s) == (7, True, 32, 3.5)
    assert (rc.block_size, rc.max_num_seqs) == (32, 5)
    assert (rc.model_dir, rc.device, rc.max_model_len) == ("/models/m", "cpu", 320)
    assert rc.encoder_cache_bytes == 256 << 20
    assert (rc.max_loras, rc.max_cpu_loras) == (2, 4)  # max_cpu_loras unset: 2 x max_loras
    assert rc.draft_model_dir is None and rc.draft_gguf_file is None and rc.kv_tiers is None
