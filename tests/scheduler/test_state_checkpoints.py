"""Hybrid prefix caching in the scheduler (scheduler/state_checkpoints.py): a prefix hit is rounded
down to a block boundary whose recurrent state was checkpointed, and the step's copies restore
exactly the state of the tokens before the hit.

`StateModel` plays the workers' side with a state that is the list of tokens it has folded in:
a request's step must find exactly its tokens before the step's start in its slot (zeroed at 0,
copied from a checkpoint after a hit), and a save copies the tokens up to its boundary. Hypothesis
drives random workloads with shared prefixes through a tiny block pool (evictions, preemptions),
few checkpoints and aborts, over the contract runner's paged KV."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from scheduler import EngineRequest, Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.outputs import SchedulerOutput
from scheduler.state_checkpoints import CheckpointPool, StateCheckpointFeature
from scheduler.state_slots import StateSlots
from tests.scheduler.contract_runner import ContractRunner, expected_output

VOCAB = 50


class StateModel:
    """The workers' state slots and checkpoints, each holding the tokens folded into it."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.running: dict[str, list[int]] = {}
        self.checkpoints: dict[int, list[int]] = {}
        self.restored = 0
        self.saved = 0

    def run(self, out: SchedulerOutput) -> None:
        for rid in out.preempted_req_ids | out.finished_req_ids:
            self.running.pop(rid, None)
        copies = out.state_copies
        restore = copies.restore if copies is not None else {}
        for rid, checkpoint in restore.items():  # every restore before the forward's saves
            self.running[rid] = list(self.checkpoints[checkpoint])
            self.restored += 1
        for rid, n in out.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            start, tokens = req.num_computed_tokens - n, req.all_token_ids
            if start == 0:
                self.running[rid] = []
            assert self.running[rid] == tokens[:start], (
                f"{rid} starts at {start} from another state"
            )
            if copies is not None and rid in copies.save:
                offset, checkpoint = copies.save[rid]
                self.checkpoints[checkpoint] = tokens[: start + offset]
                self.saved += 1
            self.running[rid] = tokens[: start + n]


def _scheduler(num_checkpoints: int, **overrides: int) -> Scheduler:
    cfg = SchedulerConfig(
        **{
            "max_num_batched_tokens": 10,
            "max_num_seqs": 4,
            "block_size": 4,
            "num_gpu_blocks": 64,
            "max_model_len": 64,
            **overrides,
        }
    )
    sched = Scheduler(cfg, [StateCheckpointFeature(num_checkpoints)])
    sched.state_slots = StateSlots(cfg.max_num_seqs)
    return sched


def _run(sched: Scheduler, model: StateModel, runner: ContractRunner, steps: int = 2000) -> None:
    for _ in range(steps):
        if not sched.has_unfinished_requests():
            return
        out = sched.schedule()
        model.run(out)
        sched.update_from_output(out, runner.execute(out))
        sched.features[0].pool.check()  # type: ignore[attr-defined]
    raise AssertionError("the workload did not drain")


@pytest.mark.parametrize("bad", [2**64, -1, 0, math.nan, 10**12, True, "4"])
def test_a_checkpoint_count_out_of_range_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="num_state_checkpoints"):
        CheckpointPool(bad)


def test_a_hit_is_rounded_down_to_the_last_checkpointed_boundary():
    """10-token chunks of a 30-token prompt in 4-token blocks checkpoint at 8, 20 (the last
    boundary of each chunk) and 28 (the prompt's last); a prompt sharing 26 tokens has 6 cached
    blocks (24 tokens) and starts at 20, from the state of those 20 tokens."""
    sched = _scheduler(8)
    model = StateModel(sched)
    runner = ContractRunner(4, 64, 0, VOCAB)
    prompt = [(3 * j) % VOCAB for j in range(30)]
    sched.add_request(Request(EngineRequest("cold", prompt, SamplingParams(max_tokens=2))))
    _run(sched, model, runner)
    assert sorted(len(t) for t in model.checkpoints.values()) == [8, 20, 28]
    shared = prompt[:26] + [49, 48, 47, 46]
    sched.add_request(Request(EngineRequest("warm", shared, SamplingParams(max_tokens=2))))
    sched.add_request(Request(EngineRequest("again", prompt, SamplingParams(max_tokens=2))))
    _run(sched, model, runner)
    assert sched.requests["warm"].num_cached_tokens == 20
    assert sched.requests["again"].num_cached_tokens == 28  # its last full block: 29 is computed
    assert model.restored == 2
    for rid, p in (("warm", shared), ("again", prompt)):
        want, _ = expected_output(rid, len(p), 2, None, [], 64, VOCAB)
        assert sched.requests[rid].output_token_ids == want


