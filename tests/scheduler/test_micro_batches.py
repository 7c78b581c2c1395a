"""Pipeline micro-batches (the MicroBatches step feature): up to `depth` steps in flight, no request
in two of them, and every request produces exactly what the synchronous Scheduler gives it
(hypothesis, against the contract runner).

The contract runner runs each step when it is launched, in launch order, as every pipeline stage
runs them; it does not append what it samples (the last stage samples, stage 0 embeds), so a
request's token must come back to it in the next step that runs the request, and it checks every
KV slot a step reads: a block freed or reused while a step in flight still wrote it shows up as a
wrong read.
"""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from scheduler import (
    EngineRequest,
    ModelRunnerOutput,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from scheduler.features import StepLimits, step_limits
from scheduler.features_pipeline import MAX_DEPTH, MicroBatches
from tests.scheduler.contract_runner import ContractRunner
from tests.scheduler.test_async_scheduler import run as run_sync
from tests.scheduler.test_scheduler_properties import (
    VOCAB,
    Spec,
    check_block_accounting,
    check_every_block_returned,
    configs,
    expected_for,
    workloads,
)

Step = tuple[SchedulerOutput, ModelRunnerOutput]


def run_micro_batched(cfg: SchedulerConfig, specs: list[Spec], depth: int) -> tuple[Scheduler, int]:
    """Drive the workload to the end as engine.core does with `depth` steps in flight: launch up
    to depth (stopping at an empty step), update from the oldest. Returns the scheduler and the
    most steps that were in flight at once."""
    s = Scheduler(cfg, [MicroBatches(depth)])
    runner = ContractRunner(cfg.block_size, cfg.num_gpu_blocks, cfg.num_cpu_blocks, VOCAB)

    def launch() -> Step:
        out = s.schedule()
        check_block_accounting(s)
        return out, runner.execute(out)

    pending = sorted(specs, key=lambda sp: sp.arrival_step)
    queue: deque[Step] = deque()
    deepest = 0
    for step_no in range(5000):
        while pending and pending[0].arrival_step <= step_no:
            s.add_request(Request(pending.pop(0).engine_request()))
        for sp in specs:  # aborts land between steps, while steps are in flight
            req = s.requests.get(sp.rid)
            if sp.abort_step == step_no and req is not None and not req.is_finished:
                s.abort_requests([sp.rid])
        if not pending and not s.has_unfinished_requests() and not queue:
            break
        if not queue:
            queue.append(launch())
        while len(queue) < depth and s.has_unfinished_requests():
            queue.append(launch())
            if queue[-1][0].is_empty:
                break
        check_disjoint(queue)
        deepest = max(deepest, len(queue))
        s.update_from_output(*queue.popleft())
        check_block_accounting(s)
    else:
        raise AssertionError("workload did not drain: a request starved")
    return s, deepest


def check_disjoint(queue: deque[Step]) -> None:
    seen: set[str] = set()
    for out, _ in queue:
        ids = set(out.num_scheduled_tokens)
        assert not ids & seen, f"{sorted(ids & seen)} run in two steps in flight"
        seen |= ids


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), depth=st.sampled_from([2, 3, 4]))
def test_micro_batches_give_every_request_the_synchronous_tokens(data, depth):
    cfg = data.draw(configs())
    specs = data.draw(workloads(cfg))
    sync = run_sync(cfg, specs, overlap=False)
    batched, deepest = run_micro_batched(cfg, specs, depth)
    assert deepest <= depth
    event(f"deepest={deepest}, preemptions={'yes' if batched.num_preemptions else 'no'}")
    for sp in specs:
        req, ref = batched.requests[sp.rid], sync.requests[sp.rid]
        assert req.is_finished and ref.is_finished
        want, reason = expected_for(sp, cfg)
        if sp.abort_step is not None:  # aborted somewhere: whatever it has is a prefix
            assert req.output_token_ids == want[: len(req.output_token_ids)]
            continue
        assert req.output_token_ids == want == ref.output_token_ids, sp.rid
        assert req.status == ref.status and req.status.finish_reason == reason
        assert req.num_output_placeholders == 0
    check_every_block_returned(batched, cfg)


def test_steady_decode_splits_the_requests_into_one_cohort_per_stage():
    """16 requests at PP=2: two cohorts of 8 take turns, each step's requests held out of the
    next one; a request's sampled token goes back to the ranks in its cohort's next step."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=512, block_size=4, num_gpu_blocks=128, max_model_len=64
    )
    s = Scheduler(cfg, [MicroBatches(2)])
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    for i in range(16):
        s.add_request(Request(EngineRequest(f"r{i}", [1 + i, 2, 3, 4], params)))
    first, second = s.schedule(), s.schedule()
    a, b = set(first.num_scheduled_tokens), set(second.num_scheduled_tokens)
    assert len(a) == len(b) == 8 and not a & b
    assert s.schedule().is_empty  # every request is in a step in flight
    s.update_from_output(first, ModelRunnerOutput(sorted(a), [[9]] * 8))
    third = s.schedule()
    assert set(third.num_scheduled_tokens) == a  # a's decodes; b is still in flight
    assert all(tokens == [9] for tokens in third.scheduled_cached_reqs.new_token_ids)
    s.update_from_output(second, ModelRunnerOutput(sorted(b), [[8]] * 8))
    fourth = s.schedule()
    assert set(fourth.num_scheduled_tokens) == b
    assert all(tokens == [8] for tokens in fourth.scheduled_cached_reqs.new_token_ids)


@pytest.mark.parametrize("bad", [2**64, -1, 0, 1, float("nan"), 10**30, True, "2"])
def test_depth_out_of_range_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=r"depth: .*\[2, 64\]"):
        MicroBatches(bad)


def test_the_features_limits_combine_as_union_and_minimum():
    assert step_limits([]) == StepLimits()
    both = step_limits(
        [lambda: StepLimits(frozenset({"a"}), 5), lambda: StepLimits(frozenset({"b"}), 3)]
    )
    assert both == StepLimits(frozenset({"a", "b"}), 3)
    assert MAX_DEPTH == 64
