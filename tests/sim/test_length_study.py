"""The length-aware scheduling study on a small workload: every policy finishes every request by
EOS (max_tokens carries no hint), and the oracle and the predictor are wired into the queue."""

from __future__ import annotations

import json

from scheduler.queues import SRPTQueue
from sim.length_study import (
    MAX_TOKENS,
    SET_MAX_TOKENS,
    StudyReplica,
    figures,
    length_workload,
    load_set,
    run,
    set_workload,
)


def test_every_policy_finishes_every_request_at_its_output_length():
    wl = length_workload(40, rate=2.0, seed=3)
    assert wl == length_workload(40, rate=2.0, seed=3)
    assert max(r.output_len for r in wl) < MAX_TOKENS
    for policy in ("fcfs", "srpt", "oracle"):
        result, predictions = run(policy, wl, StudyReplica(400, max_num_seqs=2), "cpu")
        done = {r.request_id: r for r in result.records}
        assert all(done[r.request_id].num_output_tokens == r.output_len for r in wl)
        assert all(rec.finish_reason == "stop" for rec in result.records)
        assert figures(result, slo_ttft_s=5.0)["done"] == len(wl)
        queue = result.replicas[0].scheduler.waiting
        assert isinstance(queue, SRPTQueue) == (policy != "fcfs")
        if policy == "srpt":  # learnt online: later arrivals were predicted
            assert any(p is not None for p in predictions.values())


def test_the_evaluation_set_drives_the_study_and_foresight_runs_every_policy(tmp_path):
    path = tmp_path / "set.jsonl"
    rows = [{"header": {"source": "test"}}] + [
        {"id": i, "kind": k, "prompt_len": 20 + i, "output_len": n, "finish_reason": "stop"}
        for i, (k, n) in enumerate([("answer", 2), ("essay", 200), ("code", 90), ("list", 30)])
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    table = load_set(str(path))
    wl = set_workload(table, 30, rate=2.0, seed=1)
    assert {r.output_len for r in wl} <= {2, 200, 90, 30} and wl == set_workload(table, 30, 2.0, 1)
    probe = {0: 3.0, 1: 150.0, 2: 100.0}  # id 3 has no estimate: it sorts last
    for policy in ("fcfs+foresight", "srpt+foresight", "probe+foresight", "oracle+foresight-upper"):
        result, _ = run(policy, wl, StudyReplica(170, 4, max_tokens=SET_MAX_TOKENS), "cpu", probe)
        assert figures(result, slo_ttft_s=5.0)["done"] == len(wl)
        assert result.replicas[0].scheduler.admission is not None