def test_an_evicted_block_drops_its_checkpoint_and_its_slot_is_reused_first():
    """Two checkpoints; a prompt of 8 tokens leaves one at 8. Once a second prompt's blocks have
    evicted the first's, the first's prompt hits nothing, and the next save takes the checkpoint
    whose block is gone before the least recently used one."""
    sched = _scheduler(2, num_gpu_blocks=4, max_model_len=16)
    model = StateModel(sched)
    runner = ContractRunner(4, 4, 0, VOCAB)
    first = list(range(1, 10))
    sched.add_request(Request(EngineRequest("a", first, SamplingParams(max_tokens=1))))
    _run(sched, model, runner)
    pool = sched.features[0].pool  # type: ignore[attr-defined]
    (old,) = pool.by_hash.values()
    second = list(range(20, 33))  # 13 tokens: the pool's 4 blocks, the first's evicted
    sched.add_request(Request(EngineRequest("b", second, SamplingParams(max_tokens=1))))
    _run(sched, model, runner)
    assert not sched.kv.find_cached_blocks(
        Request(EngineRequest("probe", first, SamplingParams(max_tokens=1)))
    )
    # b's first chunk evicted a's block before saving at 8: into a's checkpoint, not the unused
    # one, which then holds b's 12.
    assert sorted(len(t) for t in model.checkpoints.values()) == [8, 12]
    assert model.checkpoints[old] == second[:8]


def test_a_reset_prefix_cache_forgets_every_checkpoint():
    """After the prefix cache is reset (new weights), the prompt computed again saves its three
    checkpoints again instead of finding the old weights' ones under the same hashes, and the
    next run restores one of those."""
    sched = _scheduler(8)
    model = StateModel(sched)
    runner = ContractRunner(4, 64, 0, VOCAB)
    prompt = [(3 * j) % VOCAB for j in range(30)]
    for rid in ("before", "after"):
        sched.add_request(Request(EngineRequest(rid, prompt, SamplingParams(max_tokens=2))))
        _run(sched, model, runner)
        assert sched.requests[rid].num_cached_tokens == 0
        sched.kv.pool.reset_prefix_cache()
    assert model.saved == 6 and model.restored == 0
    sched.add_request(Request(EngineRequest("again", prompt, SamplingParams(max_tokens=2))))
    _run(sched, model, runner)
    assert sched.requests["again"].num_cached_tokens == 0  # reset again above: nothing cached
    sched.add_request(Request(EngineRequest("hit", prompt, SamplingParams(max_tokens=2))))
    _run(sched, model, runner)
    assert sched.requests["hit"].num_cached_tokens == 28 and model.restored == 1
    assert model.saved == 9  # "again" saved its own after the second reset


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_checkpoints=st.integers(1, 4),
    max_num_seqs=st.integers(1, 4),
    num_gpu_blocks=st.integers(16, 40),
    budget=st.integers(3, 24),
    requests=st.lists(
        st.tuples(
            st.integers(0, 2),  # which shared prefix
            st.integers(0, 24),  # its length
            st.integers(1, 16),  # own tokens after it
            st.integers(1, 12),  # max_tokens
            st.one_of(st.none(), st.integers(0, 40)),  # aborted at that step
        ),
        min_size=1,
        max_size=12,
    ),
)
def test_every_restore_is_the_state_of_the_tokens_before_the_hit(
    num_checkpoints, max_num_seqs, num_gpu_blocks, budget, requests
):
    sched = _scheduler(
        num_checkpoints,
        max_num_seqs=max_num_seqs,
        num_gpu_blocks=num_gpu_blocks,
        max_num_batched_tokens=budget,
    )
    model = StateModel(sched)
    runner = ContractRunner(4, num_gpu_blocks, 0, VOCAB)
    prefixes = [[(k * 11 + j) % VOCAB for j in range(24)] for k in range(3)]
    for i, (k, shared, own, max_tokens, _) in enumerate(requests):
        prompt = prefixes[k][:shared] + [(i * 7 + j) % VOCAB for j in range(own)]
        sched.add_request(
            Request(EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens)))
        )
    aborts = {f"r{i}": at for i, (*_, at) in enumerate(requests) if at is not None}
    for step_no in range(5000):
        if not sched.has_unfinished_requests():
            break
        sched.abort_requests([rid for rid, at in aborts.items() if at == step_no])
        out = sched.schedule()
        model.run(out)
        sched.update_from_output(out, runner.execute(out))
        sched.features[0].pool.check()  # type: ignore[attr-defined]
    else:
        raise AssertionError("the workload did not drain")
    event(f"restores={'yes' if model.restored else 'no'}")
    event(f"preemptions={'yes' if sched.num_preemptions else 'no'}")
    pool = sched.features[0].pool  # type: ignore[attr-defined]
    assert not pool.pending and sorted(sched.state_slots.free) == list(range(max_num_seqs))
    for i, (_, shared, own, max_tokens, _) in enumerate(requests):
        req = sched.requests[f"r{i}"]
        if req.status.finish_reason != "abort":
            want, _ = expected_output(f"r{i}", shared + own, max_tokens, None, [], 64, VOCAB)
            assert req.output_token_ids == want
