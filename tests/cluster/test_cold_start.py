"""A replica's cold-start record: each phase once, in order, from the process's start."""

import time

from cluster.cold_start import ColdStart, process_start_time


def test_the_process_start_is_read_from_proc():
    started = process_start_time()
    assert started is not None and 0 < time.time() - started < 24 * 3600


def test_each_phase_is_recorded_once_and_the_first_token_follows_the_first_request():
    record = ColdStart("model", "replica")
    record.first_token()  # no request yet: nothing to time
    record.first_request()  # before the engine is ready: not a cold-start request
    assert "first_token" not in record.phases and "first_request" not in record.phases
    record.record_engine({"model_config": 0.0, "weights": 0.0, "kv_allocation": 0.0})
    record.first_request()
    record.first_token()
    first = dict(record.phases)
    record.first_request()
    record.first_token()
    assert record.phases == first  # later requests change nothing
    assert list(first) == [
        "process_and_imports",
        "model_config",
        "weights",
        "kv_allocation",
        "ready",
        "first_request",
        "first_token",
    ]
    assert all(seconds >= 0 for seconds in first.values())
    marks = record.report()["marks"]
    assert (
        marks["process_start"] <= marks["ready"] <= marks["first_request"] <= marks["first_token"]
    )
