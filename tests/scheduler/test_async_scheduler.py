"""Async scheduling (the AsyncOverlap step feature): step N+1 is scheduled before step N's tokens
are appended, and every request still produces exactly what the synchronous Scheduler gives it
(hypothesis).

The contract runner appends its own sampled tokens, as workers.runner does under async scheduling,
and checks every KV slot a step reads: a block freed while a step still wrote it, or a token fed
from the wrong place, shows up as a wrong read.
"""

from __future__ import annotations

from collections.abc import Callable

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
from scheduler.features import StepFeature
from scheduler.features_async import AsyncOverlap
from tests.scheduler.contract_runner import ContractRunner
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


def run(
    cfg: SchedulerConfig,
    specs: list[Spec],
    overlap: bool,
    features: list[StepFeature] | None = None,
    proposer: Callable[[str, list[int]], list[int]] | None = None,
) -> Scheduler:
    """Drive the workload to the end, one step in flight when overlap (as engine.core does);
    features: the scheduler's (default: AsyncOverlap when overlap)."""
    if features is None:
        features = [AsyncOverlap()] if overlap else []
    s = Scheduler(cfg, features)
    runner = ContractRunner(
        cfg.block_size,
        cfg.num_gpu_blocks,
        cfg.num_cpu_blocks,
        VOCAB,
        appends_sampled=overlap,
        proposer=proposer,
    )

    def launch() -> Step:
        out = s.schedule()
        check_block_accounting(s)
        return out, runner.execute(out)  # steps run in order: N+1 may run before N's update

    pending = sorted(specs, key=lambda sp: sp.arrival_step)
    in_flight: Step | None = None
    for step_no in range(3000):
        while pending and pending[0].arrival_step <= step_no:
            sp = pending.pop(0)
            s.add_request(Request(sp.engine_request()))
        for sp in specs:  # aborts land between steps: under overlap, while a step is in flight
            req = s.requests.get(sp.rid)
            if sp.abort_step == step_no and req is not None and not req.is_finished:
                s.abort_requests([sp.rid])
        if not pending and not s.has_unfinished_requests() and in_flight is None:
            break
        current = in_flight or launch()
        in_flight = launch() if overlap and s.has_unfinished_requests() else None
        s.update_from_output(*current)
        check_block_accounting(s)
    else:
        raise AssertionError("workload did not drain: a request starved")
    return s


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_async_scheduling_gives_every_request_the_synchronous_tokens(data):
    cfg = data.draw(configs())
    specs = data.draw(workloads(cfg))
    sync, overlapped = run(cfg, specs, overlap=False), run(cfg, specs, overlap=True)
    event(f"preemptions={'yes' if overlapped.num_preemptions else 'no'}")
    for sp in specs:
        req, ref = overlapped.requests[sp.rid], sync.requests[sp.rid]
        assert req.is_finished and ref.is_finished
        want, reason = expected_for(sp, cfg)
        if sp.abort_step is not None:  # aborted somewhere: whatever it has is a prefix
            assert req.output_token_ids == want[: len(req.output_token_ids)]
            continue
        assert req.output_token_ids == want == ref.output_token_ids, sp.rid
        assert req.status == ref.status and req.status.finish_reason == reason
        assert req.num_output_placeholders == 0
    check_every_block_returned(overlapped, cfg)


def test_a_request_stopped_by_its_in_flight_token_is_not_scheduled_past_its_cap():
    """max_tokens reached by the token in flight: no speculative step; EOS: one, then dropped."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=64, block_size=4, num_gpu_blocks=16, max_model_len=64
    )
    s = Scheduler(cfg, [AsyncOverlap()])
    s.add_request(Request(EngineRequest("capped", [1, 2, 3], SamplingParams(max_tokens=1))))
    first = s.schedule()
    assert first.num_scheduled_tokens == {"capped": 3}
    second = s.schedule()  # its one token is in flight: nothing more to run
    assert second.num_scheduled_tokens == {}
    [out] = s.update_from_output(first, ModelRunnerOutput(["capped"], [[9]]))
    assert out.finished and out.new_token_ids == [9] and out.finish_reason == "length"
    assert s.kv.num_free_blocks == 16


def test_a_token_in_flight_for_a_reused_id_does_not_reach_the_new_request():
    cfg = SchedulerConfig(
        max_num_batched_tokens=64, block_size=4, num_gpu_blocks=16, max_model_len=64
    )
    s = Scheduler(cfg, [AsyncOverlap()])
    params = SamplingParams(max_tokens=5)
    s.add_request(Request(EngineRequest("r", [1, 2, 3], params)))
    first = s.schedule()
    second = s.schedule()
    s.update_from_output(first, ModelRunnerOutput(["r"], [[4]]))
    s.abort_requests(["r"])
    s.add_request(Request(EngineRequest("r", [5, 6], params)))
    third = s.schedule()
    assert [n.req_id for n in third.scheduled_new_reqs] == ["r"]
    assert s.update_from_output(second, ModelRunnerOutput(["r"], [[8]], failed={"r": "x"})) == []
    new = s.requests["r"]
    assert new.output_token_ids == [] and not new.is_finished
