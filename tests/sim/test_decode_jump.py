"""DecodeJump.advance_decode: k pure-decode steps at once leave the state k single steps of the
production Scheduler would."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from scheduler import (
    EngineRequest,
    KVCacheManager,
    ModelRunnerOutput,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from scheduler.features import HOOKS, StepFeature
from sim.jump import DecodeJump, JumpKVCacheManager, sim_scheduler
from tests.scheduler.contract_runner import ContractRunner
from tests.scheduler.test_scheduler_properties import EOS, VOCAB, configs, workloads


def test_the_jump_is_a_feature_that_hooks_no_step_and_its_pool_replaces_nothing():
    """Every step the simulator does not jump runs the production Scheduler's and pool's code."""

    def replaced(sub: type, base: type) -> set[str]:
        return {n for n in set(vars(sub)) & set(vars(base)) if not n.startswith("__")}

    assert replaced(DecodeJump, StepFeature) == {"bind"}
    assert not set(HOOKS) & set(vars(DecodeJump))
    assert replaced(JumpKVCacheManager, KVCacheManager) == set()
    s = jumping(SchedulerConfig(num_gpu_blocks=8, max_model_len=64))
    assert type(s) is Scheduler and type(s.kv) is JumpKVCacheManager
    with pytest.raises(TypeError, match="JumpKVCacheManager"):
        Scheduler(SchedulerConfig(num_gpu_blocks=8, max_model_len=64), [DecodeJump()])


def jumping(cfg: SchedulerConfig) -> Scheduler:
    """The production Scheduler as a simulated replica builds it, with the jump as its feature."""
    return sim_scheduler(cfg, [DecodeJump()])


def jump_of(s: Scheduler) -> DecodeJump:
    (jump,) = s.features
    assert isinstance(jump, DecodeJump)
    return jump


def snapshot(s: Scheduler) -> dict:
    """Everything a later step or a stats report could read."""
    pool, kv = s.kv.pool, s.kv
    reqs = {
        rid: (
            r.status,
            list(r.all_token_ids),
            list(r.output_token_ids),
            r.num_computed_tokens,
            r.num_synced_tokens,
            list(r.block_hashes),
            r.num_cached_tokens,
        )
        for rid, r in s.requests.items()
    }
    return {
        "running": [r.request_id for r in s.running],
        "waiting": [r.request_id for r in s.waiting],
        "requests": reqs,
        "req_blocks": copy.deepcopy(kv.req_blocks),
        "registered": dict(kv.num_registered_blocks),
        "ref_cnt": list(pool.ref_cnt),
        "free": list(pool.free),
        "cached": list(pool.cached.items()),
        "block_hash": list(pool.block_hash),
        "version": pool.version,
        "stats": s.stats(),
        "finished": set(s.finished.ids),
        "counters": dict(getattr(s.waiting, "counters", {})),
        "cpu_free": list(kv.cpu_free),
    }


def step_k(s: Scheduler, sample, k: int) -> tuple[dict[str, list[int]], list]:
    """k single steps; returns each request's sampled tokens and the last step's outputs."""
    tokens: dict[str, list[int]] = {}
    outs: list = []
    for _ in range(k):
        out = s.schedule()
        outs = s.update_from_output(out, sample(s, out))
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return tokens, outs


def check_jump_equals_steps(s: Scheduler, sample, k: int) -> None:
    stepped, jumped = copy.deepcopy(s), copy.deepcopy(s)
    tokens, last = step_k(stepped, sample, k)
    outs = jump_of(jumped).advance_decode(tokens)
    assert snapshot(jumped) == snapshot(stepped)
    assert {o.request_id: o.new_token_ids for o in outs} == tokens
    assert [(o.request_id, o.num_output_tokens, o.num_cached_tokens, o.finished) for o in outs] == [
        (o.request_id, o.num_output_tokens, o.num_cached_tokens, o.finished) for o in last
    ]


def counting_sample(s: Scheduler, out) -> ModelRunnerOutput:
    """Token 1 + position % 40 (never 0, the EOS here): deterministic and free of stop tokens."""
    ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        r = s.requests[rid]
        sampled.append(
            [1 + r.num_computed_tokens % 40] if r.num_computed_tokens == r.num_tokens else []
        )
    return ModelRunnerOutput(ids, sampled)


def decoding(
    policy: str = "fcfs", blocks: int = 64, prefix: bool = True, n: int = 3, max_tokens: int = 40
) -> Scheduler:
    cfg = SchedulerConfig(
        block_size=4,
        num_gpu_blocks=blocks,
        max_model_len=min(128, 4 * blocks),
        policy=policy,
        enable_prefix_caching=prefix,
        max_num_batched_tokens=64,
    )
    s = jumping(cfg)
    for i in range(n):  # shared 8-token head, so blocks are shared and registered
        s.add_request(
            Request(
                EngineRequest(
                    f"r{i}",
                    [5, 6, 7, 8, 9, 10, 11, 12] + [20 + i] * (3 + i),
                    SamplingParams(max_tokens=max_tokens),
                    eos_token_ids=(0,),
                    tenant=f"t{i % 2}",
                )
            )
        )
    step_k(s, counting_sample, 2)  # prefill, then one decode step
    return s


@pytest.mark.parametrize("policy,prefix", [("fcfs", True), ("fair", True), ("priority", False)])
def test_jump_across_block_boundaries_equals_single_steps(policy, prefix):
    s = decoding(policy, prefix=prefix)
    assert jump_of(s).max_decode_jump(20) == 20
    check_jump_equals_steps(s, counting_sample, 13)  # crosses three 4-token blocks per request


def test_jump_evicts_cached_blocks_in_lru_order():
    s = decoding(blocks=20, n=2)
    s.add_request(
        Request(EngineRequest("gone", [90, 91, 92, 93, 94], SamplingParams(max_tokens=1)))
    )
    step_k(s, counting_sample, 2)  # "gone" finishes: its cached block sits on the free list
    step_k(s, counting_sample, 1)  # the step that reports the finish
    k = jump_of(s).max_decode_jump(100)
    assert 0 < k < 100  # the pool bounds the jump
    check_jump_equals_steps(s, counting_sample, k)


def test_no_jump_while_something_waits_or_prefills():
    s = decoding()
    s.add_request(Request(EngineRequest("brief", [1, 2, 3], SamplingParams(max_tokens=1))))
    assert jump_of(s).max_decode_jump(10) == 0  # a waiting request would be admitted
    cfg = SchedulerConfig(
        block_size=4, num_gpu_blocks=64, max_model_len=128, long_prefill_token_threshold=2
    )
    s = jumping(cfg)
    s.add_request(
        Request(EngineRequest("chunked", list(range(1, 9)), SamplingParams(max_tokens=9)))
    )
    step_k(s, counting_sample, 1)  # 2 of 8 prompt tokens computed
    assert jump_of(s).max_decode_jump(10) == 0


def test_a_jump_right_after_a_finish_leaves_what_the_steps_reporting_it_would():
    s = decoding()
    s.add_request(Request(EngineRequest("brief", [1, 2, 3], SamplingParams(max_tokens=1))))
    step_k(s, counting_sample, 1)  # "brief" runs and finishes; the next schedule() would report it
    assert s.finished.ids == {"brief"}
    assert jump_of(s).max_decode_jump(10) == 10
    check_jump_equals_steps(s, counting_sample, 6)
    assert s.schedule().finished_req_ids == {
        "brief"
    }  # untouched: check_jump_equals_steps jumps a copy


def test_a_jump_may_end_with_the_step_that_reaches_a_length_cap():
    s = decoding(max_tokens=10)  # two tokens out after the setup steps
    assert jump_of(s).max_decode_jump(100) == 10 - 2
    check_jump_equals_steps(s, counting_sample, 8)
    outs = jump_of(s).advance_decode({r.request_id: [1] * 8 for r in s.running})
    assert [(o.finished, o.finish_reason, o.num_output_tokens) for o in outs] == [
        (True, "length", 10)
    ] * 3
    assert (
        s.running == []
        and s.kv.req_blocks == {}
        and s.schedule().finished_req_ids == {"r0", "r1", "r2"}
    )
    cfg = SchedulerConfig(block_size=4, num_gpu_blocks=64, max_model_len=20)
    s = jumping(cfg)
    s.add_request(Request(EngineRequest("a", list(range(1, 13)), SamplingParams(max_tokens=100))))
    step_k(s, counting_sample, 1)  # 13 tokens of 20
    assert jump_of(s).max_decode_jump(100) == 20 - 13
    check_jump_equals_steps(s, counting_sample, 7)


def eos_at(step_of: dict[str, int]):
    """counting_sample, except that request rid samples EOS (0) at its step_of[rid]-th call from
    now."""
    calls = {"n": 0}

    def sample(s: Scheduler, out) -> ModelRunnerOutput:
        calls["n"] += 1
        runner = counting_sample(s, out)
        runner.sampled_token_ids = [
            [0] if step_of.get(rid) == calls["n"] else toks
            for rid, toks in zip(runner.req_ids, runner.sampled_token_ids)
        ]
        return runner

    return sample


def test_a_jump_may_end_with_the_step_that_samples_a_stop_token():
    s = decoding()
    check_jump_equals_steps(s, eos_at({"r1": 5}), 5)  # r1 stops at the last step; the others run on
    outs = jump_of(s).advance_decode({"r0": [1] * 5, "r1": [1] * 4 + [0], "r2": [1] * 5})
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [
        ("r0", False, None),
        ("r1", True, "stop"),
        ("r2", False, None),
    ]
    assert [r.request_id for r in s.running] == ["r0", "r2"] and "r1" not in s.kv.req_blocks


def test_advance_decode_rejects_what_single_steps_would_not_do():
    s = decoding()
    k = jump_of(s).max_decode_jump(5)
    with pytest.raises(ValueError, match="running requests"):
        jump_of(s).advance_decode({"r0": [1] * k})
    with pytest.raises(ValueError, match="stop token before its last step"):
        jump_of(s).advance_decode({"r0": [1] * k, "r1": [1, 0] + [1] * (k - 2), "r2": [1] * k})
    with pytest.raises(ValueError, match="pure-decode"):
        jump_of(s).advance_decode({f"r{i}": [1] * 1000 for i in range(3)})
    assert [len(r.output_token_ids) for r in s.running] == [2, 2, 2]  # nothing changed


# A quarter of the suite profile's example count (tests/conftest.py: 25 in CI, 250 under
# HYPOTHESIS_PROFILE=thorough): each example runs two schedulers over a whole workload, and at
# half the count this test was 12.3 s of CI.
@settings(max_examples=max(settings().max_examples // 4, 1))
@given(data=st.data())
def test_jump_equals_single_steps_on_random_workloads(data):
    """At every point a jump is allowed, k steps at once equal k single steps of the contract
    runner."""
    cfg = data.draw(configs())
    specs = data.draw(workloads(cfg))
    s = jumping(cfg)
    runner = ContractRunner(cfg.block_size, cfg.num_gpu_blocks, cfg.num_cpu_blocks, VOCAB)
    pending = sorted(specs, key=lambda sp: sp.arrival_step)
    jumps = 0
    for step_no in range(3000):
        while pending and pending[0].arrival_step <= step_no:
            sp = pending.pop(0)
            s.add_request(
                Request(
                    EngineRequest(
                        sp.rid,
                        list(sp.prompt),
                        SamplingParams(max_tokens=sp.max_tokens),
                        eos_token_ids=(EOS,) if sp.use_eos else (),
                        tenant=sp.tenant,
                    )
                )
            )
        if not pending and not s.has_unfinished_requests():
            break
        k = jump_of(s).max_decode_jump(data.draw(st.integers(1, 30), label="limit"))
        if k:
            # The runner's tokens may hold a stop: jump at most through the step of the first one.
            probe_s, probe_r = copy.deepcopy((s, runner))
            k = min(k, _steps_through_the_first_finish(probe_s, probe_r, k))
        if k:
            jumps += 1
            r_copy = copy.deepcopy(runner)
            check_jump_equals_steps(s, lambda _, out, r=r_copy: r.execute(out), k)
        out = s.schedule()
        s.update_from_output(out, runner.execute(out))
    event(f"jumps={'yes' if jumps else 'no'}")


def _steps_through_the_first_finish(s: Scheduler, runner: ContractRunner, k: int) -> int:
    for j in range(k):
        out = s.schedule()
        if any(o.finished for o in s.update_from_output(out, runner.execute(out))):
            event("a jump ending with a finish")
            return j + 1
    return k


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([1, 2, 4]),
    max_len=st.sampled_from([8, 12, 16]),
    spare=st.integers(0, 3),
    prompt_len=st.integers(1, 4),
    reqs=st.lists(st.tuples(st.integers(0, 12), st.integers(1, 12)), min_size=2, max_size=5),
    limit=st.integers(1, 20),
)
def test_jump_equals_single_steps_when_requests_refill_evicted_blocks(
    block_size, max_len, spare, prompt_len, reqs, limit
):
    """Same prompt, tokens by position only: decodes fill blocks whose hashes sit evictable on the
    free
    list, so the order of evictions and registrations within a step is observable."""
    s = jumping(
        SchedulerConfig(
            block_size=block_size,
            num_gpu_blocks=-(-max_len // block_size) + spare,
            max_model_len=max_len,
            max_num_batched_tokens=64,
        )
    )
    for step_no in range(80):
        for i, (arrival, max_tokens) in enumerate(reqs):
            if arrival == step_no:
                s.add_request(
                    Request(
                        EngineRequest(
                            f"r{i}",
                            list(range(5, 5 + prompt_len)),
                            SamplingParams(max_tokens=max_tokens),
                        )
                    )
                )
        k = jump_of(s).max_decode_jump(limit)
        if k:
            check_jump_equals_steps(s, counting_sample, k)
        if step_no > 12 and not s.has_unfinished_requests():
            break
        step_k(s, counting_sample, 1)
