"""DraftPacing (workers/draft_pacing.py): a request whose proposal the scheduler did not run is
paused and proposes only every `every`-th step until a probe is scheduled again."""

from __future__ import annotations

import pytest

from scheduler import CachedRequestData, SchedulerOutput
from workers.draft_pacing import DraftPacing


def step(scheduled: dict[str, int], spec: dict[str, list[int]], finished=()) -> SchedulerOutput:
    out = SchedulerOutput([], CachedRequestData(), scheduled, sum(scheduled.values()))
    out.scheduled_spec_tokens = spec
    out.finished_req_ids = set(finished)
    return out


def test_a_request_whose_proposal_did_not_run_probes_every_nth_step_until_one_runs():
    pacing = DraftPacing(every=3)
    assert pacing.asks("a")  # unknown: proposes
    pacing.proposed(["a"], [[1, 2]])
    pacing.schedule(step({"a": 3}, {"a": [1, 2]}))  # ran: stays active
    assert not pacing.paused("a") and pacing.asks("a")
    pacing.proposed(["a"], [[1, 2]])
    pacing.schedule(step({"a": 1}, {}))  # the policy said no: a plain decode
    assert pacing.paused("a")
    asked = []
    for _ in range(7):
        asks = pacing.asks("a")
        asked.append(asks)
        if asks:
            pacing.proposed(["a"], [[9]])
        pacing.schedule(step({"a": 1}, {}))  # still not run
    assert asked == [False, False, True, False, False, True, False]
    while not pacing.asks("a"):
        pass
    pacing.proposed(["a"], [[9]])
    pacing.schedule(step({"a": 2}, {"a": [9]}))  # the probe ran: speculating again
    assert not pacing.paused("a") and pacing.asks("a")


def test_a_proposal_waits_for_its_request_to_be_scheduled_and_finishing_forgets():
    pacing = DraftPacing(every=2)
    pacing.proposed(["a", "b"], [[1], []])  # b proposed nothing: nothing pending
    pacing.schedule(step({"b": 1}, {}))  # a not scheduled this step: still pending
    assert not pacing.paused("a") and not pacing.paused("b")
    pacing.schedule(step({"a": 1}, {}))
    assert pacing.paused("a")
    pacing.schedule(step({}, {}, finished=["a"]))
    assert not pacing.paused("a") and pacing.asks("a")


def test_every_must_be_positive():
    with pytest.raises(ValueError, match="every: must be >= 1"):
        DraftPacing(every=0)
