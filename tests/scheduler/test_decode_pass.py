"""The running pass and the append loop as a decode step exercises them: a block is asked for only
when a token starts one, a request taken back out of the step is in none of its rows, and the
tokens kept are handed on as they were sampled (bench/scheduler_overhead.py times this path)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from scheduler import (
    EngineRequest,
    ModelRunnerOutput,
    Request,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from scheduler.finished import append_tokens
from scheduler.outputs import RequestOutput, request_output
from tests.scheduler.contract_runner import ContractRunner

BLOCK = 4


def make(num_gpu_blocks: int, **overrides: Any) -> tuple[Scheduler, ContractRunner]:
    cfg = SchedulerConfig(
        max_num_batched_tokens=64,
        max_num_seqs=8,
        block_size=BLOCK,
        num_gpu_blocks=num_gpu_blocks,
        max_model_len=num_gpu_blocks * BLOCK,
        **overrides,
    )
    return Scheduler(cfg), ContractRunner(BLOCK, num_gpu_blocks, cfg.cpu_blocks)


def request(
    rid: str, prompt_len: int, max_tokens: int = 64, outputs: tuple[int, ...] = ()
) -> Request:
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=[7])
    prompt = [10 + i for i in range(prompt_len)]
    return Request(EngineRequest(rid, prompt, params, output_token_ids=list(outputs)))


def test_a_decode_gets_a_new_block_exactly_in_the_steps_whose_token_starts_one() -> None:
    sched, _ = make(num_gpu_blocks=64, enable_prefix_caching=False)
    sched.add_request(request("a", prompt_len=6))
    sched.update_from_output(out := sched.schedule(), ModelRunnerOutput(["a"], [[11]]))
    assert out.scheduled_new_reqs[0].block_ids == [0, 1]
    seen = []
    for _ in range(10):
        start = sched.requests["a"].num_computed_tokens
        out = sched.schedule()
        (blocks,) = out.scheduled_cached_reqs.new_block_ids
        seen.append((start, len(blocks)))
        assert len(sched.kv.blocks_of("a")) == -(-(start + 1) // BLOCK)
        sched.update_from_output(out, ModelRunnerOutput(["a"], [[11]]))
    # Positions 8 and 12 start blocks; every other decode writes into the block it has.
    assert seen == [(s, 1 if s % BLOCK == 0 else 0) for s in range(6, 16)]


def test_a_request_taken_back_out_of_the_step_later_in_the_pass_is_in_none_of_its_rows() -> None:
    # Three blocks: "a" (2-token prompt) holds one, "b" (8 tokens) two. In the next step "a"'s
    # decode fits its block and is scheduled; "b"'s starts a block, none is free, and the
    # least-progress victim is "a", already in the step.
    sched, runner = make(num_gpu_blocks=3, preemption_victim="least_progress")
    sched.add_request(request("a", prompt_len=2))
    sched.add_request(request("b", prompt_len=8))
    first = sched.schedule()
    assert sorted(first.num_scheduled_tokens) == ["a", "b"]
    sched.update_from_output(first, runner.execute(first))
    out = sched.schedule()
    assert out.preempted_req_ids == {"a"}
    assert out.num_scheduled_tokens == {"b": 1}
    assert out.scheduled_cached_reqs.req_ids == ["b"]
    assert out.scheduled_new_reqs == []
    assert out.total_num_scheduled_tokens == 1
    assert sched.requests["a"].status is RequestStatus.PREEMPTED
    assert sched.requests["a"].num_computed_tokens == 0
    runner.execute(out)  # the runner's check of every slot it reads passes


def test_append_tokens_hands_on_the_sampled_list_when_all_are_kept_and_a_prefix_at_a_stop() -> None:
    r = request("a", prompt_len=3)
    sampled = [20, 21]
    kept, status = append_tokens(r, sampled, max_model_len=256)
    assert kept is sampled and status is None
    stopped = [22, 7, 23]  # 7 is a stop token: 23 is never appended
    kept, status = append_tokens(r, stopped, max_model_len=256)
    assert kept == [22, 7] and status is RequestStatus.FINISHED_STOPPED
    assert r.output_token_ids == [20, 21, 22, 7]
    assert r.all_token_ids == [10, 11, 12, 20, 21, 22, 7]


def test_a_resumed_requests_earlier_outputs_count_toward_max_tokens() -> None:
    r = request("a", prompt_len=3, max_tokens=5, outputs=(30, 31, 32))
    assert r.max_num_tokens == 3 + 5
    assert append_tokens(r, [33], max_model_len=256) == ([33], None)
    assert append_tokens(r, [34, 35], max_model_len=256) == (
        [34],
        RequestStatus.FINISHED_LENGTH_CAPPED,
    )
    assert len(r.output_token_ids) == 5


def test_request_output_fills_every_field_of_the_output_as_the_class_would() -> None:
    r = request("a", prompt_len=3)
    r.num_cached_tokens = 2
    logprobs = [[(20, -0.5)]]
    append_tokens(r, [20], max_model_len=256)
    out = request_output(r, [20], logprobs)
    # Equality reads every field: one that request_output left unset raises here.
    assert out == RequestOutput("a", [20], False, None, 3, 1, 2, logprobs)
    assert [getattr(out, f.name) for f in fields(RequestOutput)][-4:] == [None] * 4
    r.status = RequestStatus.FINISHED_ABORTED
    r.num_cached_tokens = None  # never admitted
    assert request_output(r, [], error="boom") == RequestOutput(
        "a", [], True, "abort", 3, 1, 0, None, "boom"
    )
