"""Speculative decoding's scheduling: proposed tokens in the budget, KV slots of rejected ones given
back, prefix-cache hashes for accepted tokens only, and the same outputs as without speculation.

The fake runner (contract_runner.py) checks every KV slot a step reads; its "model" samples
token_at(request, position), and its proposer is right or wrong at random, so random workloads
cover every accept/reject pattern with preemption (recompute and swap), chunked prefill and prefix
hits.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from scheduler import EngineRequest, Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.block_hash import hash_prompt_blocks
from scheduler.features_spec import SpecDecoding
from scheduler.speculative import SpecPolicy, SpeculativeConfig
from tests.scheduler.contract_runner import ContractRunner, expected_output, token_at
from tests.scheduler.test_scheduler_properties import (
    EOS,
    VOCAB,
    check_block_accounting,
    configs,
    workloads,
)


def proposer(seed: int, right: float, k: int):
    """Proposals right with probability `right` per token (a wrong one ends the right run)."""
    rng = random.Random(seed)

    def propose(rid: str, tokens: list[int]) -> list[int]:
        out = []
        for j in range(rng.randint(0, k)):
            good = token_at(rid, len(tokens) + j, VOCAB)
            out.append(good if rng.random() < right else (good + 1) % VOCAB)
        return out

    return propose


def check_hashes_cover_accepted_tokens(s: Scheduler, runner: ContractRunner) -> None:
    """Every registered block of a running request is a block of its accepted tokens: its hash is
    the chain over all_token_ids and its KV slots hold exactly those tokens."""
    bs = s.kv.block_size
    for rid, num in s.kv.num_registered_blocks.items():
        req = s.requests[rid]
        assert num * bs <= min(req.num_computed_tokens, req.num_tokens)
        assert req.block_hashes[:num] == hash_prompt_blocks(req.all_token_ids, bs, num)
        for i, block in enumerate(s.kv.req_blocks[rid][:num]):
            assert runner.gpu[block] == req.all_token_ids[i * bs : (i + 1) * bs]
    for block_hash, block in s.kv.pool.cached.items():  # what a prefix hit would read
        assert s.kv.pool.block_hash[block] == block_hash


def spec_configs() -> st.SearchStrategy[SpeculativeConfig]:
    """Speculation settings the property tests draw: k, the batch cap, the acceptance floor."""
    return st.builds(
        SpeculativeConfig,
        num_tokens=st.integers(1, 6),
        max_batch_size=st.sampled_from([1, 4, 16]),
        min_acceptance_rate=st.sampled_from([0.0, 0.4]),
    )


@given(data=st.data())
def test_random_accept_reject_patterns_leak_nothing_and_keep_the_outputs(data):
    cfg = data.draw(configs())
    specs = data.draw(workloads(cfg))
    spec = data.draw(spec_configs())
    right = data.draw(st.sampled_from([0.0, 0.5, 0.9, 1.0]))
    s = Scheduler(cfg, [SpecDecoding(spec)])
    runner = ContractRunner(
        cfg.block_size,
        cfg.num_gpu_blocks,
        cfg.num_cpu_blocks,
        VOCAB,
        proposer=proposer(data.draw(st.integers(0, 2**16)), right, spec.num_tokens),
    )
    pending = sorted(specs, key=lambda sp: sp.arrival_step)
    for step_no in range(3000):
        while pending and pending[0].arrival_step <= step_no:
            sp = pending.pop(0)
            params = SamplingParams(max_tokens=sp.max_tokens)
            eos = (EOS,) if sp.use_eos else ()
            s.add_request(Request(EngineRequest(sp.rid, list(sp.prompt), params, eos)))
        if not pending and not s.has_unfinished_requests():
            break
        out = s.schedule()
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        for rid, drafts in out.scheduled_spec_tokens.items():
            req = s.requests[rid]
            assert out.num_scheduled_tokens[rid] == 1 + len(drafts)
            assert len(drafts) <= spec.num_tokens
            assert req.num_computed_tokens <= cfg.max_model_len  # every position has a place
        s.update_from_output(out, runner.execute(out))
        check_block_accounting(s)
        check_hashes_cover_accepted_tokens(s, runner)
    else:
        raise AssertionError("workload did not drain")
    stats = s.stats()
    event(f"accepted={'yes' if stats.num_spec_accepted_tokens else 'no'}")
    event(f"preemptions={'yes' if s.num_preemptions else 'no'}")
    for sp in specs:
        want, reason = expected_output(
            sp.rid,
            len(sp.prompt),
            sp.max_tokens,
            EOS if sp.use_eos else None,
            [],
            cfg.max_model_len,
            VOCAB,
        )
        req = s.requests[sp.rid]
        assert req.output_token_ids == want, f"{sp.rid} produced the wrong tokens"
        assert req.status.finish_reason == reason
    assert s.kv.num_free_blocks == cfg.num_gpu_blocks
    assert stats.num_spec_accepted_tokens <= stats.num_spec_proposed_tokens


def _cfg(**kw) -> SchedulerConfig:
    base = dict(num_gpu_blocks=64, max_model_len=256, block_size=4, max_num_batched_tokens=64)
    return SchedulerConfig(**{**base, **kw})


def test_proposed_tokens_count_in_the_budget_and_get_slots():
    s = Scheduler(_cfg(), [SpecDecoding(SpeculativeConfig(num_tokens=4))])
    runner = ContractRunner(4, 64, 0, VOCAB, proposer=proposer(0, 1.0, 4))
    s.add_request(Request(EngineRequest("a", [1, 2, 3], SamplingParams(max_tokens=40))))
    s.update_from_output(out := s.schedule(), runner.execute(out))  # prefill, then proposals
    out = s.schedule()
    drafts = out.scheduled_spec_tokens["a"]
    assert drafts and out.num_scheduled_tokens["a"] == 1 + len(drafts)
    assert out.total_num_scheduled_tokens == 1 + len(drafts)
    # Slots for the last token and every proposed one.
    assert len(s.kv.req_blocks["a"]) * 4 >= s.requests["a"].num_computed_tokens


def test_rejected_tokens_give_their_blocks_back_and_the_runner_is_told():
    spec = SpeculativeConfig(num_tokens=6, min_acceptance_rate=0)
    s = Scheduler(_cfg(block_size=2, max_model_len=64), [SpecDecoding(spec)])
    runner = ContractRunner(2, 64, 0, VOCAB, proposer=proposer(1, 0.0, 6))  # always wrong
    s.add_request(Request(EngineRequest("a", [1, 2], SamplingParams(max_tokens=30))))
    s.update_from_output(out := s.schedule(), runner.execute(out))
    trimmed = False
    for _ in range(10):
        out = s.schedule()
        trimmed |= bool(out.truncated_block_tables)
        s.update_from_output(out, runner.execute(out))
        req = s.requests["a"]
        # Only the next token's slot is held past the computed tokens.
        assert len(s.kv.req_blocks["a"]) == -(-(req.num_computed_tokens + 1) // 2)
    assert trimmed
    assert s.stats().num_spec_accepted_tokens == 0


def test_speculation_never_preempts_and_large_batches_skip_it():
    cfg = _cfg(num_gpu_blocks=8, max_model_len=32, block_size=4)
    s = Scheduler(cfg, [SpecDecoding(SpeculativeConfig(num_tokens=16, max_batch_size=1))])
    runner = ContractRunner(4, 8, 0, VOCAB, proposer=proposer(2, 1.0, 16))
    s.add_request(Request(EngineRequest("a", [1] * 5, SamplingParams(max_tokens=20))))
    s.update_from_output(out := s.schedule(), runner.execute(out))
    out = s.schedule()
    assert out.scheduled_spec_tokens  # alone: it speculates, within the free blocks
    assert s.num_preemptions == 0
    s.update_from_output(out, runner.execute(out))
    s.add_request(Request(EngineRequest("b", [2] * 3, SamplingParams(max_tokens=5))))
    out = s.schedule()
    s.update_from_output(out, runner.execute(out))
    out = s.schedule()
    assert not out.scheduled_spec_tokens  # two running > max_batch_size 1


def test_a_request_with_low_acceptance_stops_speculating_and_comes_back():
    policy = SpecPolicy(SpeculativeConfig(num_tokens=4, min_acceptance_rate=0.5))
    assert policy.num_tokens("a", 1) == 4
    for _ in range(4):
        policy.observe("a", 4, 0)
    assert policy.num_tokens("a", 1) == 0
    # Shadow proposals checked against decoded tokens lift it again.
    tokens = [9, 9]
    for _ in range(6):
        policy.shadow("a", [5, 6], len(tokens))
        tokens += [5, 6]
        policy.check_shadow("a", tokens)
    assert policy.num_tokens("a", 1) == 4


def test_the_first_verify_step_replaces_the_optimistic_guess():
    """A request whose first verify step accepts nothing stops at once (its proposals are costly
    guesses); later steps average in, then move the estimate 30% each."""
    policy = SpecPolicy(SpeculativeConfig(num_tokens=4, min_acceptance_rate=0.4))
    policy.observe("a", 4, 0)
    assert policy.rate("a") == 0.0 and policy.num_tokens("a", 1) == 0
    policy.observe("b", 4, 3)
    assert policy.rate("b") == 0.75 and policy.num_tokens("b", 1) == 4
    policy.observe("b", 4, 1)  # the mean of the first two
    assert policy.rate("b") == 0.5
    policy.observe("b", 4, 4)  # the third, a third of the way
    policy.observe("b", 4, 0)  # then 30% each
    assert policy.rate("b") == pytest.approx(0.7 * (0.5 + (1 - 0.5) / 3))


def test_a_shadow_waits_for_enough_decoded_tokens():
    policy = SpecPolicy(SpeculativeConfig(num_tokens=4))
    policy.shadow("a", [5, 6, 7], 2)
    policy.check_shadow("a", [0, 0, 5])  # one matched, more to come
    assert policy.rate("a") == 1.0
    policy.check_shadow("a", [0, 0, 5, 8])  # second wrong: 1 of 3
    assert policy.rate("a") < 1.0


def test_adaptive_length_grows_on_full_runs_and_falls_back_on_a_miss():
    """max_num_tokens: +num_tokens after a verify step that kept every proposed token, back to
    num_tokens after one that rejected any; never below num_tokens, never above the cap."""
    policy = SpecPolicy(SpeculativeConfig(num_tokens=4, max_num_tokens=10))
    lengths = [policy.num_tokens("a", 1)]
    for accepted in (4, 8, 10, 10, 9, 4, 3):
        policy.observe("a", lengths[-1], accepted)
        lengths.append(policy.num_tokens("a", 1))
    assert lengths == [4, 8, 10, 10, 10, 4, 8, 4]
    assert SpecPolicy(SpeculativeConfig(num_tokens=4)).num_tokens("a", 1) == 4
    assert SpeculativeConfig(num_tokens=4, max_num_tokens=10).proposal_length == 10


def test_without_max_num_tokens_the_length_stays_fixed():
    policy = SpecPolicy(SpeculativeConfig(num_tokens=4))
    for _ in range(3):
        policy.observe("a", 4, 4)
    assert policy.num_tokens("a", 1) == 4


def test_a_shadow_is_judged_at_the_length_it_would_verify():
    policy = SpecPolicy(SpeculativeConfig(num_tokens=2, max_num_tokens=8))
    policy.shadow("a", [5, 6, 7, 8], 0)  # only [5, 6] would run
    policy.check_shadow("a", [5, 6])
    assert policy.rate("a") == 1.0 and policy.num_tokens("a", 1) == 4


@pytest.mark.parametrize(
    "bad",
    [
        {"max_num_tokens": 2**64},
        {"max_num_tokens": -1},
        {"max_num_tokens": float("nan")},
        {"max_num_tokens": 100_000},
        {"max_num_tokens": 3, "num_tokens": 4},
        {"max_num_tokens": 8, "method": "mtp"},
        {"num_tokens": 2**64},
        {"num_tokens": -1},
        {"num_tokens": 100_000},
        {"ngram_min": float("nan")},
        {"min_acceptance_rate": float("nan")},
        {"max_batch_size": 0},
        {"draft_model": "x" * 10_000_000},
        {"method": "x" * 10_000_000},
        {"ngram_min": 5, "ngram_max": 2},
        {"method": "draft"},
        {"method": "ngram", "draft_model": "m"},
        {"draft_model": ""},
        {"draft_model": "a\0b"},
        {"draft_model": 2**64},
        {"max_batch_size": 2**64},
    ],
)
def test_bad_settings_name_their_field(bad):
    from settings import build

    with pytest.raises(ValueError) as err:
        build(SpeculativeConfig, bad)
    assert next(iter(bad)) in str(err.value) or "ngram_min" in str(err.value)
    assert len(str(err.value)) < 300
