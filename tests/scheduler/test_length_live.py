"""The live length predictor: features checked on arrival, the probe taking over once warm from
the feature groups, every failure falling back to the groups, determinism, and the state file
(round trip, corrupt and mismatched files ignored, atomic saves)."""

from __future__ import annotations

import json
import math
import os
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler import EngineRequest, Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.length_live import LivePredictor, make_live_predictor, valid_feature
from scheduler.length_prediction import safe_predict
from scheduler.length_probe import ProbeConfig
from scheduler.length_state import LengthStateFile, open_length_state
from scheduler.request import RequestStatus
from tests.scheduler.contract_runner import ContractRunner

DIM = 8


def request(rid: str, feature: list[float] | None = None, max_tokens: int = 1000) -> Request:
    r = Request(EngineRequest(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens)))
    r.length_feature = feature
    return r


def finished(rid: str, feature: list[float] | None, n: int) -> Request:
    r = request(rid, feature)
    r.output_token_ids.extend([7] * n)
    r.status = RequestStatus.FINISHED_STOPPED
    return r


def workload(n: int, seed: int = 0) -> list[tuple[list[float], int]]:
    """Features whose first coordinate sets the log length: prompts alike in every cheap feature
    (one group) whose answers run from ~3 to ~400 tokens."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        f = [rng.uniform(-1, 1) for _ in range(DIM)]
        rows.append((f, max(1, round(math.exp(3.5 + 2.5 * f[0] + rng.gauss(0, 0.1))))))
    return rows


def trained(rows: list[tuple[list[float], int]], min_samples: int = 16) -> LivePredictor:
    model = LivePredictor(DIM, probe=ProbeConfig(min_samples=min_samples))
    for i, (f, n) in enumerate(rows):
        model.observe_request(finished(f"t{i}", f, n))
    return model


@pytest.mark.parametrize(
    "vector",
    [
        None,
        [0.1] * (DIM - 1),
        [0.1] * (DIM + 1),
        [math.nan] + [0.1] * (DIM - 1),
        [math.inf] + [0.1] * (DIM - 1),
        [1e300] + [0.1] * (DIM - 1),
        [True] + [0.1] * (DIM - 1),
        ["0.1"] + [0.1] * (DIM - 1),
        {"a": 1},
        [0.1] * 100_000,
    ],
)
def test_invalid_features_are_dropped_not_raised(vector: object) -> None:
    assert valid_feature(vector, DIM) is None
    model = LivePredictor(DIM)
    r = request("a")
    model.take_feature(r, vector)
    assert r.length_feature is None and model.num_features_dropped == 1


def test_the_first_valid_feature_is_kept() -> None:
    model, r = LivePredictor(DIM), request("a")
    model.take_feature(r, [0.5] * DIM)
    model.take_feature(r, [0.25] * DIM)
    assert r.length_feature == [0.5] * DIM
    groups_only = LivePredictor(None)
    r2 = request("b")
    groups_only.take_feature(r2, [0.5] * DIM)
    assert r2.length_feature is None


def test_the_probe_takes_over_once_warm_and_ranks_by_the_state() -> None:
    rows = workload(120)
    model = LivePredictor(DIM, probe=ProbeConfig(min_samples=16))
    assert model.predict_request(request("x", rows[0][0])) is None  # nothing seen: FCFS
    for i, (f, n) in enumerate(rows[:10]):
        model.observe_request(finished(f"t{i}", f, n))
    cold = model.predict_request(request("x", rows[0][0]))
    assert cold is not None and not model.probe_warm and model.num_probe_answers == 0
    for i, (f, n) in enumerate(rows[10:100]):
        model.observe_request(finished(f"u{i}", f, n))
    assert model.probe_warm
    short = model.predict_request(request("s", [-0.9] + [0.0] * (DIM - 1)))
    long = model.predict_request(request("l", [0.9] + [0.0] * (DIM - 1)))
    grouped = model.predict_request(request("g"))  # no feature yet: the groups answer
    assert short is not None and long is not None and grouped is not None
    assert short.median < 15 < 200 < long.median  # the groups alone give every request one answer
    assert model.groups.predict_request(request("s2")) == grouped
    assert model.num_probe_answers == 2
    # Remaining given generated, capped by what max_tokens leaves.
    capped = model.predict_request(request("c", [0.9] + [0.0] * (DIM - 1), max_tokens=20))
    assert capped is not None and capped.upper <= 20


class _Broken:
    """A probe whose every call fails or answers NaN (what a failing solve would do)."""

    config = ProbeConfig(min_samples=1)
    num_observed = 100

    def __init__(self, nan: bool) -> None:
        self.nan = nan

    def predict(self, *args: object, **kwargs: object) -> object:
        if self.nan:
            from scheduler.length_prediction import LengthEstimate

            return LengthEstimate(math.nan, math.nan)
        raise ZeroDivisionError("singular")

    def observe(self, *args: object) -> None:
        raise ZeroDivisionError("singular")


@pytest.mark.parametrize("nan", [False, True])
def test_a_broken_probe_falls_back_to_the_groups(nan: bool) -> None:
    model = trained(workload(40))
    expected = model.groups.predict_request(request("g"))
    model.probe = _Broken(nan)  # type: ignore[assignment]
    r = request("x", [0.3] * DIM)
    assert safe_predict(model, r) == expected
    model.observe_request(finished("y", [0.3] * DIM, 5))  # logged, not raised
    assert model.num_observed == 41


def test_answers_are_deterministic() -> None:
    rows = workload(80, seed=3)
    a, b = trained(rows), trained(rows)
    for f, _ in workload(20, seed=4):
        assert a.predict_request(request("q", f)) == b.predict_request(request("q", f))


def test_aborted_requests_teach_nothing() -> None:
    model = LivePredictor(DIM)
    r = finished("a", [0.1] * DIM, 5)
    r.status = RequestStatus.FINISHED_ABORTED
    model.observe_request(r)
    assert model.num_observed == 0 and model.probe is not None and model.probe.num_observed == 0


def test_the_scheduler_keeps_features_and_learns_from_them() -> None:
    cfg = SchedulerConfig(
        num_gpu_blocks=64, max_model_len=64, block_size=4, policy="srpt", length_feature_dim=DIM
    )
    s = Scheduler(cfg)
    model = s.length_model()
    assert isinstance(model, LivePredictor) and model is s.waiting.predictor  # type: ignore[union-attr]
    runner = ContractRunner(cfg.block_size, 64, 0)
    for rid, n in [("a", 3), ("b", 5), ("c", 2)]:
        s.add_request(Request(EngineRequest(rid, [1, 2], SamplingParams(max_tokens=n))))
    vectors = {"a": [0.25] * DIM, "b": [math.nan] * DIM, "c": [0.5] * (DIM + 3)}
    while s.has_unfinished_requests():
        out = s.schedule()
        result = runner.execute(out)
        result.length_features = {r.req_id: vectors[r.req_id] for r in out.scheduled_new_reqs}
        s.update_from_output(out, result)
    assert [s.requests[r].status for r in "abc"] == [RequestStatus.FINISHED_LENGTH_CAPPED] * 3
    assert s.requests["a"].length_feature == [0.25] * DIM
    assert s.requests["b"].length_feature is None and s.requests["c"].length_feature is None
    assert model.num_features_dropped == 2 and model.num_observed == 3
    assert model.probe is not None and model.probe.num_observed == 1


def test_which_settings_turn_the_probe_on() -> None:
    base = dict(num_gpu_blocks=8, max_model_len=32)
    assert not SchedulerConfig(**base).uses_length_probe  # type: ignore[arg-type]
    for kwargs in [{"policy": "srpt"}, {"policy": "fair_srpt"}, {"admission": "foresight"}]:
        assert SchedulerConfig(**base, **kwargs).uses_length_probe  # type: ignore[arg-type]
    assert SchedulerConfig(**base, length_probe="on").uses_length_probe  # type: ignore[arg-type]
    assert not SchedulerConfig(**base, policy="srpt", length_probe="off").uses_length_probe  # type: ignore[arg-type]
    assert make_live_predictor(SchedulerConfig(**base)) is None  # type: ignore[arg-type]
    persisted = make_live_predictor(SchedulerConfig(**base, length_predictor_state_path="/tmp/x"))  # type: ignore[arg-type]
    assert persisted is not None and persisted.probe is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("length_predictor_state_path", ""),
        ("length_predictor_state_path", "a\0b"),
        ("length_predictor_state_path", "x" * 10_000_000),
        ("length_predictor_state_path", 5),
        ("length_probe", "maybe"),
        ("length_feature_dim", 0),
        ("length_feature_dim", 2**64),
        ("length_feature_dim", -1),
        ("length_feature_dim", math.nan),
        ("length_feature_dim", 100_000),
    ],
)
def test_bad_settings_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(num_gpu_blocks=8, max_model_len=32, **{field: value})  # type: ignore[arg-type]


def test_state_round_trip(tmp_path) -> None:
    path = str(tmp_path / "state.json")
    model = trained(workload(60))
    assert LengthStateFile(path, "m", model).save()
    assert os.listdir(tmp_path) == ["state.json"]  # written aside, then renamed over
    fresh = LivePredictor(DIM, probe=ProbeConfig(min_samples=16))
    assert LengthStateFile(path, "m", fresh).load()
    assert fresh.num_observed == 60 and fresh.probe_warm
    for f, _ in workload(10, seed=9):
        assert fresh.predict_request(request("q", f)) == model.predict_request(request("q", f))
    assert fresh.predict_request(request("g")) == model.predict_request(request("g"))


def test_the_scheduler_opens_its_state_file_and_saves_periodically(tmp_path) -> None:
    path = str(tmp_path / "state.json")
    cfg = SchedulerConfig(num_gpu_blocks=8, max_model_len=32, length_predictor_state_path=path)
    assert (
        open_length_state(Scheduler(SchedulerConfig(num_gpu_blocks=8, max_model_len=32)), "m")
        is None
    )
    state = open_length_state(Scheduler(cfg), "m")
    assert state is not None and not os.path.exists(path)  # no file yet: a cold start
    for i in range(255):
        state.model.observe_request(finished(f"r{i}", None, 4))
    state.maybe_save()
    assert not os.path.exists(path)
    state.model.observe_request(finished("last", None, 4))
    state.maybe_save()
    reopened = open_length_state(Scheduler(cfg), "m")
    assert reopened is not None and reopened.model.num_observed == 256


def _corrupt_files(model: LivePredictor) -> list[str | bytes]:
    good = {
        "version": 1,
        "source": "m",
        "dim": DIM,
        "num_observed": model.num_observed,
        "groups": model.groups.state(),
        "probe": model.probe.state() if model.probe is not None else None,
    }
    nan_gram = json.loads(json.dumps(good))
    nan_gram["probe"]["gram"][0][0] = math.nan
    short = json.loads(json.dumps(good))
    short["probe"]["target"] = [0.0]
    no_inverse = json.loads(json.dumps(good))
    del no_inverse["probe"]["inverse"]
    lengths = json.loads(json.dumps(good))
    lengths["groups"]["groups"][0][1] = [-3, "x"]
    return [
        b"\x00\xff garbage",
        "",
        "[1, 2, 3]",
        '{"version": 1',
        json.dumps({**good, "version": 2}),
        json.dumps({**good, "source": "another model"}),
        json.dumps({**good, "dim": DIM * 2}),
        json.dumps({**good, "probe": None}),
        json.dumps({**good, "num_observed": -1}),
        json.dumps(nan_gram),
        json.dumps(short),
        json.dumps(no_inverse),
        json.dumps(lengths),
        "[" * 100_000 + "]" * 100_000,
    ]


def test_corrupt_or_mismatched_files_are_ignored(tmp_path, caplog) -> None:
    source = trained(workload(40))
    path = tmp_path / "state.json"
    for content in _corrupt_files(source):
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        model = trained(workload(20, seed=5))
        before = model.predict_request(request("q", [0.2] * DIM))
        caplog.clear()
        assert not LengthStateFile(str(path), "m", model).load()
        assert "ignored" in caplog.text
        assert model.num_observed == 20
        assert model.predict_request(request("q", [0.2] * DIM)) == before


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda c: st.lists(c) | st.dictionaries(st.text(), c),
    max_leaves=30,
)


def _leaves(value: object, path: tuple = ()) -> list[tuple]:
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _leaves(v, (*path, k))] or [path]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _leaves(v, (*path, i))] or [path]
    return [path]


def _replaced(value: object, path: tuple, new: object) -> object:
    if not path:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)  # type: ignore[call-overload]
    copy[path[0]] = _replaced(copy[path[0]], path[1:], new)
    return copy


@pytest.fixture(scope="module")
def saved_state(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("state") / "s.json"
    assert LengthStateFile(str(path), "m", trained(workload(20, seed=5))).save()
    return json.loads(path.read_text())


@given(pick=st.integers(min_value=0), value=JSON)
def test_a_corrupted_state_is_loaded_whole_or_not_at_all(
    tmp_path_factory, saved_state: dict, pick: int, value: object
) -> None:
    """One leaf of a real state file replaced by any JSON value: the load either takes the file
    whole (the model then knows the file's request count) or leaves the model as it was."""
    leaves = _leaves(saved_state)
    corrupted = _replaced(saved_state, leaves[pick % len(leaves)], value)
    path = tmp_path_factory.mktemp("state") / "s.json"
    path.write_text(json.dumps(corrupted))
    model = trained(workload(3, seed=1))
    before = model.predict_request(request("q", [0.2] * DIM))
    if LengthStateFile(str(path), "m", model).load():
        assert model.num_observed == corrupted["num_observed"]  # type: ignore[index]
    else:
        assert model.num_observed == 3
        assert model.predict_request(request("q", [0.2] * DIM)) == before


@given(JSON)
def test_any_json_is_ignored_and_changes_nothing(tmp_path_factory, value: object) -> None:
    path = tmp_path_factory.mktemp("state") / "s.json"
    path.write_text(json.dumps(value))
    model = trained(workload(3, seed=1))
    before = model.predict_request(request("q", [0.2] * DIM))
    assert not LengthStateFile(str(path), "m", model).load()
    assert model.num_observed == 3
    assert model.predict_request(request("q", [0.2] * DIM)) == before


def test_a_failed_save_is_logged_not_raised(tmp_path, caplog) -> None:
    model = trained(workload(20))
    state = LengthStateFile(str(tmp_path / "no-such-dir" / "state.json"), "m", model)
    assert not state.save() and "not saved" in caplog.text
