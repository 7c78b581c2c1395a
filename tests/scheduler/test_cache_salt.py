"""Cache salts: a request's salt keys the first block of its hash chain, so requests of other
salts share no prefix-cache block, and the ingress and the scheduler, computing the chain each on
its own side, agree on it."""

import math

import pytest

from scheduler.block_hash import extend_block_hashes, hash_block_tokens, hash_prompt_blocks
from scheduler.block_manager import KVCacheManager
from scheduler.config import SchedulerConfig
from scheduler.request import MAX_CACHE_SALT_CHARS, EngineRequest, Request

BS = 16
PROMPT = list(range(3, 3 + 5 * BS + 7))  # five full blocks and a partial one


def test_a_salt_changes_every_block_of_the_chain_and_none_is_the_unsalted_chain():
    plain = hash_prompt_blocks(PROMPT, BS)
    assert hash_prompt_blocks(PROMPT, BS, salt=None) == plain
    a, b = hash_prompt_blocks(PROMPT, BS, salt="a"), hash_prompt_blocks(PROMPT, BS, salt="b")
    assert len(a) == len(b) == len(plain) == 5
    assert not set(a) & set(b) and not set(a) & set(plain)  # no block in common, not just block 0
    assert hash_prompt_blocks(PROMPT, BS, salt="a") == a  # stable: the router recomputes it
    assert hash_block_tokens(None, PROMPT[:BS], salt="a") == a[0]
    assert hash_block_tokens(a[0], PROMPT[BS : 2 * BS]) == a[1]


def test_salt_and_adapter_are_separate_inputs_of_the_seed():
    both = hash_prompt_blocks(PROMPT, BS, lora_name="x", salt="a")
    assert both != hash_prompt_blocks(PROMPT, BS, lora_name="x")
    assert both != hash_prompt_blocks(PROMPT, BS, salt="a")
    # A salt that spells the adapter's seed input does not reach the adapter's chain.
    assert hash_prompt_blocks(PROMPT, BS, salt="lora:x") != hash_prompt_blocks(
        PROMPT, BS, lora_name="x"
    )


def test_the_scheduler_extends_a_salted_chain_from_the_salted_seed():
    """A prompt shorter than a block reaches the scheduler with no hashes: its first full block
    (prompt and outputs) is still keyed by the salt."""
    short = EngineRequest("r", PROMPT[: BS - 3], cache_salt="a")
    request = Request(short)
    request.all_token_ids.extend(PROMPT[BS - 3 : 2 * BS])
    assert extend_block_hashes([], request.all_token_ids, BS, 2, None, "a") == hash_prompt_blocks(
        PROMPT[: 2 * BS], BS, salt="a"
    )
    kv = KVCacheManager(SchedulerConfig(num_gpu_blocks=16, max_model_len=256, block_size=BS))
    assert kv._ensure_hashes(request, 2) == hash_prompt_blocks(PROMPT[: 2 * BS], BS, salt="a")


def computed(kv: KVCacheManager, rid: str, salt: str | None) -> Request:
    """A request for PROMPT whose blocks are computed and registered, then freed (cached)."""
    request = Request(
        EngineRequest(
            rid, PROMPT, block_hashes=hash_prompt_blocks(PROMPT, BS, salt=salt), cache_salt=salt
        )
    )
    assert kv.allocate_slots(request, len(PROMPT)) is not None
    request.num_computed_tokens = len(PROMPT)
    kv.register_computed_blocks(request)
    kv.free(request)
    return request


@pytest.mark.parametrize("other", ["b", None])
def test_a_cached_prompt_is_found_under_its_own_salt_only(other):
    kv = KVCacheManager(SchedulerConfig(num_gpu_blocks=32, max_model_len=256, block_size=BS))
    computed(kv, "first", "a")
    again = Request(EngineRequest("again", PROMPT, cache_salt="a"))
    stranger = Request(EngineRequest("stranger", PROMPT, cache_salt=other))
    assert len(kv.find_cached_blocks(again)) == 5
    assert kv.find_cached_blocks(stranger) == []


@pytest.mark.parametrize(
    "salt", [2**64, -1, math.nan, "", "x" * (MAX_CACHE_SALT_CHARS + 1), "x" * 10_000_000, b"a"]
)
def test_a_bad_cache_salt_is_a_value_error_naming_it(salt):
    with pytest.raises(ValueError, match="^cache_salt: must be a string of 1 to 1024 characters"):
        EngineRequest("r", [1, 2], cache_salt=salt)


def test_the_longest_cache_salt_is_taken():
    assert EngineRequest("r", [1, 2], cache_salt="x" * MAX_CACHE_SALT_CHARS).cache_salt
