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

from scheduler.admission import make_admission
from scheduler.block_manager import KVCacheManager
from scheduler.bulk_budget import BulkBudget
from scheduler.config import SchedulerConfig
from scheduler.kv_connector import KVConnector, KVTransfers
from scheduler.length_live import LivePredictor, make_live_predictor
from scheduler.length_prediction import LengthPredictor, RemainingLength, safe_observe
from scheduler.lora_slots import LoraSlots
from scheduler.outputs import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    RequestOutput,
    SchedulerOutput,
    SchedulerStats,
    TokenLogprobs,
)
from scheduler.predicted_load import PredictedLoad, predicted_load
from scheduler.preemption import VictimPolicy
from scheduler.queues import FairQueue, SRPTQueue, make_waiting_queue
from scheduler.request import Request, RequestStatus
from scheduler.stop import check_stop

logger = logging.getLogger(__name__)

# Finished requests stay readable through `Scheduler.requests` for a while, then are dropped.
FINISHED_RETENTION = 1024

_RUNNING = RequestStatus.RUNNING
_SWAPPED = RequestStatus.SWAPPED
_LOADING = RequestStatus.LOADING_KV
_NO_CAP = 1 << 62


def _to_prompt_end(req: Request, computed: int) -> int:
    """How far a chunk starting at `computed` may go: to the prompt's end when it starts inside the
    prompt and tokens already chosen follow (a disaggregated decode, a migrated or recomputed
    request), else no limit. The prompt is then computed as the fresh prefill that chose those
    tokens computed it, and a single chosen token after it runs as the decode row it ran as there.
    Kernels that round activations to int8 turn the small rounding differences between those
    layouts into different seeded text."""
    prompt = req.num_prompt_tokens
    return prompt - computed if computed < prompt < req.num_tokens else _NO_CAP


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
    """Decides, step by step, which tokens of which requests run and where their KV lives.

    A step is `schedule()`, the model runner's forward, then `update_from_output()`.

    Subclasses add to it without changing a step, as vLLM's AsyncScheduler does over its
    Scheduler; the simulator's multi-step decode (sim/jump.py) and async scheduling
    (scheduler/async_scheduler.py) are two. Their hooks are the class
    attributes `kv_manager_class` (the KVCacheManager the pool is built as) and
    `finished_retention` (how many finished requests stay readable in `requests`), `speculates`
    (speculative decoding, scheduler/spec_scheduler.py), and the protected helpers at the end of
    the class: `_num_spec_tokens`, `_tokens_in_flight`, `_append_tokens` (the stop
    rules), `_finish`, `_finish_early`, `_take_finished_ids` and `_output` (the one RequestOutput
    factory).
    """

    kv_manager_class: type[KVCacheManager] = KVCacheManager
    finished_retention = FINISHED_RETENTION
    speculates = False  # a decode may also run proposed tokens (scheduler/spec_scheduler.py)

    def __init__(self, config: SchedulerConfig) -> None:
        _, self.max_model_len = config.require_sizes()
        self.config = config
        self.kv = self.kv_manager_class(config)
        # A served replica's predictor (the hidden-state probe, persistence) when asked for one.
        live = make_live_predictor(config)
        self.waiting = make_waiting_queue(config.policy, config.srpt_aging_factor, live)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.victims = VictimPolicy(
            config.preemption_victim,
            by_priority=config.policy == "priority",
            remaining=self.waiting.predicted_remaining,
        )
        self.admission = make_admission(
            config.admission,
            self.waiting,
            self.kv.pool.num_blocks,
            config.block_size,
            self.max_model_len,
            config.foresight_estimate,
            live,
        )
        # The length model the router's predicted-tokens load reads (predicted_load): the queue's or
        # the admission's when they have one, else this one, which only learns.
        self.own_length_model: RemainingLength | None = None
        if self.length_model() is None:
            self.own_length_model = live if live is not None else LengthPredictor()
        self.num_preemptions = 0
        self._bulk = BulkBudget()  # the step's bulk tokens, reset by schedule()
        # (token, expert) rows per tensor-parallel rank, summed over steps (MoE models only; kept
        # out of SchedulerStats, which the router reads as scalars).
        self.expert_tokens_per_rank: list[int] = []
        self._finished_ids: set[str] = set()
        self._finished_order: OrderedDict[str, None] = OrderedDict()
        self._prefill_cap = config.long_prefill_token_threshold or _NO_CAP
        # LoRA adapters' device slots (scheduler/lora_slots.py); the engine sets max_loras.
        self.loras = LoraSlots(0)
        # The prefix cache's lower tiers (None: off): requests whose KV is on its way in, and
        # those whose load landed, running with their blocks reserved but not yet sent to the
        # runner (their first step sends the whole block table).
        self.connector: KVConnector | None = None
        self.loading: dict[str, Request] = {}
        self._landed: set[str] = set()
        if config.cpu_tier_blocks:
            self.connector = KVConnector(config.cpu_tier_blocks, config.disk_tier_blocks)
            self.kv.pool.on_evict = self.connector.on_evict

    def use_connector(self, connector: KVConnector) -> None:
        """Replace the KV connector before the first step (a subclass that also brings KV from
        another engine: scheduler/kv_remote.py); it takes over the tiers' eviction hook."""
        self.connector = connector
        if self.config.cpu_tier_blocks:
            self.kv.pool.on_evict = connector.on_evict

    # ---- requests in and out -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; raises ValueError for a duplicate id or a prompt that cannot fit."""
        rid = request.request_id
        old = self.requests.get(rid)
        if old is not None and not old.is_finished:
            raise ValueError(f"request_id: {rid!r} is already in flight")
        if request.num_tokens > self.max_model_len:
            raise ValueError(
                f"prompt_token_ids: {request.num_tokens} prompt (and resumed output) tokens "
                f"exceed max_model_len={self.max_model_len}"
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
            outputs.append(self._output(req, []))
        return outputs

    def _finish_early(self, req: Request, status: RequestStatus) -> None:
        if req.status == _RUNNING:
            self.running.remove(req)
            self._landed.discard(req.request_id)
        elif req.status == _LOADING:
            del self.loading[req.request_id]
            if self.connector is not None:
                self.connector.cancel(req.request_id)
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
            outputs.append(self._output(req, [], error=reason))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0 or bool(self.loading)

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
            num_gpu_blocks=kv.pool.num_blocks,
            loaded_loras=self.loras.loaded(),
            num_waiting_prompt_tokens=sum(
                r.num_tokens - r.num_computed_tokens for r in self.waiting
            ),
            **self._tier_stats(),
        )

    def length_model(self) -> RemainingLength | None:
        """The output-length predictor in use: the queue's (srpt, fair_srpt), the admission's
        (foresight), else the scheduler's own. Looked up each time: a study may swap them."""
        queue = self.waiting
        if isinstance(queue, SRPTQueue):
            return queue.predictor
        if isinstance(queue, FairQueue) and queue._srpt is not None:
            return queue._srpt.predictor
        if self.admission is not None:
            return self.admission.predictor
        return self.own_length_model

    def predicted_load(self) -> PredictedLoad:
        """Predicted remaining output tokens of the waiting and running requests (what a replica
        reports for the router's predicted_tokens load signal)."""
        return predicted_load([*self.waiting, *self.running], self.length_model())

    def _tier_stats(self) -> dict[str, int]:
        connector = self.connector
        if connector is None:
            return {}
        disk, counts = connector.disk, connector.stats
        return dict(
            num_cpu_tier_blocks=len(connector.cpu),
            num_disk_tier_blocks=len(disk) if disk is not None else 0,
            num_tier_saved_blocks=counts.num_saved_blocks,
            num_tier_loaded_blocks=counts.num_loaded_blocks,
            num_tier_failed_loads=counts.num_failed_loads,
        )

    # ---- schedule ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens: running requests first, then waiting ones, within the budget."""
        step = _Step(budget=self.config.max_num_batched_tokens)
        self._bulk = BulkBudget.for_step(self.running, step.budget)  # scheduler/bulk_budget.py
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
            pending = req.num_output_placeholders  # tokens still being sampled (async scheduling)
            gap = len(req.all_token_ids) + pending - computed
            if gap == 1 and self.speculates:  # a decode: it may verify proposed tokens too
                gap += self._num_spec_tokens(req)
            n = min(gap, cap, step.budget, _to_prompt_end(req, computed))
            n = min(n, self._bulk.cap(req, computed))
            if n <= 0 or (pending and self._finishes_on_pending(req)):
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
            if self._landed and req.request_id in self._landed:
                new_blocks = self._send_landed(req, step)
            else:
                step.cached_reqs.append(req)
            step.take(req, n, new_blocks)
            self._bulk.charge(req, computed, n)
            if charge is not None:
                self._charge_input(req, computed, n)

    def _schedule_waiting(self, step: _Step) -> None:
        cfg = self.config
        while (
            len(self.waiting)
            and step.budget > 0
            and len(self.running) + len(self.loading) < cfg.max_num_seqs
        ):
            req = self.waiting.peek()
            if req.request_id in step.preempted:  # never re-admit a victim in the step that took it
                break
            if self._bulk.cap(req, req.num_computed_tokens) <= 0:  # the step's bulk share is spent
                break
            lora = req.spec.lora_name
            if lora is not None and not self.loras.acquire(lora):
                break  # every slot's adapter is in use: it waits until one is released
            # With nothing running the watermark could only starve the head request.
            reserve = cfg.num_watermark_blocks if self.running else 0
            admit = self._resume_swapped if req.status == _SWAPPED else self._admit
            if admit(req, step, reserve):
                continue
            self.loras.release(lora)
            if cfg.policy == "priority" and self._displace_for(req, step, reserve):
                continue
            break

    def _finishes_on_pending(self, req: Request) -> bool:
        """Whether the tokens being sampled for req take it to max_tokens or max_model_len: no
        step needs to be scheduled for it after them."""
        pending = req.num_output_placeholders
        return (
            len(req.output_token_ids) + pending >= req.sampling_params.max_tokens
            or len(req.all_token_ids) + pending >= self.max_model_len
        )

    def _admit(self, req: Request, step: _Step, reserve: int) -> bool:
        """Admit a WAITING or PREEMPTED request, reusing its longest cached prefix."""
        kv = self.kv
        cached = kv.find_cached_blocks(req)
        if self.connector is not None and kv.reuses_prefix(req):
            end = (req.num_tokens - 1) // kv.block_size  # find_cached_blocks hashed this far
            num_load = self.connector.lookup(req.block_hashes[len(cached) : end])
            if num_load:
                return self._start_loading(req, cached, num_load, reserve)
        num_hit = len(cached) * kv.block_size
        n = min(
            req.num_tokens - num_hit, self._prefill_cap, step.budget, _to_prompt_end(req, num_hit)
        )
        n = min(n, self._bulk.cap(req, num_hit))
        # Anti-thrash: admit only when the whole sequence so far fits, not just this chunk.
        if not kv.can_admit(req, cached, reserve):
            return False
        if self.admission is not None and not self.admission.fits(req, self.running, reserve):
            return False
        new_blocks = kv.allocate_slots(req, n, cached)
        if new_blocks is None:
            return False
        self.waiting.pop()
        if req.num_cached_tokens is None:  # first admission: count its prefix-cache lookup
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

    def _start_loading(self, req: Request, cached: list[int], num_load: int, reserve: int) -> bool:
        """Reserve blocks for the request's whole sequence and load num_load blocks after its
        device hit from the lower tiers; it waits in LOADING_KV until the step is back."""
        kv, connector = self.kv, self.connector
        assert connector is not None
        if not kv.can_admit(req, cached, reserve):
            return False
        blocks = kv.allocate_slots(req, req.num_tokens - len(cached) * kv.block_size, cached)
        if blocks is None:
            return False
        self.waiting.pop()
        first = len(cached)
        hashes = req.block_hashes[first : first + num_load]
        connector.load(req.request_id, first, hashes, blocks[first : first + num_load])
        req.status = _LOADING
        self.loading[req.request_id] = req
        return True

    def _land_loads(self, transfers: KVTransfers, failed_blocks: list[int]) -> None:
        """The step that carried these loads ran: their requests are admitted (running, last)
        with their loaded blocks computed and findable by others; from the first block that
        failed its check on, they are recomputed. A running request can be preempted, so blocks
        reserved this way can always be taken back."""
        connector = self.connector
        assert connector is not None
        failed = set(failed_blocks)
        for rid in transfers.loading_req_ids:
            req = self.loading.pop(rid, None)
            plan = connector.land(rid, failed)
            if req is None or plan is None:  # aborted while loading
                continue
            num_hit = (plan.first + len(plan.blocks)) * self.kv.block_size
            self.kv.register_computed_blocks(req, num_hit)
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens is None:  # first admission: count its prefix-cache lookup
                req.num_cached_tokens = num_hit
                self.kv.record_lookup(req.num_tokens, num_hit)
            req.status = _RUNNING
            self.running.append(req)
            self._landed.add(rid)

    def _send_landed(self, req: Request, step: _Step) -> list[int]:
        """A landed request's first step: sent in full (or resumed), with its whole table."""
        self._landed.discard(req.request_id)
        if req.known_to_runner:
            step.cached_reqs.append(req)
            step.resumed.add(req.request_id)
        else:
            step.new_reqs.append(req)
        return list(self.kv.blocks_of(req.request_id))

    def _resume_swapped(self, req: Request, step: _Step, reserve: int) -> bool:
        """Bring a SWAPPED request back from the CPU pool with its progress intact."""
        computed = req.num_computed_tokens
        n = min(
            req.num_tokens - computed, self._prefill_cap, step.budget, _to_prompt_end(req, computed)
        )
        n = min(n, self._bulk.cap(req, computed))
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
        self._bulk.charge(req, start, n)
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
        self.loras.release(victim.spec.lora_name)
        cfg = self.config
        self._landed.discard(rid)
        # A request the runner has never seen (its KV landed from a lower tier this step or the
        # last) could not be resumed from a swap: it is recomputed.
        swap = victim.known_to_runner and (
            cfg.preemption_mode == "swap"
            or (
                cfg.preemption_mode == "auto"
                and victim.num_computed_tokens >= cfg.swap_min_computed_tokens
            )
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
                    req.eos_token_ids,
                    req.spec.lora_name,
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
        finished = self._take_finished_ids()
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - step.budget,
            preempted_req_ids=step.preempted,
            finished_req_ids=finished,
            blocks_to_swap_out=step.swap_out,
            blocks_to_swap_in=step.swap_in,
            lora_loads=self.loras.take_loads(),
            kv_transfers=self.connector.take_transfers() if self.connector is not None else None,
        )

    # ---- results -------------------------------------------------------------------------------
    def _count_expert_tokens(self, rows: list[int]) -> None:
        totals = self.expert_tokens_per_rank
        if len(totals) != len(rows):
            totals[:] = [0] * len(rows)
        for rank, n in enumerate(rows):
            totals[rank] += n

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Append sampled tokens under the stop rules, free finished requests' blocks."""
        kv = self.kv
        prefix_caching = self.config.enable_prefix_caching
        registered, bs = kv.num_registered_blocks, kv.block_size
        charge = self.waiting.charge if self.waiting.charges_tokens else None
        logprobs = runner_output.logprobs
        outputs = self._fail(runner_output.failed) if runner_output.failed else []
        if scheduler_output.kv_transfers is not None and self.connector is not None:
            self._land_loads(scheduler_output.kv_transfers, runner_output.kv_load_failed)
        if runner_output.expert_tokens_per_rank:
            self._count_expert_tokens(runner_output.expert_tokens_per_rank)
        if runner_output.length_features:
            self._take_length_features(runner_output.length_features)
        any_finished = False
        ahead = self._tokens_in_flight()
        for i, (rid, sampled) in enumerate(
            zip(runner_output.req_ids, runner_output.sampled_token_ids)
        ):
            req = self.requests.get(rid)
            if req is None or req.status is not _RUNNING:  # aborted while the step ran
                continue
            # Hash and register only when a block has just filled up (one step in block_size).
            written = (
                req.num_computed_tokens - ahead.get(rid, 0) if ahead else req.num_computed_tokens
            )
            if prefix_caching and written // bs > registered.get(rid, 0):
                kv.register_computed_blocks(req, written)
            if not sampled:
                continue
            kept, status = self._append_tokens(req, sampled)
            if charge is not None:
                charge(req.tenant, self.config.fair_output_weight * kept)
            if status is not None:
                any_finished = True
                self._finish(req, status)
            lp = logprobs[i] if logprobs is not None else None
            out = self._output(req, sampled[:kept], lp[:kept] if lp is not None else None)
            if runner_output.prompt_logprobs:
                out.prompt_logprobs = runner_output.prompt_logprobs.get(rid)
            outputs.append(out)
        if any_finished:
            self.running = [r for r in self.running if r.status is _RUNNING]
        return outputs

    def _take_length_features(self, features: dict[str, list[float]]) -> None:
        """Prompts' hidden-state features, kept on their requests for the length probe (before
        their tokens are appended: a request that finishes at once learns from its feature)."""
        model = self.length_model()
        if not isinstance(model, LivePredictor):  # a study swapped in another model
            return
        for rid, vector in features.items():
            req = self.requests.get(rid)
            if req is not None:
                model.take_feature(req, vector)

    # ---- helpers for subclasses (the simulator's multi-step decode, sim/jump.py) ----------------
    def _num_spec_tokens(self, req: Request) -> int:
        """Proposed tokens req's decode verifies this step, when `speculates` (none here)."""
        return 0

    def _tokens_in_flight(self) -> dict[str, int]:
        """Tokens per request scheduled in steps later than the one being updated, whose KV is not
        written yet: none here, where each step is updated before the next is scheduled
        (scheduler.async_scheduler.AsyncScheduler schedules one ahead)."""
        return {}

    def _append_tokens(self, req: Request, sampled: list[int]) -> tuple[int, RequestStatus | None]:
        """Append sampled tokens up to the first that stops the request (check_stop).

        Returns how many were kept and the request's final status, None while it goes on; the
        caller finishes it.
        """
        out, all_ids = req.output_token_ids, req.all_token_ids
        for i, token in enumerate(sampled, 1):
            out.append(token)
            all_ids.append(token)
            status = check_stop(req, self.max_model_len)
            if status is not None:
                return i, status
        return len(sampled), None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        """Give the request its final status and its blocks back; the next step tells the runner."""
        if req.status is _RUNNING:
            self.loras.release(req.spec.lora_name)
        req.status = status
        self.kv.free(req)
        if self.connector is not None:
            self.connector.release(req.request_id)
        self.waiting.learn(req)  # the srpt policy's length predictor learns from it
        if self.admission is not None:
            self.admission.learn(req)
        if self.own_length_model is not None:
            safe_observe(self.own_length_model, req)
        rid = req.request_id
        self._finished_ids.add(rid)
        self._finished_order[rid] = None
        if len(self._finished_order) > self.finished_retention:
            old, _ = self._finished_order.popitem(last=False)
            if self.requests.get(old) is not None and self.requests[old].is_finished:
                del self.requests[old]

    def _take_finished_ids(self) -> set[str]:
        """The requests finished since the last step, which the next step tells the runner to
        free."""
        finished, self._finished_ids = self._finished_ids, set()
        return finished

    @staticmethod
    def _output(
        req: Request,
        new_token_ids: list[int],
        new_logprobs: list[TokenLogprobs] | None = None,
        error: str | None = None,
    ) -> RequestOutput:
        """The one place a RequestOutput is built: what req produced this step and where it
        stands."""
        return RequestOutput(
            req.request_id,
            new_token_ids,
            req.is_finished,
            req.status.finish_reason,
            req.num_prompt_tokens,
            len(req.output_token_ids),
            req.num_cached_tokens or 0,  # None: never admitted (aborted or failed while waiting)
            new_logprobs,
            error,
        )
