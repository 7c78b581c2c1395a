"""The prefix block hash as every process computes it: pinned 128-bit keys (the ingress, the router
and other engines must keep agreeing with the scheduler), the decode step's one-block path giving
the chain's own keys, and token ids that are no int64 refused as before."""

from __future__ import annotations

import math

import pytest

from scheduler import (
    EngineRequest,
    ModelRunnerOutput,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    extend_block_hashes,
    hash_block_tokens,
    hash_prompt_blocks,
)
from scheduler.lora_slots import LoraSlots

# Keys of blocks [0..15] and [16..31] as the tree before the packing change computed them
# (array("q") bytes, blake2b of 16 bytes); a change of key must change every caller.
PINNED_BASE = [98562865675230938254009426395686591213, 260735983447090379609627041978163051417]
PINNED_LORA_SALT = [
    258661616344736521569824172984630807264,
    253062572761841293833548181451931870998,
]


def test_the_keys_are_pinned() -> None:
    tokens = list(range(32))
    assert hash_prompt_blocks(tokens, 16) == PINNED_BASE
    assert hash_prompt_blocks(tokens, 16, lora_name="a", salt="b") == PINNED_LORA_SALT
    assert hash_block_tokens(None, tokens[:16]) == PINNED_BASE[0]
    assert hash_block_tokens(PINNED_BASE[0], tokens[16:]) == PINNED_BASE[1]
    assert extend_block_hashes(PINNED_LORA_SALT[:1], tokens, 16, 2) == PINNED_LORA_SALT


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (2**64, OverflowError),
        (2**63, OverflowError),
        (-(2**63) - 1, OverflowError),
        (10**400, OverflowError),
        (math.nan, TypeError),
        ("7", TypeError),
    ],
)
def test_a_token_id_that_is_no_int64_is_refused_and_leaves_the_chain_as_it_was(bad, error):
    tokens = [*range(16), *range(15), bad]
    chain = hash_prompt_blocks(tokens[:16], 16)
    for call in (
        lambda: hash_prompt_blocks(tokens, 16),
        lambda: hash_block_tokens(chain[0], tokens[16:]),
        lambda: extend_block_hashes(chain, tokens, 16, 2),
    ):
        with pytest.raises(error):
            call()
    assert chain == hash_prompt_blocks(tokens[:16], 16)  # nothing appended by the failed extend
    # -1 is an int64 (and hashes like any other id): only ids outside int64 are refused.
    assert len(hash_prompt_blocks([-1] * 16, 16)) == 1


@pytest.mark.parametrize("lora_salt", [(None, None), ("a0", "tenant")])
def test_decode_blocks_registered_one_a_step_carry_the_whole_chains_keys(lora_salt) -> None:
    lora, salt = lora_salt
    cfg = SchedulerConfig(
        max_num_batched_tokens=64,
        max_num_seqs=2,
        block_size=4,
        num_gpu_blocks=32,
        max_model_len=128,
        enable_prefix_caching=True,
    )
    sched = Scheduler(cfg)
    sched.loras = LoraSlots(1)
    sched.loras.register("a0", "a0@files")
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    spec = EngineRequest("r", list(range(100, 110)), params, lora_name=lora, cache_salt=salt)
    sched.add_request(Request(spec))
    for i in range(20):
        out = sched.schedule()
        sched.update_from_output(out, ModelRunnerOutput(["r"], [[500 + i]]))
    req = sched.requests["r"]
    assert req.is_finished and len(req.all_token_ids) == 30
    # Every full block written was hashed (the last token's KV never was: 29 written, 7 blocks).
    expected = hash_prompt_blocks(req.all_token_ids, 4, lora_name=lora, salt=salt)[:7]
    assert req.block_hashes == expected
    assert all(h in sched.kv.pool.cached for h in expected)
