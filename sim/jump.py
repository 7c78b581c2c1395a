"""The simulator's multi-step decode: a stretch of k pure-decode steps applied in one call.

While nothing waits and every running request has only its last sampled token to compute, the
next steps are one-token decodes of the same batch, and nothing outside the replica can tell k of
them from one call that applies all k. `DecodeJump` is a step feature (scheduler/features.py) of
the production `Scheduler` that adds that call; it hooks no step, so every step the simulator does
not jump runs the production code. `JumpKVCacheManager` replays the k steps' block allocations and
prefix-hash registrations in the order the single steps make them; `sim_scheduler` builds the
production Scheduler over it.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.block_manager import KVCacheManager
from scheduler.config import SchedulerConfig
from scheduler.features import StepFeature
from scheduler.outputs import RequestOutput, request_output
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import Scheduler
from scheduler.stop import check_stop, is_stop_token

# Finished requests hold their token lists (~10 KB each): 1,000 replicas retaining the production
# scheduler's 1,024 each would hold gigabytes that nothing in the simulator reads.
FINISHED_RETENTION = 8


class JumpKVCacheManager(KVCacheManager):
    """The KV block pool, able to apply k one-token decode steps of a batch at once."""

    def num_decode_blocks(self, requests: Sequence[Request], num_steps: int) -> int:
        """New blocks that num_steps one-token decode steps of every request would allocate."""
        bs = self.block_size
        total = 0
        for req in requests:
            held = len(self.req_blocks[req.request_id])
            total += max(0, -(-(req.num_computed_tokens + num_steps) // bs) - held)
        return total

    def advance_decode(self, requests: Sequence[Request], num_steps: int) -> None:
        """Apply num_steps one-token decode steps of requests (in batch order) to the pool.

        Blocks are allocated and full blocks registered in exactly the order the single steps
        would do it (step by step; allocations of a step before its registrations; batch order
        within each), so free-list order, evictions and the hash index end up the same. The
        caller has checked that the free pool suffices and appended the sampled tokens.
        """
        events: list[tuple[int, int, int]] = []  # (step, 0 allocate | 1 register, batch position)
        bs = self.block_size
        for i, req in enumerate(requests):
            c = req.num_computed_tokens
            # Step j writes position c + j - 1: a new block each time that position starts one.
            first_alloc = len(self.req_blocks[req.request_id]) * bs - c + 1
            events.extend((j, 0, i) for j in range(first_alloc, num_steps + 1, bs))
            if self.enable_prefix_caching:
                events.extend((j, 1, i) for j in self._register_steps(req, num_steps))
        events.sort()
        pool = self.pool
        for j, kind, i in events:
            req = requests[i]
            if kind == 0:
                self.req_blocks[req.request_id].extend(pool.allocate(1))
            else:
                start = req.num_computed_tokens
                req.num_computed_tokens = start + j
                self.register_computed_blocks(req)
                req.num_computed_tokens = start
        for req in requests:
            req.num_computed_tokens += num_steps

    def _register_steps(self, request: Request, num_steps: int) -> list[int]:
        """The decode steps after which update_from_output would register request's full blocks."""
        bs = self.block_size
        c = request.num_computed_tokens
        registered = self.num_registered_blocks.get(request.request_id, 0)
        # A request behind on registration (none normally, between steps) catches up in step 1.
        first = 1 if (c + 1) // bs > registered else (registered + 1) * bs - c
        if first > num_steps:
            return []
        later = ((c + first) // bs + 1) * bs - c
        return [first, *range(later, num_steps + 1, bs)]


def sim_scheduler(config: SchedulerConfig, features: Sequence[StepFeature] = ()) -> Scheduler:
    """The production Scheduler as a simulated replica runs it: its pool a JumpKVCacheManager,
    few finished requests retained, and `features` (a DecodeJump among them to jump)."""
    return Scheduler(
        config,
        features,
        kv_manager_class=JumpKVCacheManager,
        finished_retention=FINISHED_RETENTION,
    )


class DecodeJump(StepFeature):
    """`advance_decode`: k pure-decode steps of the scheduler it is bound to, in one call. It
    needs the scheduler's pool to be a JumpKVCacheManager (sim_scheduler)."""

    kv: JumpKVCacheManager

    def bind(self, sched: Scheduler) -> None:
        if not isinstance(sched.kv, JumpKVCacheManager):
            raise TypeError("DecodeJump: the scheduler's pool must be a JumpKVCacheManager")
        super().bind(sched)
        self.kv = sched.kv

    def max_decode_jump(self, limit: int) -> int:
        """How many of the next steps (at most limit) are certain to be the same pure-decode step.

        That holds while nothing waits, every running request has just its last sampled token to
        compute, the whole batch fits the token budget, no request reaches max_tokens or
        max_model_len before the last of them, and the free pool covers every block the batch
        crosses (so nothing is preempted). A stop token before the last step is the caller's to
        rule out.
        """
        sched = self.sched
        running = sched.running
        if not running or len(sched.waiting) or len(running) > sched.config.max_num_batched_tokens:
            return 0
        k = limit
        for req in running:
            n = len(req.all_token_ids)
            if n - req.num_computed_tokens != 1:
                return 0
            # The step that reaches a cap finishes the request: it may be the last one.
            outputs_left = req.sampling_params.max_tokens - len(req.output_token_ids)
            k = min(k, outputs_left, sched.max_model_len - n)
        if k <= 0:
            return 0
        free = self.kv.num_free_blocks
        if self.kv.num_decode_blocks(running, k) <= free:  # the common case: the pool is no limit
            return k
        lo, hi = 0, k - 1  # largest step count whose new blocks fit the free pool (monotone)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.kv.num_decode_blocks(running, mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def advance_decode(self, sampled_token_ids: dict[str, list[int]]) -> list[RequestOutput]:
        """Run k pure-decode steps at once: state as after k `schedule()` + `update_from_output()`.

        sampled_token_ids holds, for every running request, the k tokens its steps sample (a stop
        token only as the last); k must not exceed `max_decode_jump(k)`. Block tables, the free
        list, prefix-hash registrations, fair-share counters, token lists and the finishes of the
        last step end as the single steps would leave them. Returns one output per request
        carrying all k tokens (no logprobs). A jump sends nothing to a model runner: the finished
        requests whose ids the first step would have carried to it are taken as told.
        """
        k = self._check_jump(sampled_token_ids)
        sched = self.sched
        running = sched.running
        finishing: list[tuple[Request, RequestStatus]] = []
        for req in running:
            tokens = sampled_token_ids[req.request_id]
            req.output_token_ids.extend(tokens)
            req.all_token_ids.extend(tokens)
            req.num_synced_tokens = len(req.all_token_ids) - 1  # the last step's token is not sent
            # _check_jump ruled out any stop before the last step: only its token may finish one.
            status = check_stop(req, sched.max_model_len)
            if status is not None:
                finishing.append((req, status))
        sched.finished.take_ids()
        self.kv.advance_decode(running, k)
        self.kv.end_step()
        if sched.waiting.charges_tokens:
            self._charge_decode(running, k)
        # Freeing commutes with the last step's registrations (neither touches what the other
        # reads), so the finishes come after them, in batch order as update_from_output makes them.
        for req, status in finishing:
            sched.finish(req, status)
        outputs = [request_output(req, sampled_token_ids[req.request_id]) for req in running]
        if finishing:
            sched.running = [r for r in running if r.status is RequestStatus.RUNNING]
        return outputs

    def _check_jump(self, sampled_token_ids: dict[str, list[int]]) -> int:
        """The jump's step count; raises ValueError for tokens that k single steps would not
        take."""
        running = self.sched.running
        k = len(next(iter(sampled_token_ids.values()), ()))
        if sampled_token_ids.keys() != {r.request_id for r in running}:
            raise ValueError("sampled_token_ids: needs exactly the running requests' ids")
        if (
            k < 1
            or any(len(t) != k for t in sampled_token_ids.values())
            or self.max_decode_jump(k) < k
        ):
            raise ValueError(
                f"sampled_token_ids: {k} steps is not a pure-decode stretch of equal length"
            )
        heads: dict[int, frozenset[int]] = {}  # callers often pass one list for many requests
        for req in running:
            tokens = sampled_token_ids[req.request_id]
            head = heads.get(id(tokens))
            if head is None:
                head = heads[id(tokens)] = frozenset(tokens[:-1])
            for token in head:
                if is_stop_token(req, token):
                    raise ValueError(
                        f"sampled_token_ids: {req.request_id!r} samples a stop token before its "
                        "last step; step it singly"
                    )
        return k

    def _charge_decode(self, running: list[Request], num_steps: int) -> None:
        # One charge per token in step order, as update_from_output makes them: the float sums
        # match.
        charge, weight = self.sched.waiting.charge, self.sched.config.fair_output_weight
        for _ in range(num_steps):
            for req in running:
                charge(req.tenant, weight)
