"""The srpt queue policy: shortest predicted remaining first, priority first, FCFS without
predictions, and the aging bound checked against a model of the queue."""

from __future__ import annotations

import math
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import EngineRequest, Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.length_live import LivePredictor
from scheduler.length_prediction import LengthEstimate
from scheduler.preemption import VictimPolicy
from scheduler.queues import FairQueue, SRPTQueue
from tests.scheduler.contract_runner import ContractRunner


class Oracle:
    """Knows each request's remaining length (what the simulator's oracle does)."""

    def __init__(self, lengths: dict[str, float]):
        self.lengths = lengths

    def predict_request(self, request: Request) -> LengthEstimate | None:
        n = self.lengths.get(request.request_id)
        return None if n is None else LengthEstimate(n, n)

    def observe_request(self, request: Request) -> None:
        pass


def req(rid: str, priority: int = 0) -> Request:
    return Request(EngineRequest(rid, [1], SamplingParams(max_tokens=10), priority=priority))


def drain(q: SRPTQueue) -> list[str]:
    return [q.pop().request_id for _ in range(len(q))]


def test_without_predictions_the_order_is_fcfs():
    q = SRPTQueue(None, aging_factor=1e6)
    for rid in "abcd":
        q.add(req(rid))
    assert drain(q) == list("abcd")


def test_shortest_predicted_first_and_priority_before_length():
    q = SRPTQueue(Oracle({"a": 50, "b": 5, "c": 20, "d": 1, "e": 100}), aging_factor=1e6)
    for rid in "abc":
        q.add(req(rid))
    q.add(req("d", priority=1))  # shortest, but less urgent
    q.add(req("e", priority=-1))  # longest, but most urgent
    assert drain(q) == ["e", "b", "c", "a", "d"]


def test_a_request_with_no_prediction_goes_after_predicted_ones_and_a_preempted_one_first():
    q = SRPTQueue(Oracle({"b": 5}), aging_factor=1e6)
    q.add(req("a"))
    q.add(req("b"))
    victim = req("v")
    q.prepend(victim)
    assert drain(q) == ["v", "b", "a"]


def test_aging_factor_one_is_fcfs():
    q = SRPTQueue(Oracle({"a": 50, "b": 5, "c": 1}), aging_factor=1.0)
    for rid in "abc":
        q.add(req(rid))
    assert drain(q) == list("abc")


@pytest.mark.parametrize("bad", [0.5, math.nan, math.inf, -1.0])
def test_a_bad_aging_factor_is_refused(bad):
    with pytest.raises(ValueError, match="srpt_aging_factor"):
        SRPTQueue(None, bad)
    with pytest.raises(ValueError, match="srpt_aging_factor"):
        SchedulerConfig(num_gpu_blocks=8, max_model_len=16, policy="srpt", srpt_aging_factor=bad)


ops = st.lists(st.one_of(st.integers(1, 1000), st.none()), max_size=120)  # int: add, None: pop


@settings(max_examples=200, deadline=None)
@given(ops=ops, factor=st.sampled_from([1.0, 1.25, 1.5, 2.0, 3.0, 10.0]))
def test_no_request_waits_past_the_aging_factor_times_its_fcfs_wait(ops, factor):
    """The queue against a model: with the same arrivals and the same admission instants, FCFS
    admits a request w admissions after its arrival (w = 1 + the requests waiting when it came);
    SRPT admits it within floor(factor x w). Extra admissions after the ops drain the queue."""
    lengths: dict[str, float] = {}
    q = SRPTQueue(Oracle(lengths), factor)
    fcfs: deque[str] = deque()
    pops = 0
    arrived_at: dict[str, int] = {}  # admissions made before it arrived
    fcfs_wait: dict[str, int] = {}
    srpt_wait: dict[str, int] = {}
    for i, op in enumerate([*ops, *[None] * len(ops)]):
        if op is not None:
            rid = f"r{i}"
            lengths[rid] = op
            q.add(req(rid))
            fcfs.append(rid)
            arrived_at[rid] = pops
        elif len(q):
            pops += 1
            first = fcfs.popleft()
            fcfs_wait[first] = pops - arrived_at[first]
            got = q.pop().request_id
            srpt_wait[got] = pops - arrived_at[got]
    assert not len(q) and not fcfs and srpt_wait.keys() == fcfs_wait.keys()
    for rid, wait in srpt_wait.items():
        assert wait <= math.floor(factor * fcfs_wait[rid]), rid


def test_the_scheduler_learns_lengths_and_orders_by_them():
    cfg = SchedulerConfig(num_gpu_blocks=64, max_model_len=64, block_size=4, policy="srpt")
    s = Scheduler(cfg)
    queue = s.waiting
    # srpt turns the hidden-state probe on (length_probe auto); with no features it is the groups.
    assert isinstance(queue, SRPTQueue) and isinstance(queue.predictor, LivePredictor)
    runner = ContractRunner(cfg.block_size, 64, 0)
    for rid, n in [("a", 3), ("b", 9)]:
        s.add_request(Request(EngineRequest(rid, [1, 2], SamplingParams(max_tokens=n))))
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update_from_output(out, runner.execute(out))
    assert queue.predictor.num_observed == 2
    assert queue.predictor.predict_request(req("c")) is not None


def test_fair_srpt_serves_tenants_by_their_counters_and_each_tenant_shortest_first():
    lengths = {"a1": 50, "a2": 5, "a3": 1, "b1": 40, "b2": 4}
    template = SRPTQueue(Oracle(lengths), aging_factor=1e6)
    q = FairQueue(template)
    for rid in ["a1", "a2", "a3", "b1", "b2"]:
        r = Request(
            EngineRequest(rid, [1], SamplingParams(max_tokens=10), tenant=rid[0]), arrival_time=0
        )
        q.add(r)
    order = []
    while len(q):
        r = q.pop()
        order.append(r.request_id)
        q.charge(r.tenant, 10)  # equal service per request: the tenants alternate
    assert order == ["a3", "b2", "a2", "b1", "a1"]


def test_fair_srpt_is_a_scheduler_policy_that_learns():
    cfg = SchedulerConfig(num_gpu_blocks=64, max_model_len=64, block_size=4, policy="fair_srpt")
    s = Scheduler(cfg)
    assert isinstance(s.waiting, FairQueue)
    runner = ContractRunner(cfg.block_size, 64, 0)
    s.add_request(Request(EngineRequest("a", [1, 2], SamplingParams(max_tokens=3), tenant="t")))
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update_from_output(out, runner.execute(out))
    assert s.waiting._srpt is not None and s.waiting._srpt.predictor.num_observed == 1


def test_the_most_remaining_victim_is_the_longest_predicted_and_lifo_without_predictions():
    running = [req("a"), req("b"), req("c"), req("d")]
    lengths = {"a": 5, "b": 90, "c": 90, "d": 1}
    queue = SRPTQueue(Oracle(lengths))
    policy = VictimPolicy("most_remaining", remaining=queue.predicted_remaining)
    assert policy.choose(running).request_id == "c"  # b and c tie: the newer goes
    assert VictimPolicy("most_remaining").choose(running).request_id == "d"
    cold = VictimPolicy("most_remaining", remaining=SRPTQueue(Broken()).predicted_remaining)
    assert cold.choose(running).request_id == "d"


class Broken:
    def predict_request(self, request: Request) -> LengthEstimate | None:
        raise RuntimeError("broken")

    def observe_request(self, request: Request) -> None:
        raise RuntimeError("broken")
