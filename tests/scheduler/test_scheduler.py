"""The continuous-batching scheduler, behaviour by behaviour."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import (
    EngineRequest,
    ModelRunnerOutput,
    Request,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from scheduler.scheduler import FINISHED_RETENTION
from scheduler.stop import check_stop, is_stop_token
from tests.scheduler.contract_runner import ContractRunner, expected_output


def make(**overrides) -> tuple[Scheduler, ContractRunner]:
    cfg = SchedulerConfig(
        **{
            "max_num_batched_tokens": 2048,
            "max_num_seqs": 128,
            "block_size": 16,
            "num_gpu_blocks": 1024,
            "max_model_len": 8192,
            **overrides,
        }
    )
    return Scheduler(cfg), ContractRunner(cfg.block_size, cfg.num_gpu_blocks, cfg.cpu_blocks)


def req(
    rid: str,
    n: int,
    max_tokens: int = 16,
    *,
    base: int = 100,
    eos: int | None = None,
    priority: int = 0,
    tenant: str = "default",
    ignore_eos: bool = False,
    stop_token_ids: list[int] | None = None,
) -> Request:
    prompt = [base + (i % 1000) for i in range(n)]
    params = SamplingParams(
        max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=stop_token_ids or []
    )
    return Request(
        EngineRequest(
            rid,
            prompt,
            params,
            eos_token_ids=() if eos is None else (eos,),
            priority=priority,
            tenant=tenant,
        )
    )


def step(s: Scheduler, r: ContractRunner) -> tuple[SchedulerOutput, list]:
    out = s.schedule()
    return out, s.update_from_output(out, r.execute(out))


def run_to_end(s: Scheduler, r: ContractRunner, max_steps: int = 10_000) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return tokens
        _, outs = step(s, r)
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError("requests did not finish")


def used_blocks(s: Scheduler) -> int:
    return s.kv.pool.num_blocks - s.kv.num_free_blocks


# ---- token budget and chunked prefill ---------------------------------------------------------
def test_budget_goes_to_running_first_then_chunks_a_long_prompt():
    s, r = make()
    s.add_request(req("running", 99, max_tokens=50))
    step(s, r)  # prefill 99, sample one token: now at 99 computed of 100
    assert (s.requests["running"].num_computed_tokens, s.requests["running"].num_tokens) == (
        99,
        100,
    )
    s.add_request(req("long", 4096))
    s.add_request(req("short", 128))
    out, _ = step(s, r)
    assert out.num_scheduled_tokens == {"running": 1, "long": 2047}
    assert out.total_num_scheduled_tokens == 2048
    assert s.requests["short"].status == RequestStatus.WAITING


def test_long_prompt_is_chunked_across_steps_alongside_decodes():
    s, r = make(max_num_batched_tokens=64)
    s.add_request(req("decoder", 10, max_tokens=100))
    step(s, r)
    s.add_request(req("long", 200))
    chunks = []
    for _ in range(4):
        out, _ = step(s, r)
        assert out.num_scheduled_tokens["decoder"] == 1
        chunks.append(out.num_scheduled_tokens["long"])
    assert chunks == [63, 63, 63, 11]
    assert s.requests["long"].num_output_tokens == 1  # sampled only when the prompt was done


def test_long_prefill_threshold_caps_each_chunk():
    s, r = make(long_prefill_token_threshold=32)
    s.add_request(req("a", 100))
    s.add_request(req("b", 100))
    out, _ = step(s, r)
    assert out.num_scheduled_tokens == {"a": 32, "b": 32}


def test_max_num_seqs_caps_batch_width():
    s, r = make(max_num_seqs=3)
    for i in range(5):
        s.add_request(req(f"r{i}", 10))
    out, _ = step(s, r)
    assert len(out.num_scheduled_tokens) == 3


def test_arrival_takes_a_freed_slot_on_the_very_next_step():
    s, r = make(max_num_seqs=1)
    s.add_request(req("a", 10, max_tokens=2))
    step(s, r)
    s.add_request(req("b", 10))
    out, outs = step(s, r)  # a finishes in this step
    assert out.num_scheduled_tokens == {"a": 1} and outs[0].finished
    out, _ = step(s, r)
    assert out.num_scheduled_tokens == {"b": 10}
    assert out.finished_req_ids == {"a"}


def test_sampling_happens_exactly_when_the_sequence_is_fully_computed():
    s, r = make(max_num_batched_tokens=40)
    s.add_request(req("a", 100))
    lens = []
    for _ in range(3):
        _, outs = step(s, r)
        lens.append([len(o.new_token_ids) for o in outs])
    assert lens == [[], [], [1]]


# ---- stop conditions ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "eos,ignore_eos,stop_ids",
    [(None, False, []), ("first", False, []), ("first", True, []), (None, False, "first")],
)
def test_stop_conditions(eos, ignore_eos, stop_ids):
    s, r = make()
    first = expected_output("x", 20, 30, None, [], 8192)[0][3]  # the 4th token the fake model emits
    eos_id = first if eos == "first" else None
    stops = [first] if stop_ids == "first" else []
    s.add_request(
        req("x", 20, max_tokens=30, eos=eos_id, ignore_eos=ignore_eos, stop_token_ids=stops)
    )
    tokens = run_to_end(s, r)["x"]
    want, reason = expected_output("x", 20, 30, None if ignore_eos else eos_id, stops, 8192)
    assert tokens == want
    assert s.requests["x"].status.finish_reason == reason
    assert used_blocks(s) == 0


def test_max_model_len_caps_generation():
    s, r = make(max_model_len=64, num_gpu_blocks=8)
    s.add_request(req("x", 60, max_tokens=100, ignore_eos=True))
    tokens = run_to_end(s, r)["x"]
    assert len(tokens) == 4 and s.requests["x"].status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_prompt_of_exactly_max_model_len_yields_one_token():
    s, r = make(max_model_len=32, num_gpu_blocks=4)
    s.add_request(req("x", 32))
    assert len(run_to_end(s, r)["x"]) == 1


STOPPED, CAPPED = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED


@pytest.mark.parametrize(
    "token,num_outputs,num_tokens,ignore_eos,expect",
    [
        (7, 1, 10, False, None),
        (2, 1, 10, False, STOPPED),  # EOS
        (2, 1, 10, True, None),  # EOS ignored
        (3, 1, 10, True, STOPPED),  # a stop token id stops even with ignore_eos
        (7, 4, 10, False, CAPPED),  # max_tokens=4 outputs
        (7, 1, 16, False, CAPPED),  # max_model_len=16 tokens in all
        (3, 4, 16, False, STOPPED),  # a stop token wins over the caps the same token reaches
    ],
)
def test_check_stop_decides_stop_ids_eos_and_the_length_caps(
    token, num_outputs, num_tokens, ignore_eos, expect
):
    params = SamplingParams(max_tokens=4, ignore_eos=ignore_eos, stop_token_ids=[3])
    r = Request(EngineRequest("x", [9] * (num_tokens - num_outputs), params, eos_token_ids=(2,)))
    outputs = [7] * (num_outputs - 1) + [token]
    r.output_token_ids.extend(outputs)
    r.all_token_ids.extend(outputs)
    assert check_stop(r, max_model_len=16) == expect
    assert is_stop_token(r, token) == (expect is STOPPED)


def test_every_output_reports_the_prefix_hit_of_the_first_admission_and_never_less_than_zero():
    s, r = make(block_size=4, num_gpu_blocks=64, max_model_len=256)
    s.add_request(req("a", 12, max_tokens=1))
    run_to_end(s, r)
    s.add_request(req("b", 12))  # a's prompt: two full blocks cached (the last token computes)
    s.add_request(req("never", 12, base=500))
    (aborted,) = s.abort_requests(["never"])  # never admitted
    assert (aborted.finish_reason, aborted.num_cached_tokens) == ("abort", 0)
    _, outs = step(s, r)
    assert [(o.request_id, o.num_cached_tokens) for o in outs] == [("b", 8)]
    out = s.schedule()
    (failed,) = s.update_from_output(out, ModelRunnerOutput([], [], failed={"b": "boom"}))
    assert (failed.finish_reason, failed.error, failed.num_cached_tokens) == ("error", "boom", 8)


def test_finished_requests_stay_readable_for_the_last_finished_retention_finishes():
    for retention, kept in ((FINISHED_RETENTION, {"a", "b", "c"}), (2, {"b", "c"})):
        cfg = SchedulerConfig(num_gpu_blocks=64, max_model_len=256)
        s = Scheduler(cfg, finished_retention=retention)
        for rid in "abc":
            s.add_request(req(rid, 5, max_tokens=1))
        run_to_end(s, ContractRunner(16, 64, 0))
        assert set(s.requests) == kept


# ---- abort --------------------------------------------------------------------------------------
def test_abort_frees_blocks_at_once_and_reports_in_next_step():
    s, r = make()
    s.add_request(req("a", 100, max_tokens=50))
    s.add_request(req("w", 10))
    step(s, r)
    assert used_blocks(s) > 0
    outs = s.abort_requests(["a", "unknown"])
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [("a", True, "abort")]
    assert s.requests["a"].status == RequestStatus.FINISHED_ABORTED
    out, _ = step(s, r)
    assert "a" in out.finished_req_ids and "a" not in out.num_scheduled_tokens
    s.abort_requests(["w"])
    assert not s.has_unfinished_requests()
    step(s, r)
    assert used_blocks(s) == 0


def test_tokens_sampled_for_a_request_aborted_mid_step_are_dropped():
    s, r = make()
    s.add_request(req("a", 10))
    out = s.schedule()
    runner_out = r.execute(out)
    s.abort_requests(["a"])
    assert s.update_from_output(out, runner_out) == []
    assert s.requests["a"].output_token_ids == []


# ---- invalid input
# --------------------------------------------------------------------------------
def test_invalid_requests_raise_value_error_naming_the_field():
    s, _ = make(max_model_len=64, num_gpu_blocks=8)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Request(EngineRequest("e", [], SamplingParams()))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        s.add_request(req("long", 65))
    s.add_request(req("dup", 5))
    with pytest.raises(ValueError, match="request_id"):
        s.add_request(req("dup", 5))


@pytest.mark.parametrize(
    "field,value",
    [
        ("num_gpu_blocks", 3),
        ("policy", "lottery"),
        ("preemption_mode", "drop"),
        ("preemption_victim", "random"),
        ("max_num_batched_tokens", 0),
        ("watermark", 1.5),
        ("num_cpu_blocks", -1),
    ],
)
def test_unworkable_config_raises_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(
            **{"max_model_len": 64, "block_size": 16, "num_gpu_blocks": 8, field: value}
        )


def test_swap_mode_needs_a_cpu_pool():
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        SchedulerConfig(preemption_mode="swap", num_cpu_blocks=0)


# ---- prefix caching
# -------------------------------------------------------------------------------
def test_prefix_hit_shows_as_computed_tokens_in_new_request_data():
    s, r = make()
    s.add_request(req("a", 100, max_tokens=1))
    run_to_end(s, r)
    s.add_request(req("b", 100, max_tokens=1))
    out, _ = step(s, r)
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 96  # six full blocks of 16
    assert out.num_scheduled_tokens["b"] == 4
    assert s.stats().prefix_cache_hit_rate == pytest.approx(96 / 200)


def test_full_hit_still_computes_the_last_token():
    s, r = make()
    s.add_request(req("a", 64, max_tokens=1))
    run_to_end(s, r)
    s.add_request(req("b", 64, max_tokens=1))
    out, _ = step(s, r)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 48
    assert out.num_scheduled_tokens["b"] == 16


@pytest.mark.parametrize("num_outputs", [1, 5])
def test_a_resumed_request_computes_its_prompt_then_its_chosen_tokens_in_separate_steps(
    num_outputs,
):
    """A request resumed with tokens already chosen (a disaggregated decode, a migration) never
    runs its prompt's rest and those tokens in one chunk: the prompt ends a step, as in the fresh
    prefill that chose them, and a single chosen token then runs as a decode row."""
    s, r = make()
    s.add_request(req("a", 40, max_tokens=1))
    run_to_end(s, r)
    fresh = req("b", 40, max_tokens=8)
    chosen = list(range(7, 7 + num_outputs))
    s.add_request(
        Request(
            EngineRequest(
                "b", fresh.prompt_token_ids, fresh.sampling_params, output_token_ids=chosen
            )
        )
    )
    out, _ = step(s, r)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 32  # two full blocks hit
    assert out.num_scheduled_tokens["b"] == 8  # the prompt's rest, nothing sampled
    out, outs = step(s, r)
    assert out.num_scheduled_tokens["b"] == num_outputs
    (sampled,) = [o.new_token_ids for o in outs if o.request_id == "b"]
    assert len(sampled) == 1


def test_a_fresh_long_prompt_is_not_split_by_the_prompt_boundary_rule():
    s, r = make()
    s.add_request(req("a", 40, max_tokens=2))
    out, _ = step(s, r)
    assert out.num_scheduled_tokens["a"] == 40


def test_blocks_are_shared_by_reference_while_both_run():
    s, r = make()
    s.add_request(req("a", 64, max_tokens=20))
    step(s, r)
    step(s, r)  # a's prompt blocks are registered once its prefill has run
    s.add_request(req("b", 64, max_tokens=20))
    step(s, r)
    shared = s.kv.blocks_of("a")[:3]
    assert s.kv.blocks_of("b")[:3] == shared
    assert all(s.kv.pool.ref_cnt[b] == 2 for b in shared)
    run_to_end(s, r)
    assert used_blocks(s) == 0


def test_freed_blocks_stay_cached_until_evicted_least_recently_used_first():
    s, r = make(num_gpu_blocks=8, max_model_len=128)
    s.add_request(req("a", 33, max_tokens=1, base=1000))  # 2 full blocks cached
    run_to_end(s, r)
    s.add_request(req("b", 33, max_tokens=1, base=2000))
    run_to_end(s, r)
    # A 5-block request must evict: the never-used blocks go first, then a's (older) ones.
    s.add_request(req("c", 80 - 1, max_tokens=1, base=3000))
    run_to_end(s, r)
    s.add_request(req("b2", 33, max_tokens=1, base=2000))
    out, _ = step(s, r)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 32  # b's blocks survived
    s.add_request(req("a2", 33, max_tokens=1, base=1000))
    out, _ = step(s, r)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0  # a's were evicted


def test_prefix_caching_off_never_hits():
    s, r = make(enable_prefix_caching=False)
    for rid in ("a", "b"):
        s.add_request(req(rid, 100, max_tokens=1))
        out, _ = step(s, r)
        assert out.scheduled_new_reqs[0].num_computed_tokens == 0
        run_to_end(s, r)


# ---- preemption
# -----------------------------------------------------------------------------------
def small(**kw):
    return make(
        **{
            "num_gpu_blocks": 6,
            "block_size": 4,
            "max_model_len": 24,
            "max_num_batched_tokens": 64,
            **kw,
        }
    )


def fill_and_grow(s, r):
    """Three requests of 8 tokens that each need a new block every 4 decode steps."""
    for i in range(3):
        s.add_request(req(f"r{i}", 8, max_tokens=12, base=100 * (i + 1)))
    step(s, r)


def test_recompute_preemption_takes_the_newest_and_it_resumes_ahead_of_new_arrivals():
    s, r = small()
    fill_and_grow(s, r)
    for _ in range(6):
        out, _ = step(s, r)
        if out.preempted_req_ids:
            break
    assert out.preempted_req_ids == {"r2"}
    assert s.requests["r2"].status == RequestStatus.PREEMPTED
    assert s.requests["r2"].num_computed_tokens == 0
    s.add_request(req("late", 4, base=900))
    admitted_at: dict[str, int] = {}
    for i in range(200):
        if not s.has_unfinished_requests():
            break
        out, _ = step(s, r)
        for rid in [n.req_id for n in out.scheduled_new_reqs] + [
            rid
            for rid, res in zip(
                out.scheduled_cached_reqs.req_ids, out.scheduled_cached_reqs.resumed
            )
            if res
        ]:
            admitted_at.setdefault(rid, i)
    assert admitted_at["r2"] <= admitted_at["late"]
    assert used_blocks(s) == 0


def test_step_that_preempts_admits_nothing_new():
    s, r = small()
    fill_and_grow(s, r)
    s.add_request(req("late", 4, base=900))
    for _ in range(10):
        out, _ = step(s, r)
        if out.preempted_req_ids:
            assert out.scheduled_new_reqs == []
            return
    raise AssertionError("no preemption happened")


def test_least_progress_victim_is_the_request_with_fewest_computed_tokens():
    s, r = small(preemption_victim="least_progress")
    s.add_request(req("old", 8, max_tokens=12, base=100))
    step(s, r)
    step(s, r)
    s.add_request(req("young", 4, max_tokens=12, base=200))
    s.add_request(req("mid", 8, max_tokens=12, base=300))
    for _ in range(10):
        out, _ = step(s, r)
        if out.preempted_req_ids:
            break
    victims = out.preempted_req_ids
    computed = {rid: s.requests[rid].num_preemptions for rid in ("old", "young", "mid")}
    assert victims and "old" not in victims, computed


def test_swap_preemption_keeps_progress_and_copies_blocks_both_ways():
    s, r = small(preemption_mode="swap", num_cpu_blocks=8)
    fill_and_grow(s, r)
    copies_out = copies_in = 0
    while s.has_unfinished_requests():
        out, _ = step(s, r)
        if out.blocks_to_swap_out:
            (victim,) = out.preempted_req_ids
            assert s.requests[victim].status == RequestStatus.SWAPPED
            assert s.requests[victim].num_computed_tokens > 0  # progress kept
            assert s.stats().num_swapped >= 1
        copies_out += len(out.blocks_to_swap_out)
        copies_in += len(out.blocks_to_swap_in)
    assert copies_out > 0 and copies_in == copies_out
    for i in range(3):
        rid = f"r{i}"
        assert s.requests[rid].output_token_ids == expected_output(rid, 8, 12, None, [], 24)[0]
    assert used_blocks(s) == 0 and len(s.kv.cpu_free) == 8


@pytest.mark.parametrize(
    "threshold,expect", [(0, RequestStatus.SWAPPED), (10_000, RequestStatus.PREEMPTED)]
)
def test_auto_mode_swaps_only_past_the_computed_token_threshold(threshold, expect):
    s, r = small(preemption_mode="auto", num_cpu_blocks=8, swap_min_computed_tokens=threshold)
    fill_and_grow(s, r)
    for _ in range(10):
        out, _ = step(s, r)
        if out.preempted_req_ids:
            (victim,) = out.preempted_req_ids
            assert s.requests[victim].status == expect
            return
    raise AssertionError("no preemption happened")


def test_swap_falls_back_to_recompute_when_the_cpu_pool_is_full():
    s, r = small(preemption_mode="swap", num_cpu_blocks=1)
    fill_and_grow(s, r)
    for _ in range(10):
        out, _ = step(s, r)
        if out.preempted_req_ids:
            (victim,) = out.preempted_req_ids
            assert s.requests[victim].status == RequestStatus.PREEMPTED
            assert out.blocks_to_swap_out == []
            return
    raise AssertionError("no preemption happened")


# ---- queue policies
# -------------------------------------------------------------------------------
def test_priority_orders_admission_lower_number_first_ties_by_arrival():
    s, r = make(policy="priority", max_num_seqs=1)
    s.add_request(req("low", 4, max_tokens=1, priority=5))
    s.add_request(req("high_a", 4, max_tokens=1, priority=1))
    s.add_request(req("high_b", 4, max_tokens=1, priority=1))
    order = []
    while s.has_unfinished_requests():
        out, _ = step(s, r)
        order += [n.req_id for n in out.scheduled_new_reqs]
    assert order == ["high_a", "high_b", "low"]


def test_priority_policy_displaces_a_less_urgent_running_request_when_blocks_are_short():
    s, r = make(policy="priority", num_gpu_blocks=4, block_size=4, max_model_len=16)
    s.add_request(req("bulk", 12, max_tokens=4, priority=10))
    step(s, r)
    s.add_request(req("urgent", 12, max_tokens=4, priority=0))
    out, _ = step(s, r)
    assert out.preempted_req_ids == {"bulk"}
    assert [n.req_id for n in out.scheduled_new_reqs] == ["urgent"]
    run_to_end(s, r)
    assert s.requests["bulk"].output_token_ids == expected_output("bulk", 12, 4, None, [], 16)[0]


def test_displacement_counts_only_blocks_that_would_really_be_freed():
    # "bulk" shares its prompt blocks with "peer", which is as urgent as the newcomer: preempting
    # bulk frees only its own blocks, too few for "urgent", so nothing may be preempted for it.
    s, r = make(policy="priority", num_gpu_blocks=6, block_size=4, max_model_len=24)
    s.add_request(req("peer", 12, max_tokens=8, priority=0))
    step(s, r)
    s.add_request(req("bulk", 12, max_tokens=8, priority=10))
    while s.kv.num_free_blocks > 0:
        step(s, r)
    assert s.kv.num_reclaimable_blocks(["bulk"]) < s.kv.num_blocks_needed(12)
    s.add_request(req("urgent", 12, max_tokens=4, priority=0, base=500))
    out, _ = step(s, r)
    assert not out.preempted_req_ids
    assert s.requests["bulk"].num_preemptions == 0
    run_to_end(s, r)
    assert all(s.requests[rid].is_finished for rid in ("peer", "bulk", "urgent"))


def test_fcfs_never_displaces_running_requests():
    s, r = make(num_gpu_blocks=4, block_size=4, max_model_len=16)
    s.add_request(req("bulk", 12, max_tokens=4, priority=10))
    step(s, r)
    s.add_request(req("urgent", 12, max_tokens=4, priority=0))
    out, _ = step(s, r)
    assert not out.preempted_req_ids and out.scheduled_new_reqs == []


def test_fair_policy_keeps_a_flooding_tenant_from_starving_a_light_one():
    s, r = make(policy="fair", max_num_seqs=2)
    for i in range(20):
        s.add_request(req(f"flood{i}", 32, max_tokens=4, tenant="flood", base=100 + i))
    step(s, r)
    for i in range(3):
        s.add_request(req(f"light{i}", 32, max_tokens=4, tenant="light", base=500 + i))
    admitted = []
    while s.has_unfinished_requests():
        out, _ = step(s, r)
        admitted += [n.req_id for n in out.scheduled_new_reqs]
    light_positions = [admitted.index(f"light{i}") for i in range(3)]
    # Under FCFS the light tenant would wait behind all 18 remaining flood requests.
    assert max(light_positions) < 8, admitted


def test_fair_counter_lift_gives_a_returning_tenant_no_banked_credit():
    s, r = make(policy="fair", max_num_seqs=1)
    for i in range(6):
        s.add_request(req(f"a{i}", 16, max_tokens=2, tenant="a", base=100 + i))
    run_to_end(s, r)
    counters = s.waiting.counters
    s.add_request(req("b0", 16, max_tokens=2, tenant="b"))
    assert counters["b"] == pytest.approx(counters["a"])  # lifted to the last tenant to leave


def test_watermark_keeps_blocks_out_of_reach_of_new_admissions():
    s, r = make(num_gpu_blocks=10, block_size=4, max_model_len=16, watermark=0.3)
    s.add_request(req("a", 16, max_tokens=1))
    s.add_request(req("b", 16, max_tokens=1))
    out, _ = step(s, r)
    assert list(out.num_scheduled_tokens) == ["a"]  # b would leave 2 < 3 watermark blocks free


# ---- stats --------------------------------------------------------------------------------------
def test_stats_reflect_queues_and_kv_usage():
    s, r = make(max_num_seqs=1)
    s.add_request(req("a", 32))
    s.add_request(req("b", 32))
    step(s, r)
    st = s.stats()
    assert (st.num_running, st.num_waiting, st.num_swapped) == (1, 1, 0)
    assert st.kv_cache_usage == pytest.approx(
        2 / 1024
    )  # the sampled 33rd token gets its slot next step
    assert st.num_preemptions == 0


def test_update_with_runner_output_for_unknown_ids_is_ignored():
    s, _ = make()
    s.add_request(req("a", 4))
    out = s.schedule()
    assert s.update_from_output(out, ModelRunnerOutput(["ghost"], [[1]])) == []


def test_swap_in_waits_for_room_for_every_swapped_block():
    s, r = small(preemption_mode="swap", num_cpu_blocks=8)
    s.add_request(req("a", 8, max_tokens=12))
    step(s, r)
    victim = s.requests["a"]
    s.running.remove(victim)
    victim.status = RequestStatus.SWAPPED
    s.kv.swap_out(victim)
    s.kv.req_cpu_blocks["a"].append(s.kv.cpu_free.pop())  # one block more than its tokens need
    s.waiting.prepend(victim)
    s.kv.pool.allocate(s.kv.num_free_blocks - 2)  # leave room for the tokens, not for every block
    assert not s.kv.can_swap_in(victim, 1, reserve=0)


# ---- the router's view of the prefix cache
# ----------------------------------------------------------
def test_recent_hashes_follow_registration_and_eviction_and_cost_nothing_when_unchanged():
    from scheduler.block_manager import BlockPool

    pool = BlockPool(4)
    blocks = pool.allocate(3)
    for block, h in zip(blocks, (11, 12, 13)):
        pool.register(block, h)
    assert pool.recent_hashes(2) == [12, 13] and pool.recent_hashes(8) == [11, 12, 13]
    unchanged = pool.recent_hashes(8)
    assert pool.recent_hashes(8) is unchanged  # no change since: the same list, nothing rebuilt
    pool.release(blocks)
    pool.allocate(2)  # takes the free, never-used block and then the LRU cached one (hash 11)
    assert pool.recent_hashes(8) == [12, 13]


pool_ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("fill"), st.integers(1, 4), st.integers(0, 40)
        ),  # allocate n blocks, register them
        st.tuples(
            st.just("free"), st.integers(0, 12), st.just(0)
        ),  # release the oldest held blocks
        st.tuples(st.just("report"), st.integers(1, 12), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=pool_ops)
def test_a_prefix_report_gives_exactly_its_change_since_the_previous_report(ops):
    """listed / unlisted are the difference of the two lists, listed in the new list's order; a list
    cut
    at the limit (now or before) gives no change."""
    from scheduler.block_manager import BlockPool

    pool = BlockPool(12)
    held: list[int] = []
    previous = None
    for kind, n, h in ops:
        if kind == "fill" and n <= pool.num_free:
            for block in pool.allocate(n):
                pool.register(block, h)  # a hash already cached stays with its first block
                h += 1
                held.append(block)
        elif kind == "free":
            pool.release(held[:n])
            del held[:n]
        elif kind == "report":
            report = pool.prefix_report(n)
            assert report.hashes == list(pool.cached)[-n:]
            whole = len(pool.cached) <= n
            if previous is None or not previous[1] or not whole:
                assert report.base_id is None and not report.listed and not report.unlisted
            else:
                assert report.base_id == previous[0].report_id == report.report_id - 1
                before = set(previous[0].hashes)
                assert report.listed == [x for x in report.hashes if x not in before]
                assert set(report.unlisted) == before - set(report.hashes)
                assert len(report.unlisted) == len(set(report.unlisted))
            previous = (report, whole)


# ---- bounds: no value can reach a batch that would fail it
# --------------------------------------------
@pytest.mark.parametrize("priority", [10**30, -(10**30), 1.5, True])
def test_request_priority_is_a_bounded_integer(priority):
    with pytest.raises(ValueError, match="^priority"):
        Request(EngineRequest("p", [1, 2], SamplingParams(), priority=priority))


# ---- the fair queue at scale
# ----------------------------------------------------------------------------
def test_fair_queue_forgets_twenty_thousand_one_off_tenants():
    from scheduler.queues import FairQueue

    q = FairQueue()
    for i in range(20_000):
        q.add(req(f"steady-{i}", 4, tenant="steady"))
        q.add(req(f"once-{i}", 4, tenant=f"user-{i}"))
        for _ in range(2):
            served = q.pop()
            q.charge(served.tenant, 10.0)  # its tokens are charged while it runs, after it left
    assert len(q) == 0 and len(q.counters) < 300 and len(q._heap) < 300


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "pop", "charge", "prepend"]),
            st.integers(0, 5),
            st.integers(1, 50),
        ),
        max_size=80,
    )
)
def test_fair_queue_always_serves_the_least_served_backlogged_tenant(ops):
    from scheduler.queues import FairQueue

    q, popped, n = FairQueue(), [], 0
    for op, tenant_no, amount in ops:
        tenant = f"t{tenant_no}"
        if op in ("add", "prepend"):
            r = req(f"r{n}", 4, tenant=tenant)
            n += 1
            q.add(r) if op == "add" else q.prepend(r)
        elif op == "charge":
            q.charge(tenant, float(amount))
        elif len(q):
            backlogged = {r.tenant for r in q}
            least = min(q.counters[t] for t in backlogged)
            r = q.pop()
            assert q.counters[r.tenant] == least
            popped.append(r)
    assert len(q) == len(list(q)) == n - len(popped)


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(-(1 << 63), (1 << 63) - 1), max_size=80),
    block_size=st.integers(1, 9),
    have=st.integers(0, 12),
    want=st.integers(-2, 14),
)
def test_a_chain_extended_in_one_pass_has_the_block_by_block_keys(tokens, block_size, have, want):
    """extend_block_hashes gives hash_block_tokens' chain from where the given hashes stop, full
    blocks
    only: asked past the tokens it stops at the last full block instead of hashing a short one."""
    from scheduler import extend_block_hashes, hash_block_tokens, hash_prompt_blocks

    full = len(tokens) // block_size
    chain: list[int] = []
    parent = None
    for i in range(full):
        parent = hash_block_tokens(parent, tokens[i * block_size : (i + 1) * block_size])
        chain.append(parent)
    start = chain[: min(have, full)]
    extended = extend_block_hashes(list(start), tokens, block_size, want)
    assert extended == chain[: max(len(start), min(want, full))]
    assert hash_prompt_blocks(tokens, block_size) == chain
    assert hash_prompt_blocks(tokens, block_size, max_blocks=want) == chain[: max(0, want)]
