"""A fault that belongs to one request finishes that request alone: the batch goes on, no block
leaks.

Faults are injected into the real engine at the two places a request's own inputs are used: the
building of its sampling state, and its row of the sampler.
"""

from __future__ import annotations

import pytest

from engine.core import EngineCore
from scheduler import EngineRequest, SamplingParams
from workers import runner as runner_module
from workers import sampler as sampler_module

BAD_SEED = 4242  # the injected faults pick their victim by this seed
PROMPTS = {f"r{i}": list(range(10 + 7 * i, 30 + 7 * i)) for i in range(4)}


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    from engine.config import EngineConfig

    path, _ = tiny_checkpoint("llama")
    core = EngineCore(
        EngineConfig.from_kwargs(
            model=path, device="cpu", kv_cache_memory_gb=0.01, load_progress=False
        )
    )
    yield core
    core.shutdown()


def run(engine: EngineCore, victim: str | None) -> dict[str, list]:
    """The four prompts in one batch, greedy; the victim (if any) carries BAD_SEED."""
    for rid, prompt in PROMPTS.items():
        seed = BAD_SEED if rid == victim else None
        engine.add_request(
            EngineRequest(
                rid,
                prompt,
                SamplingParams(max_tokens=6, temperature=0.0, seed=seed, ignore_eos=True),
            )
        )
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


def tokens(seen: dict[str, list], rid: str) -> list[int]:
    return [t for o in seen[rid] for t in o.new_token_ids]


@pytest.fixture(scope="module")
def clean(engine) -> dict[str, list]:
    return run(engine, victim=None)


def test_a_request_whose_sampling_state_fails_finishes_alone(engine, clean, monkeypatch):
    create = sampler_module.SamplingState.create.__func__

    def failing_create(cls, params, *args, **kwargs):
        if params.seed == BAD_SEED:
            raise OverflowError("injected: seed out of range")
        return create(cls, params, *args, **kwargs)

    monkeypatch.setattr(runner_module.SamplingState, "create", classmethod(failing_create))
    free = engine.stats().num_free_blocks
    seen = run(engine, victim="r1")
    assert seen["r1"][-1].finish_reason == "error" and "injected" in seen["r1"][-1].error
    for rid in ("r0", "r2", "r3"):
        assert tokens(seen, rid) == tokens(clean, rid)
    assert engine.failure is None and engine.stats().num_free_blocks == free


def test_a_request_whose_sampler_row_fails_finishes_alone(engine, clean, monkeypatch):
    sample = sampler_module.Sampler.sample

    def failing_sample(self, logits, states, unmasked=None):
        if any(s.params.seed == BAD_SEED for s in states):
            raise RuntimeError("injected: sampler fault on one row")
        return sample(self, logits, states, unmasked)

    monkeypatch.setattr(sampler_module.Sampler, "sample", failing_sample)
    free = engine.stats().num_free_blocks
    seen = run(engine, victim="r2")
    assert seen["r2"][-1].finish_reason == "error" and "injected" in seen["r2"][-1].error
    for rid in ("r0", "r1", "r3"):
        assert tokens(seen, rid) == tokens(clean, rid)
    assert engine.failure is None and engine.stats().num_free_blocks == free
