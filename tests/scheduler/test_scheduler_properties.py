"""Scheduler invariants under random workloads, policies and preemption modes (hypothesis)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from scheduler import (
    EngineRequest,
    Request,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from tests.scheduler.contract_runner import ContractRunner, expected_output

EOS = 7
VOCAB = 50


@dataclass(frozen=True)
class Spec:
    rid: str
    prompt: tuple[int, ...]
    max_tokens: int
    arrival_step: int
    priority: int
    tenant: str
    use_eos: bool
    abort_step: int | None

    def engine_request(self) -> EngineRequest:
        return EngineRequest(
            self.rid,
            list(self.prompt),
            SamplingParams(max_tokens=self.max_tokens),
            eos_token_ids=(EOS,) if self.use_eos else (),
            priority=self.priority,
            tenant=self.tenant,
        )


@st.composite
def configs(draw) -> SchedulerConfig:
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    max_model_len = draw(st.integers(16, 96))
    min_blocks = -(-max_model_len // block_size)
    mode = draw(st.sampled_from(["recompute", "swap", "auto"]))
    return SchedulerConfig(
        max_num_batched_tokens=draw(st.integers(1, 128)),
        max_num_seqs=draw(st.integers(1, 12)),
        block_size=block_size,
        num_gpu_blocks=draw(st.integers(min_blocks, min_blocks * 2)),
        num_cpu_blocks=draw(st.integers(1 if mode == "swap" else 0, 3 * min_blocks)),
        max_model_len=max_model_len,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 5, 17])),
        enable_prefix_caching=draw(st.booleans()),
        policy=draw(st.sampled_from(["fcfs", "priority", "fair", "srpt", "fair_srpt"])),
        preemption_mode=mode,
        preemption_victim=draw(st.sampled_from(["lifo", "least_progress", "most_remaining"])),
        watermark=draw(st.sampled_from([0.0, 0.0, 0.1])),
        swap_min_computed_tokens=draw(st.sampled_from([0, 8, 64])),
        admission=draw(st.sampled_from(["greedy", "foresight"])),
        foresight_estimate=draw(st.sampled_from(["median", "upper"])),
    )


@st.composite
def workloads(draw, cfg: SchedulerConfig) -> list[Spec]:
    # Prompts share prefixes (a few "system prompts") so that prefix caching gets exercised.
    systems = [
        tuple(draw(st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=40))) for _ in range(3)
    ]
    specs = []
    for i in range(draw(st.integers(1, 20))):
        head = draw(st.sampled_from(systems))
        tail = tuple(draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30)))
        prompt = (head + tail)[: cfg.max_model_len]
        specs.append(
            Spec(
                rid=f"r{i}",
                prompt=prompt,
                max_tokens=draw(st.integers(1, 24)),
                arrival_step=draw(st.integers(0, 20)),
                priority=draw(st.integers(0, 3)),
                tenant=draw(st.sampled_from(["t0", "t1", "t2"])),
                use_eos=draw(st.booleans()),
                abort_step=draw(st.one_of(st.none(), st.integers(0, 40)))
                if draw(st.integers(0, 4)) == 0
                else None,
            )
        )
    return specs


def check_block_accounting(s: Scheduler) -> None:
    pool = s.kv.pool
    owners = Counter(b for blocks in s.kv.req_blocks.values() for b in blocks)
    for block_id in range(pool.num_blocks):
        assert pool.ref_cnt[block_id] == owners[block_id], (
            f"block {block_id} ref count disagrees with owners"
        )
    for blocks in s.kv.req_blocks.values():
        assert len(set(blocks)) == len(blocks), "a request holds a block twice"
    assert set(pool.free) == {b for b in range(pool.num_blocks) if pool.ref_cnt[b] == 0}
    assert len(owners) <= pool.num_blocks
    cpu_owned = [b for blocks in s.kv.req_cpu_blocks.values() for b in blocks]
    assert len(cpu_owned) == len(set(cpu_owned)), "a CPU block owned twice"
    assert not set(cpu_owned) & set(s.kv.cpu_free)
    for rid in s.kv.req_blocks:
        assert s.requests[rid].status == RequestStatus.RUNNING, (
            f"{rid} holds blocks but is not running"
        )
    assert s.stats().num_swapped == sum(1 for r in s.waiting if r.status == RequestStatus.SWAPPED)


def expected_for(sp: Spec, cfg: SchedulerConfig) -> tuple[list[int], str]:
    """The tokens and finish reason the contract runner's model gives this request."""
    eos = EOS if sp.use_eos else None
    return expected_output(sp.rid, len(sp.prompt), sp.max_tokens, eos, [], cfg.max_model_len, VOCAB)


