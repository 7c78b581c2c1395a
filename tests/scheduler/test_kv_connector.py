"""The prefix cache's lower tiers, scheduler side: random traffic against a fake runner that keeps
simulated KV in a device pool, a CPU tier and a disk tier, and corrupts some disk blocks."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from hypothesis import HealthCheck, event, given, settings
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
from scheduler.kv_connector import KVConnector, TierIndex
from tests.scheduler.contract_runner import ContractRunner
from tests.scheduler.test_scheduler_properties import VOCAB, configs, expected_for, workloads


class TieredRunner(ContractRunner):
    """ContractRunner plus the tiers' copies, in the workers' order: demote, save, swaps, loads.
    A disk block whose hash is in `corrupt` fails its check; a failed load poisons its block, so a
    scheduler that used it anyway would fail the contract's read check."""

    def __init__(self, *args, corrupt: frozenset[int] = frozenset(), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tier_cpu: dict[int, tuple[int, list[int | None]]] = {}  # slot -> (hash, block)
        self.tier_disk: dict[int, list[int | None]] = {}
        self.corrupt = corrupt

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        t = out.kv_transfers
        failed: list[int] = []
        if t is not None:
            for slot, h in t.demote:
                assert self.tier_cpu[slot][0] == h, "demoted a slot that holds another block"
                self.tier_disk[h] = list(self.tier_cpu[slot][1])
            for block, slot, h in t.save:
                self.tier_cpu[slot] = (h, list(self.gpu[block]))
            for block, h in t.save_disk:
                self.tier_disk[h] = list(self.gpu[block])
        for gpu, cpu in out.blocks_to_swap_out:
            self.cpu[cpu] = list(self.gpu[gpu])
        for gpu, cpu in out.blocks_to_swap_in:
            self.gpu[gpu] = list(self.cpu[cpu])
        if t is not None:
            for slot, block, h in t.load_cpu:
                assert self.tier_cpu[slot][0] == h, "loaded a slot that holds another block"
                self.gpu[block] = list(self.tier_cpu[slot][1])
            for h, block in t.load_disk:
                if h in self.corrupt or h not in self.tier_disk:
                    failed.append(block)
                    self.gpu[block] = [-1] * self.block_size
                else:
                    self.gpu[block] = list(self.tier_disk[h])
            for h in t.drop_disk:
                self.tier_disk.pop(h, None)
        rest = dataclasses.replace(out, blocks_to_swap_out=[], blocks_to_swap_in=[])
        result = super().execute(rest)
        result.kv_load_failed = failed
        return result


def check_accounting(s: Scheduler) -> None:
    """Every device block is held by as many requests as its count says; tiers within bounds."""
    pool, connector = s.kv.pool, s.connector
    assert connector is not None
    owners = Counter(b for blocks in s.kv.req_blocks.values() for b in blocks)
    for block_id in range(pool.num_blocks):
        assert pool.ref_cnt[block_id] == owners[block_id]
    for rid in s.kv.req_blocks:
        req = s.requests[rid]
        assert req.status in (RequestStatus.RUNNING, RequestStatus.LOADING_KV), (
            f"{rid} holds blocks in state {req.status.name}"
        )
    for tier in (connector.cpu, connector.disk):
        if tier is None:
            continue
        assert len(tier) <= tier.capacity
        assert sorted(list(tier.slots.values()) + tier.free) == list(range(tier.capacity))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_traffic_through_the_tiers_keeps_tokens_and_bounds(data):
    cfg = data.draw(configs())
    cfg = dataclasses.replace(
        cfg,
        enable_prefix_caching=True,
        num_cpu_tier_blocks=data.draw(st.integers(1, 12)),
        num_disk_tier_blocks=data.draw(st.sampled_from([0, 1, 4, 16, 16])),
    )
    specs = data.draw(workloads(cfg))
    # Second turns: each prompt comes back later, longer, so its evicted prefix is looked up.
    last = max(sp.arrival_step for sp in specs)
    specs += [
        dataclasses.replace(
            sp, rid=sp.rid + "b", prompt=sp.prompt + (1, 2, 3), arrival_step=last + 5
        )
        for sp in specs
        if len(sp.prompt) + 3 <= cfg.max_model_len
    ]
    corrupt_share = data.draw(st.sampled_from([0, 2, 3]))
    s = Scheduler(cfg)
    hashes = {h for sp in specs for h in Request(sp.engine_request()).block_hashes}
    runner = TieredRunner(
        cfg.block_size,
        cfg.num_gpu_blocks,
        cfg.num_cpu_blocks,
        VOCAB,
        corrupt=frozenset(h for h in hashes if corrupt_share and h % corrupt_share == 0),
    )
    pending = sorted(specs, key=lambda sp: sp.arrival_step)
    aborted: set[str] = set()
    for step_no in range(4000):
        while pending and pending[0].arrival_step <= step_no:
            s.add_request(Request(pending.pop(0).engine_request()))
        for sp in specs:
            req = s.requests.get(sp.rid)
            if sp.abort_step == step_no and req is not None and not req.is_finished:
                s.abort_requests([sp.rid])
                aborted.add(sp.rid)
        if not pending and not s.has_unfinished_requests():
            break
        out = s.schedule()
        check_accounting(s)
        s.update_from_output(out, runner.execute(out))
        check_accounting(s)
    else:
        raise AssertionError("workload did not drain")
    stats = s.stats()
    event(f"tier loads={'yes' if stats.num_tier_loaded_blocks else 'no'}")
    event(f"failed loads={'yes' if stats.num_tier_failed_loads else 'no'}")
    for sp in specs:
        req = s.requests[sp.rid]
        assert req.is_finished
        if sp.rid not in aborted:
            assert (req.output_token_ids, req.status.finish_reason) == expected_for(sp, cfg)
    assert all(c == 0 for c in s.kv.pool.ref_cnt), "a block is still held"
    assert not s.loading and not s.landed and not s.connector.plans


def test_an_evicted_prefix_is_loaded_back_and_only_the_rest_computed():
    cfg = SchedulerConfig(
        max_num_batched_tokens=64,
        block_size=4,
        num_gpu_blocks=5,
        max_model_len=20,
        num_cpu_tier_blocks=8,
    )
    s = Scheduler(cfg)
    runner = TieredRunner(cfg.block_size, cfg.num_gpu_blocks, 0, VOCAB)
    prompt = list(range(1, 18))  # 4 full blocks of 4 and one token
    run(s, runner, "a", prompt)
    run(s, runner, "evictor", list(range(20, 37)))  # takes every device block
    assert s.stats().num_tier_saved_blocks >= 4
    scheduled = run(s, runner, "a2", prompt)
    assert s.requests["a2"].num_cached_tokens == 16
    assert scheduled == [1]  # the prompt's last token, then nothing (max_tokens=1)
    assert s.stats().num_tier_loaded_blocks == 4


def run(s: Scheduler, runner: TieredRunner, rid: str, prompt: list[int]) -> list[int]:
    """Run one request alone to its end; the tokens each step scheduled for it."""
    s.add_request(Request(EngineRequest(rid, prompt, SamplingParams(max_tokens=1))))
    scheduled = []
    while s.has_unfinished_requests():
        out = s.schedule()
        if rid in out.num_scheduled_tokens:
            scheduled.append(out.num_scheduled_tokens[rid])
        s.update_from_output(out, runner.execute(out))
    return scheduled


def test_tier_index_evicts_least_recently_used_and_never_a_pinned_block():
    tier = TierIndex(2)
    assert tier.insert(10) == (0, None)
    assert tier.insert(11) == (1, None)
    tier.touch(10)
    tier.pinned.add(10)
    assert tier.insert(12) == (1, 11) and 11 not in tier
    tier.pinned.add(12)
    assert tier.insert(13) is None  # everything pinned: the block is not kept


def test_connector_rejects_an_empty_cpu_tier():
    with pytest.raises(ValueError, match="num_cpu_tier_blocks"):
        KVConnector(0)
