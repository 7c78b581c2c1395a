"""The router's prefix affinity under cache salts (tenant scopes): a replica's salted blocks
attract the next request of the same salt and no other."""

from router.prefix_index import PrefixIndex
from scheduler.block_hash import hash_prompt_blocks
from scheduler.block_manager import KVCacheManager
from scheduler.config import SchedulerConfig
from tests.scheduler.test_cache_salt import BS, PROMPT, computed


def test_the_router_matches_a_replicas_salted_blocks_within_the_salt_only():
    """The replica reports the hashes its scheduler registered; the ingress's hashes of the next
    request (the same function, the same salt) find that replica; another salt's find none."""
    kv = KVCacheManager(SchedulerConfig(num_gpu_blocks=32, max_model_len=256, block_size=BS))
    computed(kv, "first", "a")
    index = PrefixIndex(max_blocks=1000)
    index.sync_replica("r1", kv.pool.prefix_report(100), now=0.0, grace_s=0.0)
    same = hash_prompt_blocks(PROMPT, BS, salt="a")
    assert index.match(same, ["r1", "r2"]) == {"r1": 5, "r2": 0}
    for other in ("b", None):
        assert index.match(hash_prompt_blocks(PROMPT, BS, salt=other), ["r1"]) == {"r1": 0}
