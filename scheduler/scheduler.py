"""The continuous-batching scheduler: one token budget per step, no prefill or decode phase.

Each request has `num_computed_tokens` and a token count to reach (prompt + outputs). A step spends
`max_num_batched_tokens` on running requests first, then on waiting ones; chunked prefill falls out
of `min(gap, budget)`. KV blocks are found for every scheduled token before the step is emitted,
preempting running requests (recompute or swap) when the pool runs dry.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from scheduler.block_manager import KVCacheManager
from scheduler.config import SchedulerConfig
from scheduler.outputs import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    RequestOutput,
    SchedulerOutput,
    SchedulerStats,
)
from scheduler.preemption import VictimPolicy
from scheduler.queues import make_waiting_queue
from scheduler.request import Request, RequestStatus

logger = logging.getLogger(__name__)

# Finished requests stay readable through `Scheduler.requests` for a while, then are dropped.
FINISHED_RETENTION = 1024

_RUNNING = RequestStatus.RUNNING
_SWAPPED = RequestStatus.SWAPPED
_NO_CAP = 1 << 62


@dataclass(slots=True)
class _Step:
    """What one `schedule()` call has decided so far."""

    budget: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    start: dict[str, int] = field(default_factory=dict)  # num_computed_tokens before the step
    new_blocks: dict[str, list[int]] = field(default_factory=dict)
    new_reqs: list[Request] = field(default_factory=list)
    cached_reqs: list[Request] = field(default_factory=list)
    resumed: set[str] = field(default_factory=set)
    admitted: set[str] = field(default_factory=set)
    preempted: set[str] = field(default_factory=set)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    running_pass_preempted: bool = False

    def take(self, req: Request, n: int, new_blocks: list[int]) -> int:
        """Schedule the next n tokens of req; returns where the chunk starts."""
        rid = req.request_id
        start = req.num_computed_tokens
        self.num_scheduled[rid] = n
        self.start[rid] = start
        self.new_blocks[rid] = new_blocks
        self.budget -= n
        req.num_computed_tokens = start + n
        return start


class Scheduler:
    """Decides, step by step, which tokens of which requests run and where their KV lives."""

    def __init__(self, config: SchedulerConfig) -> None:
        config.require_sizes()
        self.config = config
        self.kv = KVCacheManager(config)
        self.waiting = make_waiting_queue(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.victims = VictimPolicy(
            config.preemption_victim, by_priority=config.policy == "priority"
        )
        self.num_preemptions = 0
        self._finished_ids: set[str] = set()
        self._finished_order: OrderedDict[str, None] = OrderedDict()
        self.finished_retention = (
            FINISHED_RETENTION  # a simulator of millions of requests keeps fewer
        )
        self._prefill_cap = config.long_prefill_token_threshold or _NO_CAP

    # ---- requests in and out -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; raises ValueError for a duplicate id or a prompt that cannot fit."""
        rid = request.request_id
        old = self.requests.get(rid)
        if old is not None and not old.is_finished:
            raise ValueError(f"request_id: {rid!r} is already in flight")
        if request.num_tokens > self.config.max_model_len:
            raise ValueError(
                f"prompt_token_ids: {request.num_tokens} prompt (and resumed output) tokens "
                f"exceed max_model_len={self.config.max_model_len}"
            )
        if request.status != RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request_id: {rid!r} was already scheduled once; build a new Request")
        self._finished_order.pop(rid, None)
        self.requests[rid] = request
        self.waiting.add(request)

    def abort_requests(self, request_ids: list[str] | set[str]) -> list[RequestOutput]:
        """Finish the given live requests at once, freeing their blocks; unknown ids are ignored."""
        outputs = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            self._finish_early(req, RequestStatus.FINISHED_ABORTED)
            outputs.append(self._output(req, [], None))
        return outputs

    def _finish_early(self, req: Request, status: RequestStatus) -> None:
        if req.status == _RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._finish(req, status)

    def _fail(self, failed: dict[str, str]) -> list[RequestOutput]:
        """Finish requests whose own inputs failed in the step; their blocks go back to the pool."""
        outputs = []
        for rid, reason in failed.items():
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            self._finish_early(req, RequestStatus.FINISHED_ERROR)
            output = self._output(req, [], None)
            output.error = reason
            outputs.append(output)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def stats(self) -> SchedulerStats:
        """Queue lengths and KV-cache figures now."""
        kv = self.kv
        return SchedulerStats(
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            num_swapped=len(kv.req_cpu_blocks),  # exactly the requests swapped out to the CPU pool
            kv_cache_usage=kv.usage,
            prefix_cache_hit_rate=kv.prefix_cache_hit_rate,
            num_preemptions=self.num_preemptions,
            num_free_blocks=kv.num_free_blocks,
            num_prompt_tokens_queried=kv.num_queried_tokens,
            num_prompt_tokens_hit=kv.num_hit_tokens,
        )

    # ---- schedule ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens: running requests first, then waiting ones, within the budget."""
        step = _Step(budget=self.config.max_num_batched_tokens)
        self._schedule_running(step)
        # Anti-thrash: a step that had to preempt admits nothing new (as vLLM does).
        if not step.running_pass_preempted:
            self._schedule_waiting(step)
        out = self._build_output(step)
        self.kv.end_step()
        return out

    def _schedule_running(self, step: _Step) -> None:
        kv = self.kv
        cap = self._prefill_cap
        charge = self.waiting.charge if self.waiting.charges_tokens else None
        for req in list(self.running):
            if step.budget <= 0:
                break
            if req.status is not _RUNNING:  # preempted earlier in this pass
                continue
            computed = req.num_computed_tokens
            n = min(len(req.all_token_ids) - computed, cap, step.budget)
            if n <= 0:
                continue
            new_blocks = kv.allocate_slots(req, n)
            while new_blocks is None:
                victim = self.victims.choose(self.running)
                self._preempt(victim, step)
                step.running_pass_preempted = True
                if victim is req:
                    break
                new_blocks = kv.allocate_slots(req, n)
            if new_blocks is None:
                continue
            step.cached_reqs.append(req)
            step.take(req, n, new_blocks)
            if charge is not None:
                self._charge_input(req, computed, n)

    def _schedule_waiting(self, step: _Step) -> None:
        cfg = self.config
        while len(self.waiting) and step.budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting.peek()
            if req.request_id in step.preempted:  # never re-admit a victim in the step that took it
                break
            # With nothing running the watermark could only starve the head request.
            reserve = cfg.num_watermark_blocks if self.running else 0
            admit = self._resume_swapped if req.status == _SWAPPED else self._admit
            if admit(req, step, reserve):
                continue
            if cfg.policy == "priority" and self._displace_for(req, step, reserve):
                continue
            break

    def _admit(self, req: Request, step: _Step, reserve: int) -> bool:
        """Admit a WAITING or PREEMPTED request, reusing its longest cached prefix."""
        kv = self.kv
        cached = kv.find_cached_blocks(req)
        num_hit = len(cached) * kv.block_size
        n = min(req.num_tokens - num_hit, self._prefill_cap, step.budget)
        # Anti-thrash: admit only when the whole sequence so far fits, not just this chunk.
        if not kv.can_admit(req, cached, reserve):
            return False
        new_blocks = kv.allocate_slots(req, n, cached)
        if new_blocks is None:
            return False
        self.waiting.pop()
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit
            kv.record_lookup(req.num_tokens, num_hit)
        req.num_computed_tokens = num_hit
        if req.known_to_runner:
            step.cached_reqs.append(req)
            step.resumed.add(req.request_id)
        else:
            step.new_reqs.append(req)
        self._start_running(req, step, n, new_blocks)
        return True

    def _resume_swapped(self, req: Request, step: _Step, reserve: int) -> bool:
        """Bring a SWAPPED request back from the CPU pool with its progress intact."""
        n = min(req.num_tokens - req.num_computed_tokens, self._prefill_cap, step.budget)
        if not self.kv.can_swap_in(req, n, reserve):
            return False
        self.waiting.pop()
        blocks, copies = self.kv.swap_in(req, n)
        step.swap_in.extend(copies)
        step.cached_reqs.append(req)
        step.resumed.add(req.request_id)
        self._start_running(req, step, n, blocks)
        return True

    def _start_running(self, req: Request, step: _Step, n: int, new_blocks: list[int]) -> None:
        req.status = _RUNNING
        self.running.append(req)
        step.admitted.add(req.request_id)
        start = step.take(req, n, new_blocks)
        if self.waiting.charges_tokens:
            self._charge_input(req, start, n)

    def _displace_for(self, req: Request, step: _Step, reserve: int) -> bool:
        """Priority policy: preempt a less urgent running request so a more urgent one fits."""
        candidates = [
            r
            for r in self.running
            if r.priority > req.priority and r.request_id not in step.admitted
        ]
        if not candidates:
            return False
        # Only displace when freeing every candidate could make room at all.
        kv = self.kv
        needed = kv.num_blocks_needed(req.num_tokens)
        reclaimable = kv.num_reclaimable_blocks([r.request_id for r in candidates])
        if needed > kv.num_free_blocks + reclaimable - reserve:
            return False
        self._preempt(self.victims.choose(candidates), step)
        return True

    def _preempt(self, victim: Request, step: _Step) -> None:
        rid = victim.request_id
        n = step.num_scheduled.pop(rid, None)
        if n is not None:  # scheduled earlier in this step: take it back out
            victim.num_computed_tokens = step.start.pop(rid)
            step.new_blocks.pop(rid)
            step.budget += n
        self.running.remove(victim)
        cfg = self.config
        swap = cfg.preemption_mode == "swap" or (
            cfg.preemption_mode == "auto"
            and victim.num_computed_tokens >= cfg.swap_min_computed_tokens
        )
        if swap and self.kv.can_swap_out(victim):
            step.swap_out.extend(self.kv.swap_out(victim))
            victim.status = RequestStatus.SWAPPED
        else:  # recompute (also the fallback when the CPU pool is full)
            self.kv.free(victim)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        step.preempted.add(rid)
        self.waiting.prepend(victim)
        logger.debug("preempted %s (%s)", rid, victim.status.name)

    def _charge_input(self, req: Request, start: int, n: int) -> None:
        # A plain decode token is charged as output when it is sampled; everything else is input.
        if n > 1 or start < req.num_tokens - 1:
            self.waiting.charge(req.tenant, self.config.fair_input_weight * n)

    def _build_output(self, step: _Step) -> SchedulerOutput:
        num_scheduled = step.num_scheduled
        new_reqs = []
        for req in step.new_reqs:
            rid = req.request_id
            if rid not in num_scheduled:
                continue
            new_reqs.append(
                NewRequestData(
                    rid,
                    req.prompt_token_ids,
                    req.sampling_params,
                    step.new_blocks[rid],
                    step.start[rid],
                    list(req.output_token_ids),
                )
            )
            req.known_to_runner = True
            req.num_synced_tokens = req.num_tokens
        cached = CachedRequestData()
        ids, resumed, new_tokens = cached.req_ids, cached.resumed, cached.new_token_ids
        new_blocks, computed = cached.new_block_ids, cached.num_computed_tokens
        step_resumed, step_blocks, step_start = step.resumed, step.new_blocks, step.start
        for req in step.cached_reqs:
            rid = req.request_id
            if rid not in num_scheduled:
                continue
            ids.append(rid)
            resumed.append(rid in step_resumed)
            tokens = req.all_token_ids
            synced = req.num_synced_tokens
            new_tokens.append(tokens[synced:])
            req.num_synced_tokens = len(tokens)
            new_blocks.append(step_blocks[rid])
            computed.append(step_start[rid])
        finished, self._finished_ids = self._finished_ids, set()
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - step.budget,
            preempted_req_ids=step.preempted,
            finished_req_ids=finished,
            blocks_to_swap_out=step.swap_out,
            blocks_to_swap_in=step.swap_in,
        )

    # ---- results -------------------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Append sampled tokens, apply stop conditions, free finished requests' blocks."""
        requests = self.requests
        kv = self.kv
        prefix_caching = self.config.enable_prefix_caching
        registered, bs = kv.num_registered_blocks, kv.block_size
        max_len = self.config.max_model_len
        charge = self.waiting.charge if self.waiting.charges_tokens else None
        logprobs = runner_output.logprobs
        outputs = self._fail(runner_output.failed) if runner_output.failed else []
        any_finished = False
        for i, (rid, sampled) in enumerate(
            zip(runner_output.req_ids, runner_output.sampled_token_ids)
        ):
            req = requests.get(rid)
            if req is None or req.status is not _RUNNING:  # aborted while the step ran
                continue
            # Hash and register only when a block has just filled up (one step in block_size).
            if prefix_caching and req.num_computed_tokens // bs > registered.get(rid, 0):
                kv.register_computed_blocks(req)
            if not sampled:
                continue
            accepted, status = self._append_tokens(req, sampled, max_len)
            if charge is not None:
                charge(req.tenant, self.config.fair_output_weight * accepted)
            new_lp = (
                logprobs[i][:accepted] if logprobs is not None and logprobs[i] is not None else None
            )
            new_ids = sampled if accepted == len(sampled) else sampled[:accepted]
            if status is None:
                outputs.append(
                    RequestOutput(
                        rid,
                        new_ids,
                        False,
                        None,
                        len(req.prompt_token_ids),
                        len(req.output_token_ids),
                        req.num_cached_tokens,
                        new_lp,
                    )
                )
                continue
            any_finished = True
            self._finish(req, status)
            outputs.append(self._output(req, new_ids, new_lp))
        if any_finished:
            self.running = [r for r in self.running if r.status is _RUNNING]
        return outputs

    # ---- multi-step decode (a simulator's k-step jump)
    # ---------------------------------------------
    def max_decode_jump(self, limit: int) -> int:
        """How many of the next steps (at most limit) are certain to be the same pure-decode step.

        That holds while nothing waits, every running request has just its last sampled token to
        compute, the whole batch fits the token budget, no request reaches max_tokens or
        max_model_len before the last of them, and the free pool covers every block the batch
        crosses (so nothing is preempted). A stop token before the last step is the caller's to
        rule out.
        """
        running = self.running
        cfg = self.config
        if not running or len(self.waiting) or len(running) > cfg.max_num_batched_tokens:
            return 0
        k = limit
        for req in running:
            n = len(req.all_token_ids)
            if n - req.num_computed_tokens != 1:
                return 0
            # The step that reaches a cap finishes the request: it may be the last one.
            k = min(
                k, req.sampling_params.max_tokens - len(req.output_token_ids), cfg.max_model_len - n
            )
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
        running = self.running
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
            sp = req.sampling_params
            tokens = sampled_token_ids[req.request_id]
            head = heads.get(id(tokens))
            if head is None:
                head = heads[id(tokens)] = frozenset(tokens[:-1])
            if not head.isdisjoint(sp.stop_token_ids or ()) or (
                not sp.ignore_eos and not head.isdisjoint(req.eos_token_ids)
            ):
                raise ValueError(
                    f"sampled_token_ids: {req.request_id!r} samples a stop token before its last "
                    "step; step it singly"
                )
        max_len = self.config.max_model_len
        finishing: list[tuple[Request, RequestStatus]] = []
        outputs: list[RequestOutput] = []
        for req in running:
            sp = req.sampling_params
            tokens = sampled_token_ids[req.request_id]
            out, all_ids = req.output_token_ids, req.all_token_ids
            last = tokens[-1]
            if (
                last in req.eos_token_ids
                or last in (sp.stop_token_ids or ())
                or len(out) + k >= sp.max_tokens
                or len(all_ids) + k >= max_len
            ):
                # The last step may finish the request: its token goes through the single step's
                # checks.
                out.extend(tokens[:-1])
                all_ids.extend(tokens[:-1])
                _, status = self._append_tokens(req, tokens[-1:], max_len)
            else:
                out.extend(tokens)
                all_ids.extend(tokens)
                status = None
            req.num_synced_tokens = len(all_ids) - 1  # the last step's token is not sent yet
            if status is None:
                outputs.append(
                    RequestOutput(
                        req.request_id,
                        tokens,
                        False,
                        None,
                        len(req.prompt_token_ids),
                        len(out),
                        req.num_cached_tokens,
                    )
                )
            else:
                finishing.append((req, status))
                outputs.append(
                    RequestOutput(
                        req.request_id,
                        tokens,
                        True,
                        status.finish_reason,
                        len(req.prompt_token_ids),
                        len(out),
                        max(req.num_cached_tokens, 0),
                    )
                )
        self._finished_ids = set()
        self.kv.advance_decode(running, k)
        self.kv.end_step()
        if self.waiting.charges_tokens:
            self._charge_decode(running, k)
        # Freeing commutes with the last step's registrations (neither touches what the other
        # reads), so the finishes come after them, in batch order as update_from_output makes them.
        for req, status in finishing:
            self._finish(req, status)
        if finishing:
            self.running = [r for r in running if r.status is _RUNNING]
        return outputs

    def _charge_decode(self, running: list[Request], num_steps: int) -> None:
        # One charge per token in step order, as update_from_output makes them: the float sums
        # match.
        charge, weight = self.waiting.charge, self.config.fair_output_weight
        for _ in range(num_steps):
            for req in running:
                charge(req.tenant, weight)

    @staticmethod
    def _append_tokens(
        req: Request, sampled: list[int], max_len: int
    ) -> tuple[int, RequestStatus | None]:
        """Append sampled tokens up to the first stop; returns (how many were kept, final
        status)."""
        sp = req.sampling_params
        eos = () if sp.ignore_eos else req.eos_token_ids
        stop_ids = sp.stop_token_ids
        out, all_ids = req.output_token_ids, req.all_token_ids
        for i, token in enumerate(sampled, 1):
            out.append(token)
            all_ids.append(token)
            if token in eos or (stop_ids and token in stop_ids):
                return i, RequestStatus.FINISHED_STOPPED
            if len(out) >= sp.max_tokens or len(all_ids) >= max_len:
                return i, RequestStatus.FINISHED_LENGTH_CAPPED
        return len(sampled), None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.kv.free(req)
        rid = req.request_id
        self._finished_ids.add(rid)
        self._finished_order[rid] = None
        if len(self._finished_order) > self.finished_retention:
            old, _ = self._finished_order.popitem(last=False)
            if self.requests.get(old) is not None and self.requests[old].is_finished:
                del self.requests[old]

    @staticmethod
    def _output(req: Request, new_token_ids: list[int], new_logprobs: list | None) -> RequestOutput:
        return RequestOutput(
            req.request_id,
            new_token_ids,
            req.is_finished,
            req.status.finish_reason,
            req.num_prompt_tokens,
            len(req.output_token_ids),
            max(req.num_cached_tokens, 0),
            new_logprobs,
        )
