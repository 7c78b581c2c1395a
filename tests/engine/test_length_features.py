"""The hidden-state length probe on a real engine (tiny random Llama, CPU): the runner's features
reach the scheduler, with async scheduling as without, the probe warms up and answers, the state
is saved at shutdown and read back, and with no length-aware setting nothing is extracted."""

from __future__ import annotations

import math
import random

import pytest

from engine.config import EngineConfig
from engine.llm import LLM
from scheduler import SamplingParams
from scheduler.length_live import LivePredictor
from scheduler.length_state import LengthStateFile

N = 36  # past the probe's min_samples (32)


@pytest.fixture(scope="module")
def model(tiny_checkpoint) -> str:
    return tiny_checkpoint("llama")[0]


def run(llm: LLM, seed: int = 0) -> None:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 2000) for _ in range(rng.randint(2, 24))] for _ in range(N)]
    params = [
        SamplingParams(max_tokens=rng.randint(1, 4), temperature=0.0, ignore_eos=True)
        for _ in range(N)
    ]
    llm.generate(prompts, params, use_tqdm=False)


def features(llm: LLM) -> list[list[float] | None]:
    requests = llm.engine.scheduler.requests.values()
    return [r.length_feature for r in sorted(requests, key=lambda r: r.arrival_time)]


@pytest.mark.slow
def test_features_reach_the_scheduler_and_the_probe_learns(model: str, tmp_path) -> None:
    path = str(tmp_path / "length-state.json")
    kwargs = dict(device="cpu", load_progress=False, policy="srpt", max_num_batched_tokens=32)
    sync = LLM(model, length_predictor_state_path=path, **kwargs)  # type: ignore[arg-type]
    overlapped = LLM(model, async_scheduling=True, **kwargs)  # type: ignore[arg-type]
    try:
        for llm in (sync, overlapped):
            assert llm.engine.executor.runner.length_features is not None  # type: ignore[attr-defined]
            run(llm)
        got = features(sync)
        assert len(got) == N and all(f is not None and len(f) == 64 for f in got)
        assert all(math.isfinite(v) for f in got for v in f)  # type: ignore[union-attr]
        # The same prompts give the same features, overlapped or not (chunked prefill included).
        for a, b in zip(got, features(overlapped)):
            assert b is not None and max(abs(x - y) for x, y in zip(a, b)) < 1e-5  # type: ignore[arg-type]
        live = sync.engine.scheduler.length_model()
        assert isinstance(live, LivePredictor) and live.probe_warm
        assert live.probe is not None and live.probe.num_observed == N
        done = list(sync.engine.scheduler.requests.values())
        answers = [live.predict_request(r) for r in done]
        assert live.num_probe_answers == N
        assert any(a != live.groups.predict_request(r) for a, r in zip(answers, done))
    finally:
        sync.shutdown()
        overlapped.shutdown()
    restored = LivePredictor(64)
    source = sync.engine.length_state.source  # type: ignore[union-attr]
    assert LengthStateFile(path, source, restored).load()  # saved at shutdown
    assert restored.num_observed == N and restored.probe_warm


def test_no_length_aware_setting_no_features() -> None:
    def dim(**kwargs: object) -> int:
        config = EngineConfig.from_kwargs(model="default", **kwargs)
        return config.runner_config("/nowhere", 256).length_feature_dim

    assert dim() == 0
    assert dim(policy="srpt", length_probe="off") == 0
    assert dim(policy="srpt") == 64
    assert dim(admission="foresight", length_feature_dim=128) == 128
    assert dim(length_probe="on") == 64
