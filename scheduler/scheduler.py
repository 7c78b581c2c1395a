"""The continuous-batching scheduler: one token budget per step, no prefill or decode phase.

Each request has `num_computed_tokens` and a token count to reach (prompt + outputs). A step spends
`max_num_batched_tokens` on running requests first, then on waiting ones; chunked prefill falls out
of `min(gap, budget)`. KV blocks are found for every scheduled token before the step is emitted,
preempting running requests (recompute or swap) when the pool runs dry.

Capabilities that change a step (speculation, async overlap, the simulator's decode jump) are step
features (scheduler/features.py): one Scheduler calls their hooks, built once from config.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from itertools import repeat

from scheduler.admit import admit_waiting, resume_swapped, send_landed
from scheduler.block_manager import KVCacheManager
from scheduler.bulk_budget import BulkBudget
from scheduler.config import SchedulerConfig
from scheduler.features import NO_LIMITS, StepFeature, StepHooks, step_limits
from scheduler.finished import FinishedLog, append_tokens
from scheduler.kv_connector import KVConnector
from scheduler.kv_loading import land_loads
from scheduler.length_prediction import RemainingLength, safe_observe
from scheduler.lora_slots import LoraSlots
from scheduler.multimodal import check_spans_fit, fit_images
from scheduler.outputs import (
    ModelRunnerOutput,
    RequestOutput,
    SchedulerOutput,
    SchedulerStats,
    request_output,
)
from scheduler.policies import length_model_of, make_policies
from scheduler.predicted_load import PredictedLoad, predicted_load
from scheduler.preempt import allocate_or_preempt, displace_for
from scheduler.request import Request, RequestStatus
from scheduler.scheduler_stats import (
    collect_stats,
    count_expert_tokens,
    take_length_features,
)
from scheduler.state_slots import StateSlots
from scheduler.step import NO_CAP, Step, finishes_on_pending, to_prompt_end

logger = logging.getLogger(__name__)

# Finished requests stay readable through `Scheduler.requests` for a while, then are dropped.
FINISHED_RETENTION = 1024

_RUNNING = RequestStatus.RUNNING
_SWAPPED = RequestStatus.SWAPPED
_LOADING = RequestStatus.LOADING_KV


class Scheduler:
    """Decides, step by step, which tokens of which requests run and where their KV lives.

    A step is `schedule()`, the model runner's forward, then `update_from_output()`. `features`
    (scheduler/features.py) are called at fixed points of it; `kv_manager_class` is the
    KVCacheManager the pool is built as and `finished_retention` how many finished requests stay
    readable in `requests` (the simulator changes both).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        features: Sequence[StepFeature] = (),
        *,
        kv_manager_class: type[KVCacheManager] = KVCacheManager,
        finished_retention: int = FINISHED_RETENTION,
    ) -> None:
        _, self.max_model_len = config.require_sizes()
        self.config = config
        self.kv = kv_manager_class(config)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        policies = make_policies(config, self.kv.pool.num_blocks, self.max_model_len)
        self.waiting, self.victims = policies.waiting, policies.victims
        self.admission, self.own_length_model = policies.admission, policies.own_length_model
        self.num_preemptions = 0
        self.bulk = BulkBudget()  # the step's bulk tokens, reset by schedule()
        self.limits = NO_LIMITS  # what the features keep out of the step, set by schedule()
        # (token, expert) rows per tensor-parallel rank over all steps (MoE models; not a stat).
        self.expert_tokens_per_rank: list[int] = []
        self.finished = FinishedLog(self.requests, finished_retention)
        self.prefill_cap = config.long_prefill_token_threshold or NO_CAP
        # Image tokens one step may encode (scheduler/multimodal.py).
        self.encoder_budget = config.max_num_encoder_tokens or config.max_num_batched_tokens
        # LoRA adapters' device slots (scheduler/lora_slots.py); the engine sets max_loras.
        self.loras = LoraSlots(0)
        # Recurrent-state slots of a hybrid model (scheduler/state_slots.py); the engine sizes them.
        self.state_slots = StateSlots(0)
        # The prefix cache's lower tiers (None: off): requests whose KV is on its way in, and
        # those whose load landed, running with their blocks reserved but not yet sent to the
        # runner (their first step sends the whole block table).
        self.connector: KVConnector | None = None
        self.loading: dict[str, Request] = {}
        self.landed: set[str] = set()
        if config.cpu_tier_blocks:
            self.connector = KVConnector(config.cpu_tier_blocks, config.disk_tier_blocks)
            self.kv.pool.on_evict = self.connector.on_evict
        self.features = list(features)
        for feature in self.features:
            feature.bind(self)
        self.hooks = StepHooks.of(self.features)

    def use_connector(self, connector: KVConnector) -> None:
        """Replace the KV connector before the first step (one that also brings KV from another
        engine: scheduler/kv_remote.py); it takes over the tiers' eviction hook."""
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
        if request.image_spans:  # an image is scheduled whole: one that no step holds never runs
            limit, why = min(
                (self.encoder_budget, "max_num_encoder_tokens"),
                (self.config.max_num_batched_tokens, "max_num_batched_tokens"),
                (self.prefill_cap, "long_prefill_token_threshold"),
            )
            check_spans_fit(request.image_spans, limit, why)
        if request.status != RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request_id: {rid!r} was already scheduled once; build a new Request")
        self.finished.forget(rid)
        self.requests[rid] = request
        self.waiting.add(request)

    def abort_requests(self, request_ids: list[str] | set[str]) -> list[RequestOutput]:
        """Finish the given live requests at once, freeing their blocks; unknown ids are ignored."""
        return self._finish_all({rid: None for rid in request_ids}, RequestStatus.FINISHED_ABORTED)

    def _finish_all(
        self, reasons: dict[str, str | None], status: RequestStatus
    ) -> list[RequestOutput]:
        outputs = []
        for rid, reason in reasons.items():
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            self.finish_early(req, status)
            outputs.append(request_output(req, [], error=reason))
        return outputs

    def finish_early(self, req: Request, status: RequestStatus) -> None:
        """Finish req wherever it is (running, loading or waiting)."""
        if req.status == _RUNNING:
            self.running.remove(req)
            self.landed.discard(req.request_id)
        elif req.status == _LOADING:
            del self.loading[req.request_id]
            if self.connector is not None:
                self.connector.cancel(req.request_id)
        else:
            self.waiting.remove(req)
        self.finish(req, status)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0 or bool(self.loading)

    def stats(self) -> SchedulerStats:
        """Queue lengths and KV-cache figures now."""
        extra: dict[str, int] = {}
        for hook in self.hooks.stats:
            extra.update(hook())
        return collect_stats(self, extra)

    def length_model(self) -> RemainingLength | None:
        """The output-length predictor in use (scheduler/policies.py). Looked up each time: a
        study may swap the queue's or the own model."""
        return length_model_of(self.waiting, self.admission, self.own_length_model)

    def predicted_load(self) -> PredictedLoad:
        """Predicted remaining output tokens of the waiting and running requests (what a replica
        reports for the router's predicted_tokens load signal)."""
        return predicted_load([*self.waiting, *self.running], self.length_model())

    # ---- schedule ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens: running requests first, then waiting ones, within the budget."""
        step = Step(budget=self.config.max_num_batched_tokens, encoder_budget=self.encoder_budget)
        # Micro-batches hold requests out of a step (scheduler/features_pipeline.py).
        self.limits = step_limits(self.hooks.step_limits)
        self.bulk = BulkBudget.for_step(
            self.running, step.budget, self.config.bulk_tokens_per_step
        )  # scheduler/bulk_budget.py
        self._schedule_running(step)
        # Anti-thrash: a step that had to preempt admits nothing new (as vLLM does).
        if not step.running_pass_preempted:
            self._schedule_waiting(step)
        out = step.output(self.config.max_num_batched_tokens, self.finished.take_ids())
        out.lora_loads = self.loras.take_loads()
        if self.connector is not None:
            out.kv_transfers = self.connector.take_transfers()
        for hook in self.hooks.after_schedule:
            hook(step, out)
        self.kv.end_step()
        return out

    def _schedule_running(self, step: Step) -> None:
        """Each running request's next tokens, in order. A plain decode (one token, nothing to
        verify) is sized and placed here: the loop keeps the budget above zero, so it takes one
        token, and it asks the pool for a block only when that token starts one."""
        bs, tables = self.kv.block_size, self.kv.req_blocks
        plain_decodes = not self.hooks.num_spec_tokens
        charges, landed = self.waiting.charges_tokens, self.landed
        take, send_cached = step.take, step.cached_reqs.append
        held, max_reqs = self.limits.held, self.limits.max_reqs
        capped = len(self.running) > max_reqs  # else the pass cannot reach the cap
        for req in list(self.running):
            if step.budget <= 0 or (capped and len(step.num_scheduled) >= max_reqs):
                break
            # Preempted earlier in this pass, or still in a step in flight.
            if req.status is not _RUNNING or (held and req.request_id in held):
                continue
            computed = req.num_computed_tokens
            pending = req.num_output_placeholders  # tokens still being sampled (async overlap)
            gap = len(req.all_token_ids) + pending - computed
            n = 1 if gap == 1 and plain_decodes else self._num_new_tokens(req, computed, gap, step)
            if n <= 0 or (pending and finishes_on_pending(req, self.max_model_len)):
                continue
            new_blocks: list[int] = []  # while its last block has room: none to add
            if computed + n > len(tables.get(req.request_id, ())) * bs:
                if (allocated := allocate_or_preempt(self, req, n, step)) is None:
                    continue
                new_blocks = allocated
            if landed and req.request_id in landed:
                new_blocks = send_landed(self, req, step)
            else:
                send_cached(req)
            take(req, n, new_blocks)
            if gap != 1:  # a chunk; a decode is never bulk work (scheduler/bulk_budget.py)
                self.bulk.charge(req, computed, n)
            if charges:
                self.charge_input(req, computed, n)

    def _num_new_tokens(self, req: Request, computed: int, gap: int, step: Step) -> int:
        """The tokens req runs this step when it is not a plain decode: a decode that verifies
        proposals, or a chunk of its prompt (or of tokens to recompute)."""
        if gap == 1:  # a decode (never cut at the prompt's end): it may verify proposals too
            gap += sum(hook(req) for hook in self.hooks.num_spec_tokens)
            return min(gap, self.prefill_cap, step.budget)
        bulk = self.bulk.cap(req, computed)
        n = min(gap, self.prefill_cap, step.budget, to_prompt_end(req, computed), bulk)
        if req.image_spans:  # never cut inside an image (scheduler/multimodal.py)
            n = fit_images(req.image_spans, computed, n, step.encoder_budget)
        return n

    def _schedule_waiting(self, step: Step) -> None:
        cfg = self.config
        while (
            len(self.waiting)
            and step.budget > 0
            and len(self.running) + len(self.loading) < cfg.max_num_seqs
            and len(step.num_scheduled) < self.limits.max_reqs
        ):
            req = self.waiting.peek()
            rid = req.request_id
            # Never re-admit a victim in the step that took it, nor while a step in flight holds it.
            if rid in step.preempted or rid in self.limits.held:
                break
            if self.bulk.cap(req, req.num_computed_tokens) <= 0:  # the step's bulk share is spent
                break
            lora = req.spec.lora_name
            if lora is not None and not self.loras.acquire(lora):
                break  # every slot's adapter is in use: it waits until one is released
            if not self.state_slots.acquire(req.request_id):
                self.loras.release(lora)
                break  # every state slot is held: it waits as for blocks
            # With nothing running the watermark could only starve the head request.
            reserve = cfg.num_watermark_blocks if self.running else 0
            admit = resume_swapped if req.status == _SWAPPED else admit_waiting
            if admit(self, req, step, reserve):
                continue
            self.loras.release(lora)
            self.state_slots.release(req.request_id)
            if cfg.policy == "priority" and displace_for(self, req, step, reserve):
                continue
            break

    def charge_input(self, req: Request, start: int, n: int) -> None:
        # A decode (and the proposals it verifies) is charged as output when its tokens are kept;
        # a chunk that starts before the last known token is input.
        if start < req.num_tokens - 1:
            self.waiting.charge(req.tenant, self.config.fair_input_weight * n)

    # ---- results -------------------------------------------------------------------------------
    def tokens_in_flight(self) -> dict[str, int]:
        """Tokens per request scheduled in steps later than the one being updated, whose KV is not
        written yet (async overlap schedules one step ahead)."""
        ahead: dict[str, int] = {}
        for hook in self.hooks.tokens_in_flight:
            for rid, n in hook().items():
                ahead[rid] = ahead.get(rid, 0) + n
        return ahead

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Append sampled tokens under the stop rules, free finished requests' blocks."""
        outputs: list[RequestOutput] = []
        for before in self.hooks.before_update:
            runner_output, answered = before(scheduler_output, runner_output)
            outputs += answered
        if runner_output.failed:
            outputs += self._finish_all(dict(runner_output.failed), RequestStatus.FINISHED_ERROR)
        if scheduler_output.kv_transfers is not None and self.connector is not None:
            landed = land_loads(self, scheduler_output.kv_transfers, runner_output.kv_load_failed)
            for on_landed in self.hooks.on_landed:
                for req in landed:
                    on_landed(req)
        if runner_output.expert_tokens_per_rank:
            count_expert_tokens(self.expert_tokens_per_rank, runner_output.expert_tokens_per_rank)
        if runner_output.length_features:
            take_length_features(self, runner_output.length_features)
        self._append_step(runner_output, outputs)
        for after in self.hooks.after_update:
            after(scheduler_output, runner_output)
        return outputs

    def _append_step(self, runner_output: ModelRunnerOutput, outputs: list[RequestOutput]) -> None:
        """Each row's sampled tokens appended; blocks that filled registered in the prefix cache."""
        kv, requests, add_output = self.kv, self.requests, outputs.append
        register = kv.register_computed_blocks if self.config.enable_prefix_caching else None
        registered, bs = kv.num_registered_blocks, kv.block_size
        charge = self.waiting.charge if self.waiting.charges_tokens else None
        logprobs, prompt_logprobs = runner_output.logprobs, runner_output.prompt_logprobs
        any_finished, ahead, max_model_len = False, self.tokens_in_flight(), self.max_model_len
        for rid, sampled, lp in zip(
            runner_output.req_ids,
            runner_output.sampled_token_ids,
            repeat(None) if logprobs is None else logprobs,
        ):
            req = requests.get(rid)
            if req is None or req.status is not _RUNNING:  # aborted while the step ran
                continue
            # Hash and register only when a block has just filled up (one step in block_size).
            written = req.num_computed_tokens
            if ahead:
                written -= ahead.get(rid, 0)
            if register is not None and written // bs > registered.get(rid, 0):
                register(req, written)
            if not sampled:
                continue
            kept, status = append_tokens(req, sampled, max_model_len)
            if charge is not None:
                charge(req.tenant, self.config.fair_output_weight * len(kept))
            if status is not None:
                any_finished = True
                self.finish(req, status)
            out = request_output(req, kept, None if lp is None else lp[: len(kept)])
            if prompt_logprobs:
                out.prompt_logprobs = prompt_logprobs.get(rid)
            add_output(out)
        if any_finished:
            self.running = [r for r in self.running if r.status is _RUNNING]

    # ---- helpers features call -----------------------------------------------------------------
    def finish(self, req: Request, status: RequestStatus) -> None:
        """Give the request its final status and its blocks back; the next step tells the runner."""
        for hook in self.hooks.on_finish:
            hook(req)
        if req.status is _RUNNING:
            self.loras.release(req.spec.lora_name)
        self.state_slots.release(req.request_id)
        req.status = status
        self.kv.free(req)
        if self.connector is not None:
            self.connector.release(req.request_id)
        self.waiting.learn(req)  # the srpt policy's length predictor learns from it
        if self.admission is not None:
            self.admission.learn(req)
        if self.own_length_model is not None:
            safe_observe(self.own_length_model, req)
        self.finished.add(req.request_id)
