"""Paged KV block pool with prefix caching and a CPU swap pool.

Full blocks are keyed by a hash chained over (parent hash, block tokens). Freed blocks keep their
hash and stay findable until the allocator hands them out again (lazy eviction); the free list is
an LRU so the longest-unused cached blocks are evicted first.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from scheduler.block_hash import (
    extend_block_hashes,
    extend_image_block_hashes,
    hash_block_tokens,
)
from scheduler.block_hash import hash_prompt_blocks as hash_prompt_blocks  # engine/disagg.py's
from scheduler.config import SchedulerConfig
from scheduler.kv_events import DEVICE, REMOVED, STORED, KVEventLog
from scheduler.request import Request


@dataclass(frozen=True, slots=True)
class PrefixReport:
    """The pool's cached hashes for the router, and how they changed since the pool's previous
    report.

    A router that applied report base_id can apply `listed` and `unlisted` instead of comparing
    the whole list with the one before: the changes are a few blocks out of about a thousand.
    """

    hashes: list[int]  # up to the limit's most recently cached, oldest first
    report_id: int
    base_id: int | None = None  # None: no change given (the first report, or a list cut short)
    listed: list[int] = field(default_factory=list)  # cached now, not at base_id: in `hashes` order
    unlisted: list[int] = field(default_factory=list)  # cached at base_id, not now


class BlockPool:
    """GPU blocks: reference counts, the LRU free list and the hash -> block index."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # Head is evicted first; a freed block goes to the tail.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # insertion order: most recently registered last
        self.version = 0  # bumped when `cached` changes, so readers can skip an unchanged index
        self.resets = 0  # reset_prefix_cache calls: what was cached before holds stale contents
        self._recent: tuple[int, int, list[int]] = (-1, 0, [])
        # Since the last prefix_report (tracked only once one was taken): hashes registered and
        # still cached, in order, and hashes that report listed and eviction has dropped since.
        self._reports = 0
        self._reported_whole = False  # the last report listed the whole index (it fit the limit)
        self._listed_since: dict[int, None] | None = None
        self._unlisted_since: set[int] = set()
        # Called with (block id, hash) before a cached block is reused: the KV connector's save
        # to a lower tier (scheduler/kv_connector.py). None: evicted blocks are dropped.
        self.on_evict: Callable[[int, int], None] | None = None
        # Told each hash that becomes findable or stops being findable here (the router's exact
        # index, scheduler/kv_events.py). None: nobody listens.
        self.events: KVEventLog | None = None

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[int]:
        """Take n blocks from the head of the free list, evicting their cached hashes."""
        free, ref_cnt, block_hash, cached = self.free, self.ref_cnt, self.block_hash, self.cached
        out = []
        for _ in range(n):
            block_id, _ = free.popitem(last=False)
            h = block_hash[block_id]
            if h is not None:
                if cached.get(h) == block_id:
                    del cached[h]
                    self.version += 1
                    if self._listed_since is not None:
                        self._untrack(h)
                    if self.events is not None:
                        self.events.record(REMOVED, DEVICE, h)
                    if self.on_evict is not None:
                        self.on_evict(block_id, h)
                block_hash[block_id] = None
            ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks (a prefix hit), pulling free ones off the free list."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self.free[block_id]
            self.ref_cnt[block_id] += 1

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per block; blocks reaching zero join the LRU tail in the given
        order."""
        ref_cnt, free = self.ref_cnt, self.free
        for block_id in block_ids:
            ref_cnt[block_id] -= 1
            if ref_cnt[block_id] == 0:
                free[block_id] = None

    def cached_run(self, hashes: Sequence[int]) -> list[int]:
        """The blocks of the leading hashes still findable here, in a row (what a peer pull's
        export sends, engine/peer_pull.py; the simulator's peers, sim/fleet_kv.py)."""
        cached = self.cached
        blocks = []
        for h in hashes:
            block = cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def register(self, block_id: int, block_hash: int) -> None:
        """Make a full, computed block findable by its hash (first writer wins)."""
        self.register_run([block_id], [block_hash], 0, 1)

    def register_run(
        self, block_ids: Sequence[int], hashes: Sequence[int], start: int, end: int
    ) -> None:
        """register(block_ids[i], hashes[i]) for i in [start, end): a request's newly full blocks
        in one call (a decode step's one block costs a call, not a loop of them)."""
        cached, block_hash = self.cached, self.block_hash
        for i in range(start, end):
            h = hashes[i]
            if h in cached:  # first writer wins
                continue
            cached[h] = block_id = block_ids[i]
            block_hash[block_id] = h
            self.version += 1
            if self.events is not None:
                self.events.record(STORED, DEVICE, h)
            if self._listed_since is not None:
                if h in self._unlisted_since:  # evicted and back: listed as before
                    self._unlisted_since.discard(h)
                else:
                    self._listed_since[h] = None

    def _untrack(self, block_hash: int) -> None:
        listed = self._listed_since
        if listed is not None and block_hash in listed:  # registered and evicted between reports
            del listed[block_hash]
        else:
            self._unlisted_since.add(block_hash)

    def recent_hashes(self, limit: int) -> list[int]:
        """Up to `limit` cached hashes, oldest first: O(limit) after a change, O(1) when
        unchanged."""
        version, cached_limit, hashes = self._recent
        if version != self.version or cached_limit != limit:
            # One pass when all fit: each pass touches every hash object (cache misses at fleet
            # scale).
            if len(self.cached) <= limit:
                hashes = list(self.cached)
            else:  # from the newest end: a GPU pool may cache far more than the limit
                hashes = list(itertools.islice(reversed(self.cached), limit))[::-1]
            self._recent = (self.version, limit, hashes)
        return hashes

    def prefix_report(self, limit: int) -> PrefixReport:
        """recent_hashes(limit), numbered, with its change since the previous report when both hold
        the whole index."""
        hashes = self.recent_hashes(limit)
        whole = len(self.cached) <= limit
        self._reports += 1
        if self._listed_since is not None and self._reported_whole and whole:
            report = PrefixReport(
                hashes,
                self._reports,
                self._reports - 1,
                list(self._listed_since),
                list(self._unlisted_since),
            )
        else:
            report = PrefixReport(hashes, self._reports)
        self._reported_whole = whole
        self._listed_since, self._unlisted_since = {}, set()
        return report

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash: the KV those blocks hold was computed with weights that have
        changed, or was freed by sleep (engine/weights.py). Later lookups find none of them; returns
        how many were forgotten."""
        forgotten = list(self.cached.items())
        for block_hash, block_id in forgotten:
            self.block_hash[block_id] = None
            if self._listed_since is not None:
                self._untrack(block_hash)
            if self.events is not None:
                self.events.record(REMOVED, DEVICE, block_hash)
        self.cached.clear()
        self.version += 1
        self.resets += 1
        return len(forgotten)

    def num_evictable(self, block_ids: Sequence[int]) -> int:
        """How many of these (cached) blocks sit on the free list, so touching them uses up free
        blocks."""
        ref_cnt = self.ref_cnt
        return sum(1 for b in block_ids if ref_cnt[b] == 0)


class KVCacheManager:
    """Per-request block tables over the GPU pool, prefix-cache lookups and swap to the CPU pool."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.block_size = config.block_size
        self.enable_prefix_caching = config.enable_prefix_caching
        num_gpu_blocks, _ = config.require_sizes()
        self.pool = BlockPool(num_gpu_blocks)
        self.cpu_free: list[int] = list(range(config.cpu_blocks - 1, -1, -1))
        # CPU blocks released by a swap-in return to the pool only after the step is emitted, so a
        # swap-out in the same step cannot overwrite them before the swap-in reads them.
        self._cpu_pending_free: list[int] = []
        self.req_blocks: dict[str, list[int]] = {}
        self.req_cpu_blocks: dict[str, list[int]] = {}
        # Leading blocks of each request already registered in the prefix cache.
        self.num_registered_blocks: dict[str, int] = {}
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        # (hashes, n) -> how many of n leading cached blocks a hit may use; None: all of them.
        # A hybrid model's state checkpoints round a hit down (scheduler/state_checkpoints.py).
        self.usable_prefix: Callable[[list[int], int], int] | None = None

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def blocks_of(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def num_reclaimable_blocks(self, request_ids: Sequence[str]) -> int:
        """Blocks that freeing all these requests would return to the pool: those no one else
        holds."""
        held = Counter(b for rid in request_ids for b in self.req_blocks.get(rid, ()))
        ref_cnt = self.pool.ref_cnt
        return sum(1 for block, owners in held.items() if ref_cnt[block] == owners)

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------------------------------
    def _ensure_hashes(self, request: Request, num_blocks: int) -> list[int]:
        hashes, bs = request.block_hashes, self.block_size
        done = len(hashes)
        if done >= num_blocks:  # hashed already (a prompt the sender hashed, a lookup)
            return hashes
        tokens, end = request.all_token_ids, done * bs + bs
        if done and num_blocks == done + 1 and end <= len(tokens) and not request.image_spans:
            # One block after a chain (a decode filled it): extend_block_hashes' key for it, at
            # half the cost of its general path (bench/scheduler_overhead.py).
            hashes.append(hash_block_tokens(hashes[-1], tokens[end - bs : end]))
            return hashes
        lora, salt, spans = request.spec.lora_key, request.spec.cache_salt, request.image_spans
        if spans:
            return extend_image_block_hashes(hashes, tokens, bs, num_blocks, spans, lora, salt)
        return extend_block_hashes(hashes, tokens, bs, num_blocks, lora, salt)

    def reuses_prefix(self, request: Request) -> bool:
        """Whether the request may start from cached KV: not one that asks for its prompt's
        log-probabilities, nor a mean-pooled embedding (every prompt position goes through the
        model)."""
        params = request.sampling_params
        return (
            self.enable_prefix_caching
            and params.pooling != "mean"
            and params.prompt_logprobs is None
        )

    def find_cached_blocks(self, request: Request) -> list[int]:
        """The longest run of cached leading blocks, leaving at least the last token to compute.
        None for a request whose every prompt position must go through the model: one that asks
        for its prompt's log-probabilities, or a mean-pooled embedding."""
        if not self.reuses_prefix(request):
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._ensure_hashes(request, max_blocks)
        cached = self.pool.cached
        hit: list[int] = []
        for i in range(max_blocks):
            block_id = cached.get(hashes[i])
            if block_id is None:
                break
            hit.append(block_id)
        if self.usable_prefix is not None:
            del hit[self.usable_prefix(hashes, len(hit)) :]
        return hit

    def block_hashes(self, request: Request, num_blocks: int) -> list[int]:
        """The request's chain of block hashes, extended to (at most) num_blocks."""
        return self._ensure_hashes(request, num_blocks)

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def register_computed_blocks(self, request: Request, num_written: int | None = None) -> None:
        """Register the request's full blocks whose KV is now written (called after a step ran).

        num_written: its tokens whose KV is written, when steps still in flight count in
        num_computed_tokens (async scheduling)."""
        rid = request.request_id
        done = self.num_registered_blocks.get(rid, 0)
        if num_written is None:
            num_written = request.num_computed_tokens
        # Accepted speculative tokens are computed before they are appended: hash what is there
        # (min() without its call: this runs once per block_size decode steps per request).
        num_tokens = len(request.all_token_ids)
        num_full = (num_written if num_written < num_tokens else num_tokens) // self.block_size
        if num_full <= done:
            return
        hashes = self._ensure_hashes(request, num_full)
        self.pool.register_run(self.req_blocks[rid], hashes, done, num_full)
        self.num_registered_blocks[rid] = num_full

    # ---- allocation ----------------------------------------------------------------------------
    def can_admit(self, request: Request, cached_blocks: Sequence[int], reserve: int) -> bool:
        """Whether blocks for the request's whole sequence so far fit, keeping `reserve` blocks
        free."""
        needed = self.num_blocks_needed(request.num_tokens) - len(cached_blocks)
        return needed + self.pool.num_evictable(cached_blocks) <= self.pool.num_free - reserve

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_blocks: Sequence[int] = ()
    ) -> list[int] | None:
        """Find blocks for num_new_tokens more tokens (after a prefix hit of cached_blocks).

        Returns the block ids added to the request's table (hit blocks first), or None when the
        free pool is too small; nothing changes in that case.
        """
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        if blocks is None:
            blocks = self.req_blocks[rid] = []
            self.num_registered_blocks[rid] = len(cached_blocks)
        total = request.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        needed = -(-total // self.block_size) - len(blocks) - len(cached_blocks)
        if needed <= 0 and not cached_blocks:
            return []
        pool = self.pool
        if max(needed, 0) + pool.num_evictable(cached_blocks) > pool.num_free:
            return None
        new_blocks = list(cached_blocks)
        if cached_blocks:
            pool.touch(cached_blocks)
        if needed > 0:
            new_blocks.extend(pool.allocate(needed))
        blocks.extend(new_blocks)
        return new_blocks

    def trim(self, request: Request, num_tokens: int) -> int | None:
        """Release the request's blocks past those its first num_tokens tokens need (slots of
        rejected speculative tokens), tail first; the blocks kept, or None when none was released.
        Trailing blocks were never registered: only blocks of computed, accepted tokens are."""
        blocks = self.req_blocks.get(request.request_id)
        keep = self.num_blocks_needed(num_tokens)
        if not blocks or len(blocks) <= keep:
            return None
        self.pool.release(blocks[keep:][::-1])
        del blocks[keep:]
        return keep

    def free(self, request: Request) -> None:
        """Release the request's GPU blocks (tail first, so its prefix stays cached longest)."""
        rid = request.request_id
        blocks = self.req_blocks.pop(rid, None)
        self.num_registered_blocks.pop(rid, None)
        if blocks:
            self.pool.release(blocks[::-1])
        cpu = self.req_cpu_blocks.pop(rid, None)
        if cpu:
            self.cpu_free.extend(cpu)

    # ---- swap ----------------------------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        return 0 < len(self.req_blocks.get(request.request_id, ())) <= len(self.cpu_free)

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to the CPU pool; returns (gpu, cpu) copies to run first."""
        rid = request.request_id
        gpu = self.req_blocks.pop(rid)
        self.num_registered_blocks.pop(rid, None)
        cpu = [self.cpu_free.pop() for _ in gpu]
        self.req_cpu_blocks[rid] = cpu
        self.pool.release(gpu[::-1])
        return list(zip(gpu, cpu))

    def _swap_in_size(self, request: Request, num_new_tokens: int) -> int:
        # A victim taken out mid-step may hold a block more than its computed tokens need.
        needed = self.num_blocks_needed(request.num_computed_tokens + num_new_tokens)
        return max(needed, len(self.req_cpu_blocks[request.request_id]))

    def can_swap_in(self, request: Request, num_new_tokens: int, reserve: int) -> bool:
        return self._swap_in_size(request, num_new_tokens) <= self.pool.num_free - reserve

    def swap_in(
        self, request: Request, num_new_tokens: int
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Bring a swapped request back: its new block table and the (gpu, cpu) copies to run."""
        rid = request.request_id
        gpu = self.pool.allocate(self._swap_in_size(request, num_new_tokens))
        cpu = self.req_cpu_blocks.pop(rid)
        self.req_blocks[rid] = gpu
        # The copied blocks hold computed KV, but they are registered only after the step runs.
        self.num_registered_blocks[rid] = 0
        self._cpu_pending_free.extend(cpu)
        return list(gpu), list(zip(gpu, cpu))

    def end_step(self) -> None:
        """Return CPU blocks released by this step's swap-ins to the free pool; close the step's
        KV event batch."""
        if self.pool.events is not None:
            self.pool.events.end_step()
        if self._cpu_pending_free:
            self.cpu_free.extend(self._cpu_pending_free)
            self._cpu_pending_free.clear()
