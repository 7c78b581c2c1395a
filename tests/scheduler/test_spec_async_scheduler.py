"""Speculation and async overlap together (SpecDecoding(overlap=True) before AsyncOverlap): step N+1
is scheduled with draft slots before step N's proposals, or how many of N's drafts are kept, are
known; the runner fills the slots with its own proposals and starts each row where it really is
(workers/spec_async.py, which the contract runner mirrors).

Under random workloads (hypothesis: chunked prefill, prefix hits, preemption by recompute and swap,
aborts between steps, stop tokens, max_tokens and max_model_len caps), every request produces
exactly the tokens the fake model gives it, the KV slots every step reads hold the right tokens,
no block is leaked or owned twice, and once nothing is in flight the scheduler's token counts are
the runner's again.
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from scheduler import (
    EngineRequest,
    ModelRunnerOutput,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from scheduler.features_async import AsyncOverlap
from scheduler.features_spec import PLACEHOLDER, SpecDecoding
from scheduler.preempt import preempt
from scheduler.speculative import SpeculativeConfig
from scheduler.step import Step
from tests.scheduler.test_async_scheduler import run
from tests.scheduler.test_scheduler_properties import (
    check_every_block_returned,
    configs,
    expected_for,
    workloads,
)
from tests.scheduler.test_spec_scheduler import proposer, spec_configs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_speculation_under_overlap_gives_every_request_its_tokens_and_leaks_nothing(data):
    cfg = data.draw(configs())
    specs = data.draw(workloads(cfg))
    spec = data.draw(spec_configs())
    right = data.draw(st.sampled_from([0.0, 0.5, 0.9, 1.0]))
    propose = proposer(data.draw(st.integers(0, 2**16)), right, spec.num_tokens)
    feature = SpecDecoding(spec, overlap=True)
    s = run(cfg, specs, overlap=True, features=[feature, AsyncOverlap()], proposer=propose)
    stats = s.stats()
    event(f"accepted={'yes' if stats.num_spec_accepted_tokens else 'no'}")
    event(f"preemptions={'yes' if s.num_preemptions else 'no'}")
    for sp in specs:
        req = s.requests[sp.rid]
        assert req.is_finished
        assert req.num_output_placeholders == 0
        want, reason = expected_for(sp, cfg)
        if sp.abort_step is not None:  # aborted somewhere: whatever it has is a prefix
            assert req.output_token_ids == want[: len(req.output_token_ids)]
            continue
        assert req.output_token_ids == want, sp.rid
        assert req.status.finish_reason == reason
    assert stats.num_spec_accepted_tokens <= stats.num_spec_proposed_tokens
    check_every_block_returned(s, cfg)


def _cfg() -> SchedulerConfig:
    return SchedulerConfig(
        max_num_batched_tokens=64, block_size=4, num_gpu_blocks=32, max_model_len=128
    )


def test_the_step_after_a_verify_row_is_scheduled_on_its_optimistic_end_and_settled_after():
    """Step 2 is scheduled while step 1 (a verify row of 3 drafts) runs: it starts past all
    three, with placeholder slots; step 1 keeping one of them moves the count back by two."""
    s = Scheduler(_cfg(), [SpecDecoding(SpeculativeConfig(num_tokens=3), True), AsyncOverlap()])
    s.add_request(Request(EngineRequest("a", [1, 2, 3, 4], SamplingParams(max_tokens=50))))
    prefill = s.schedule()
    first = s.schedule()  # before the prefill's token or any proposal is known: k slots
    assert first.scheduled_spec_tokens == {"a": [PLACEHOLDER] * 3}
    assert first.num_scheduled_tokens == {"a": 4}
    assert first.scheduled_cached_reqs.num_computed_tokens == [4]
    s.update_from_output(prefill, ModelRunnerOutput(["a"], [[7]], spec_token_ids=[[8, 9, 10]]))
    second = s.schedule()  # step `first` may add 4 tokens: the row starts after all of them
    assert second.scheduled_cached_reqs.num_computed_tokens == [8]
    assert second.scheduled_spec_tokens == {"a": [PLACEHOLDER] * 3}
    req = s.requests["a"]
    assert req.num_output_placeholders == 4 + 4
    s.update_from_output(first, ModelRunnerOutput(["a"], [[8, 5]], spec_token_ids=[[6]]))
    assert req.output_token_ids == [7, 8, 5]
    assert req.num_computed_tokens == 4 + 2 + 4  # 2 of `first` kept; `second` still in flight
    assert req.num_output_placeholders == 4
    s.update_from_output(second, ModelRunnerOutput(["a"], [[6, 1]]))
    assert req.num_computed_tokens == len(req.all_token_ids) - 1  # exact: nothing in flight
    assert req.num_output_placeholders == 0
    assert s.stats().num_spec_accepted_tokens == 2 and s.stats().num_spec_proposed_tokens == 6


def test_a_request_swapped_out_with_drafts_in_flight_resumes_at_its_true_end():
    cfg = SchedulerConfig(
        max_num_batched_tokens=64,
        block_size=4,
        num_gpu_blocks=32,
        num_cpu_blocks=32,
        max_model_len=128,
        preemption_mode="swap",
    )
    s = Scheduler(cfg, [SpecDecoding(SpeculativeConfig(num_tokens=2), True), AsyncOverlap()])
    s.add_request(Request(EngineRequest("a", [1, 2, 3], SamplingParams(max_tokens=50))))
    prefill = s.schedule()
    verify = s.schedule()
    assert verify.scheduled_spec_tokens == {"a": [PLACEHOLDER] * 2}
    s.update_from_output(prefill, ModelRunnerOutput(["a"], [[7]]))
    req = s.requests["a"]
    preempt(s, req, Step(budget=0))  # as a full pool would, while `verify` is in flight
    assert req.status.name == "SWAPPED"
    s.update_from_output(verify, ModelRunnerOutput(["a"], [[9]]))  # no draft kept
    assert req.output_token_ids == [7, 9]
    assert req.num_computed_tokens == len(req.all_token_ids) - 1
    assert req.num_output_placeholders == 0
