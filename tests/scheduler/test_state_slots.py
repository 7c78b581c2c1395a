"""Recurrent-state slots in the scheduler: a request runs only with a slot of its own, waits when
none is free, gives it back when it finishes, is aborted or preempted, and every slot comes back
once the queue drains (hypothesis over random workloads, a tiny block pool and aborts)."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from scheduler import EngineRequest, Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.state_slots import StateSlots
from tests.scheduler.contract_runner import ContractRunner, expected_output

VOCAB = 50


@pytest.mark.parametrize("bad", [2**64, -1, math.nan, 10**12, True, "4"])
def test_a_slot_count_out_of_range_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="num_state_slots"):
        StateSlots(bad)


def test_acquire_waits_when_full_and_a_released_slot_is_reused():
    slots = StateSlots(2)
    assert slots.acquire("a") and slots.acquire("b")
    assert not slots.acquire("c")
    assert slots.slot_of == {"a": 0, "b": 1}
    slots.release("a")
    slots.release("never-held")  # a waiting request's finish: nothing to give back
    assert slots.acquire("c") and slots.slot_of["c"] == 0
    with pytest.raises(RuntimeError, match="already holds"):
        slots.acquire("c")


def test_disabled_slots_never_hold_anyone_back():
    slots = StateSlots(0)
    assert all(slots.acquire(f"r{i}") for i in range(10)) and not slots.slot_of


def _scheduler(num_slots: int, **overrides: int) -> tuple[Scheduler, ContractRunner]:
    cfg = SchedulerConfig(
        **{
            "max_num_batched_tokens": 64,
            "max_num_seqs": 8,
            "block_size": 4,
            "num_gpu_blocks": 64,
            "max_model_len": 64,
            "enable_prefix_caching": False,
            **overrides,
        }
    )
    sched = Scheduler(cfg)
    sched.state_slots = StateSlots(num_slots)
    return sched, ContractRunner(cfg.block_size, cfg.num_gpu_blocks, 0, VOCAB)


def _check_slots(sched: Scheduler) -> None:
    """Exactly the running requests hold slots, one each, all different, within the pool."""
    slots = sched.state_slots
    assert set(slots.slot_of) == {r.request_id for r in sched.running}
    held = list(slots.slot_of.values())
    assert len(set(held)) == len(held), "two requests in one slot"
    assert not set(held) & set(slots.free) and len(held) + len(slots.free) == slots.num_slots


def test_more_requests_than_slots_wait_for_one_and_all_finish():
    sched, runner = _scheduler(2)
    for i in range(5):
        sched.add_request(
            Request(EngineRequest(f"r{i}", [i + 1] * 6, SamplingParams(max_tokens=4)))
        )
    peak, waited = 0, False
    while sched.has_unfinished_requests():
        out = sched.schedule()
        _check_slots(sched)
        peak = max(peak, len(sched.running))
        waited |= len(sched.running) == 2 and len(sched.waiting) > 0
        sched.update_from_output(out, runner.execute(out))
    assert peak == 2 and waited  # max_num_seqs (8) and the blocks would have let all 5 run
    assert sched.state_slots.num_free == 2 and not sched.state_slots.slot_of


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_slots=st.integers(1, 5),
    max_num_seqs=st.integers(1, 8),
    num_gpu_blocks=st.integers(16, 40),
    budget=st.integers(4, 64),
    requests=st.lists(
        st.tuples(st.integers(1, 40), st.integers(1, 20), st.one_of(st.none(), st.integers(0, 30))),
        min_size=1,
        max_size=14,
    ),
)
def test_slots_stay_exclusive_and_all_come_back(
    num_slots, max_num_seqs, num_gpu_blocks, budget, requests
):
    sched, runner = _scheduler(
        num_slots,
        max_num_seqs=max_num_seqs,
        num_gpu_blocks=num_gpu_blocks,
        max_num_batched_tokens=budget,
    )
    for i, (n, max_tokens, _) in enumerate(requests):
        prompt = [(i * 7 + j) % VOCAB for j in range(n)]
        sched.add_request(
            Request(EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens)))
        )
    aborts = {f"r{i}": at for i, (_, _, at) in enumerate(requests) if at is not None}
    for step_no in range(5000):
        if not sched.has_unfinished_requests():
            break
        sched.abort_requests([rid for rid, at in aborts.items() if at == step_no])
        out = sched.schedule()
        _check_slots(sched)
        assert len(out.num_scheduled_tokens) <= num_slots
        sched.update_from_output(out, runner.execute(out))
        _check_slots(sched)
    else:
        raise AssertionError("a request starved for a slot")
    event(f"preemptions={'yes' if sched.num_preemptions else 'no'}")
    assert sorted(sched.state_slots.free) == list(range(num_slots))
    for i, (n, max_tokens, _) in enumerate(requests):
        req = sched.requests[f"r{i}"]
        assert req.is_finished
        if f"r{i}" not in aborts or req.status.finish_reason != "abort":
            want, _ = expected_output(f"r{i}", n, max_tokens, None, [], 64, VOCAB)
            assert req.output_token_ids == want
