"""Prefix caching for hybrid models: recurrent-state checkpoints at block boundaries.

A hybrid model's full-attention layers keep paged KV, which the prefix cache reuses block by block,
but its linear layers (gated DeltaNet, Mamba-2) fold the whole prefix into one state per request.
A prefix hit is usable only where that state is known too, so the state is copied, at a block
boundary, into a checkpoint slot keyed by the hash of the block ending there (the prefix cache's
hash chain, so LoRA adapters and cache salts key checkpoints as they key blocks).

Which boundaries: in each step, the last block boundary a prompt chunk crosses (so the last full
block of each prefill chunk, and the last full block of the prompt). A request's hit is the
longest run of cached blocks rounded down to the last one that has a checkpoint; it starts from a
copy of that checkpoint and computes only the tokens after it. A checkpoint is usable while its
block is cached: one whose block was evicted (or whose hash the cache forgot) is never found by a
lookup, and its slot is the first to be reused. Otherwise slots are reused least recently used
first; one being written by a step in flight is never reused.

The slots are numbered here and travel in the SchedulerOutput (`StateCopies`): the workers keep
the checkpoints beside the running slots (workers/linear_state.py) and copy a checkpoint into a
request's slot before the forward (`restore`), and a request's state into a checkpoint after the
first tokens of its row (`save`). `StateCheckpointFeature` is the step feature that decides both.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from scheduler.features import StepFeature
from scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from scheduler.request import Request
from scheduler.state_slots import MAX_STATE_SLOTS, StateCopies

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler
    from scheduler.step import Step


class CheckpointPool:
    """`num` checkpoint slots: which block hash each holds, and which are being written."""

    def __init__(self, num: int) -> None:
        if not isinstance(num, int) or isinstance(num, bool) or not 1 <= num <= MAX_STATE_SLOTS:
            raise ValueError(
                f"num_state_checkpoints: must be an integer in [1, {MAX_STATE_SLOTS}], got {num!r}"
            )
        self.num = num
        self.by_hash: dict[int, int] = {}  # block hash -> checkpoint (written)
        self.hash_of: dict[int, int] = {}  # checkpoint -> block hash (written or being written)
        self.pending: dict[int, int] = {}  # checkpoint -> block hash, written by a step in flight
        self.dropped: set[int] = set()  # pending ones forgotten before their step came back
        # Reuse order, least recently used first; an unused checkpoint is taken before any.
        self.order: OrderedDict[int, None] = OrderedDict.fromkeys(range(num))

    def find(self, block_hash: int) -> int | None:
        return self.by_hash.get(block_hash)

    def use(self, checkpoint: int) -> None:
        """A hit restores from it: it is reused last."""
        self.order.move_to_end(checkpoint)

    def take(self, block_hash: int, cached: dict[int, int]) -> int | None:
        """A checkpoint to write block_hash's state into (None: every one is being written):
        one whose block is no longer cached first, else the least recently used."""
        pending = self.pending
        stale = next(
            (c for c, h in self.hash_of.items() if h not in cached and c not in pending), None
        )
        if stale is None:
            stale = next((c for c in self.order if c not in pending), None)
        if stale is None:
            return None
        old = self.hash_of.pop(stale, None)
        if old is not None and self.by_hash.get(old) == stale:
            del self.by_hash[old]
        self.hash_of[stale] = self.pending[stale] = block_hash
        self.order.move_to_end(stale)
        return stale

    def written(self, checkpoint: int, ran: bool) -> None:
        """The step that saved it is back: its block's hash finds it from now on, or, when the
        row did not run (its request failed at the runner), it holds nothing."""
        block_hash = self.pending.pop(checkpoint)
        if ran and checkpoint not in self.dropped:
            self.by_hash[block_hash] = checkpoint
        else:
            self.dropped.discard(checkpoint)
            del self.hash_of[checkpoint]
            self.order.move_to_end(checkpoint, last=False)

    def forget_all(self) -> None:
        """The model's weights changed (the prefix cache was reset): no checkpoint holds a state
        of the weights now, those being written included."""
        self.by_hash.clear()
        self.hash_of = dict(self.pending)
        self.dropped = set(self.pending)

    def check(self) -> None:
        """The pool's invariants (tests call it): every found checkpoint holds its hash, none is
        found and pending at once, and every checkpoint is in the reuse order once."""
        assert all(self.hash_of[c] == h for h, c in self.by_hash.items())
        assert not set(self.by_hash.values()) & set(self.pending)
        assert sorted(self.order) == list(range(self.num))


class StateCheckpointFeature(StepFeature):
    """The scheduler's side of hybrid prefix caching (the module docstring): rounds each lookup
    down to a checkpointed block, and lists each step's restores and saves in its output."""

    def __init__(self, num_checkpoints: int) -> None:
        self.pool = CheckpointPool(num_checkpoints)
        self.resets = 0  # the block pool's reset count this pool has seen

    def _check_reset(self) -> None:
        """A reset prefix cache forgets blocks whose hashes come back with the new weights' KV:
        the checkpoints keyed by them would restore the old weights' state."""
        if self.sched.kv.pool.resets != self.resets:
            self.resets = self.sched.kv.pool.resets
            self.pool.forget_all()

    def bind(self, sched: Scheduler) -> None:
        super().bind(sched)
        sched.kv.usable_prefix = self.usable_prefix

    def usable_prefix(self, hashes: list[int], num_blocks: int) -> int:
        """Of a hit of num_blocks leading cached blocks, the blocks before the last checkpoint."""
        self._check_reset()
        for n in range(num_blocks, 0, -1):
            if hashes[n - 1] in self.pool.by_hash:
                return n
        return 0

    def after_schedule(self, step: Step, out: SchedulerOutput) -> None:
        self._check_reset()
        copies = StateCopies()
        bs, requests = self.sched.kv.block_size, self.sched.requests
        for rid in out.num_scheduled_tokens:
            req, start = requests[rid], step.start[rid]
            if start and rid in step.admitted:  # a prefix hit: it starts from its checkpoint
                checkpoint = self.pool.by_hash[req.block_hashes[start // bs - 1]]
                self.pool.use(checkpoint)
                copies.restore[rid] = checkpoint
        for rid, n in out.num_scheduled_tokens.items():  # after the restores: see take()
            save = self._save(requests[rid], step.start[rid], n)
            if save is not None:
                copies.save[rid] = save
        if copies.restore or copies.save:
            out.state_copies = copies

    def _save(self, req: Request, start: int, n: int) -> tuple[int, int] | None:
        """(offset, checkpoint) when the row crosses a prompt block boundary not yet saved."""
        kv = self.sched.kv
        end = min(start + n, req.num_prompt_tokens) // kv.block_size * kv.block_size
        if end <= start:
            return None
        block_hash = kv.block_hashes(req, end // kv.block_size)[end // kv.block_size - 1]
        pool = self.pool
        if block_hash in pool.by_hash or block_hash in pool.pending.values():
            return None
        # A checkpoint a restore of this step reads may be taken: the workers restore first.
        checkpoint = pool.take(block_hash, kv.pool.cached)
        return None if checkpoint is None else (end - start, checkpoint)

    def after_update(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> None:
        copies = sched_out.state_copies
        if copies is not None:
            for rid, (_, checkpoint) in copies.save.items():
                self.pool.written(checkpoint, ran=rid not in runner_out.failed)