def check_every_block_returned(s: Scheduler, cfg: SchedulerConfig) -> None:
    """After every request finished: no GPU block referenced, and, once the next step reports the
    last finishes, every deferred CPU block back too."""
    assert all(c == 0 for c in s.kv.pool.ref_cnt), (
        "blocks still referenced after every request finished"
    )
    assert s.kv.num_free_blocks == cfg.num_gpu_blocks
    s.schedule()
    assert sorted(s.kv.cpu_free) == list(range(cfg.num_cpu_blocks))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_workloads_keep_every_invariant(data):
    cfg = data.draw(configs())
    specs = data.draw(workloads(cfg))
    s = Scheduler(cfg)
    runner = ContractRunner(cfg.block_size, cfg.num_gpu_blocks, cfg.num_cpu_blocks, VOCAB)
    pending = sorted(specs, key=lambda sp: sp.arrival_step)
    aborted: set[str] = set()
    swaps = 0
    for step_no in range(3000):
        while pending and pending[0].arrival_step <= step_no:
            sp = pending.pop(0)
            s.add_request(Request(sp.engine_request()))
        for sp in specs:
            if (
                sp.abort_step == step_no
                and sp.rid in s.requests
                and not s.requests[sp.rid].is_finished
            ):
                s.abort_requests([sp.rid])
                aborted.add(sp.rid)
        if not pending and not s.has_unfinished_requests():
            break
        out = s.schedule()
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(out.num_scheduled_tokens) <= cfg.max_num_seqs
        assert not set(out.num_scheduled_tokens) & out.preempted_req_ids
        check_block_accounting(s)
        swaps += len(out.blocks_to_swap_out)
        s.update_from_output(out, runner.execute(out))
        check_block_accounting(s)
    else:
        raise AssertionError("workload did not drain: a request starved")
    event(f"preemptions={'yes' if s.num_preemptions else 'no'}")
    event(f"swapped={'yes' if swaps else 'no'}")
    event(f"prefix hits={'yes' if s.kv.num_hit_tokens else 'no'}")

    for sp in specs:
        req = s.requests[sp.rid]
        assert req.is_finished
        if sp.rid in aborted:
            continue
        want, reason = expected_for(sp, cfg)
        assert req.output_token_ids == want, f"{sp.rid} produced the wrong tokens"
        assert req.status.finish_reason == reason
    check_every_block_returned(s, cfg)


@settings(max_examples=40, deadline=None)
@given(cfg=configs(), n=st.integers(2, 10), max_tokens=st.integers(1, 12))
def test_fcfs_serves_requests_in_arrival_order_of_first_admission(cfg, n, max_tokens):
    if cfg.policy != "fcfs":
        return
    s = Scheduler(cfg)
    runner = ContractRunner(cfg.block_size, cfg.num_gpu_blocks, cfg.num_cpu_blocks, VOCAB)
    for i in range(n):
        s.add_request(
            Request(EngineRequest(f"r{i}", [i + 1] * 5, SamplingParams(max_tokens=max_tokens)))
        )
    first: list[str] = []
    for _ in range(3000):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        first += [d.req_id for d in out.scheduled_new_reqs]
        s.update_from_output(out, runner.execute(out))
    assert first == [f"r{i}" for i in range(n)]
    assert not s.has_unfinished_requests()
