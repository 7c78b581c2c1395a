"""EngineCore: the step loop of one engine (schedule -> execute -> update_from_output)."""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from collections import deque
from concurrent.futures import Future
from dataclasses import replace

from transformers import AutoConfig

from engine.backends import default_executor
from engine.config import EngineConfig
from engine.executor import Executor, ExecutorFactory
from engine.loras import EngineLoras
from engine.multimodal import ImagePreprocessor
from engine.pipeline_config import micro_batches
from engine.step_pipeline import StepPipeline
from engine.tracing import StepTracer
from engine.weights import EngineWeights
from frontend.frontend import ModelInfo
from scheduler import ModelRunnerOutput, RequestOutput, Scheduler, SchedulerOutput, SchedulerStats
from scheduler.block_manager import PrefixReport
from scheduler.features import StepFeature
from scheduler.features_async import AsyncOverlap
from scheduler.features_images import ImageCounters
from scheduler.features_pipeline import MicroBatches
from scheduler.features_spec import SpecDecoding
from scheduler.length_state import open_length_state
from scheduler.predicted_load import PredictedLoad
from scheduler.request import EngineRequest, Request
from scheduler.speculative import SpeculativeConfig
from scheduler.state_checkpoints import StateCheckpointFeature
from scheduler.state_slots import StateSlots
from workers.kv_cache import GiB, KVCacheSpec
from workers.kv_fp8 import cache_dtype
from workers.kv_tiers import KVTierConfig, disk_tier_blocks
from workers.length_features import PROJECTION_SEED
from workers.linear_state import check_hybrid_engine, is_hybrid_config
from workers.lora.adapter import check_lora_model
from workers.runner import DTYPES
from workers.weight_transfer import WeightGroupSpec

logger = logging.getLogger(__name__)


class EngineCore:
    """Owns a Scheduler and an executor; each step() runs one batch and returns its outputs."""

    def __init__(
        self, config: EngineConfig, executor_factory: ExecutorFactory = default_executor
    ) -> None:
        self.config = config
        # Seconds of each startup phase (cluster/cold_start.py exports them per replica).
        self.startup: dict[str, float] = {}
        clock = time.perf_counter()
        self.model_info = ModelInfo.load(config.model, config.cache_dir)
        self.model_dir = self.model_info.model_dir
        config = self.config = self._hybrid(config)
        sched = config.scheduler
        limit = self.model_info.context_limit
        if sched.max_model_len is not None and limit is not None and sched.max_model_len > limit:
            # The rotary table ends there: a sequence past it would fail the whole engine mid-step.
            raise ValueError(
                f"max_model_len: {sched.max_model_len} exceeds the model's context of {limit} "
                f"tokens (max_position_embeddings in its config.json)"
            )
        if config.num_lora_slots:  # refused here, before any worker builds its LoRA layers
            check_lora_model(AutoConfig.from_pretrained(self.model_dir))
        self.max_model_len = sched.max_model_len or self.model_info.max_model_len
        self.vocab_size = self.model_info.vocab_size
        self.eos_token_ids = self.model_info.eos_token_ids
        # A vision model's image processor (engine/multimodal.py); None: the model takes text.
        self.images = ImagePreprocessor.load(self.model_dir)
        self.failure: BaseException | None = None
        self.tiers = self._kv_tiers()
        runner_config = config.runner_config(
            self.model_dir, self.max_model_len, self.tiers, self._draft_model_dir()
        )
        runner_config.num_state_checkpoints = self.num_state_checkpoints
        clock = self._phase("model_config", clock)
        self.executor: Executor = executor_factory(config, runner_config)
        clock = self._phase("weights", clock)
        num_gpu_blocks, num_cpu_blocks = self._size_pools()
        clock = self._phase("kv_profile", clock)
        self.executor.init_kv_cache(num_gpu_blocks, num_cpu_blocks)
        self._phase("kv_allocation", clock)  # CUDA graphs are captured here too
        self.num_gpu_blocks, self.num_cpu_blocks = num_gpu_blocks, num_cpu_blocks
        # What one token's KV takes on each rank, all layers (MLA: its latent row; else K and V of
        # the rank's heads): the layout the blocks above were counted in (/metrics, the log).
        self.kv_bytes_per_token = self._kv_spec().block_bytes // sched.block_size
        self._start_scheduler(runner_config.async_scheduling)
        ranks = getattr(self.executor, "call_ranks", None)  # hands checked adapters to each rank
        self.loras = EngineLoras(config, self.model_dir, ranks, DTYPES[runner_config.dtype])
        self.scheduler.loras = self.loras.slots  # one registry: checked here, placed there
        self.loras.add_configured()
        self.weights = EngineWeights(self)  # updates and sleep, between steps (engine/weights.py)
        logger.info(
            "engine ready: %s on %s, %d KV blocks of %d tokens (%d KV bytes a token per rank), "
            "max_model_len %d",
            config.model,
            runner_config.device,
            num_gpu_blocks,
            sched.block_size,
            self.kv_bytes_per_token,
            self.max_model_len,
        )

    def _size_pools(self) -> tuple[int, int]:
        """The device and CPU pools' blocks; an unset max_model_len shrinks to the device pool."""
        sched = self.config.scheduler
        num_gpu_blocks = sched.num_gpu_blocks or self.executor.determine_num_blocks()
        if sched.max_model_len is None and num_gpu_blocks * sched.block_size < self.max_model_len:
            # The default length is a convenience; shrink it to what the pool can hold.
            self.max_model_len = num_gpu_blocks * sched.block_size
            logger.warning(
                "max_model_len lowered to %d: the KV pool holds %d blocks",
                self.max_model_len,
                num_gpu_blocks,
            )
        return num_gpu_blocks, self._num_cpu_blocks()

    def _start_scheduler(self, overlap: bool) -> None:
        """The Scheduler with its step features, listed once from the settings, and with
        async overlap (`overlap`: async_scheduling resolved), the thread steps run on."""
        config = self.config
        if config.async_scheduling and not overlap:
            logger.warning(
                "async_scheduling: %d ranks do not overlap a step with the next one's (one rank "
                "samples; the others learn each token from the next step); pipeline stages keep "
                "a micro-batch in flight per stage instead",
                config.world_size,
            )
        sized = config.sized_scheduler(
            self.num_gpu_blocks, self.num_cpu_blocks, self.max_model_len, self.tiers
        )
        depth = micro_batches(config)  # pipeline stages: a step in flight per stage
        hooks = step_features(config.speculative, overlap, depth)
        if self.images is not None:  # the vision tower's counts, for the stats
            hooks.append(ImageCounters())
        if self.num_state_checkpoints:  # a hybrid's prefix hits start from state checkpoints
            hooks.append(StateCheckpointFeature(self.num_state_checkpoints))
        self.scheduler = Scheduler(sized, hooks)
        self.scheduler.state_slots = StateSlots(self.num_state_slots)
        # Async scheduling: steps run on the pipeline's thread, one scheduled ahead of the one
        # being updated from (scheduler/features_async.py); pipeline stages: `depth` in flight.
        self.pipeline = StepPipeline(self.executor) if overlap or depth > 1 else None
        self._depth = max(depth, 2)
        self._post_early = depth > 1  # micro-batches: the next one posted before step() returns
        # What the length probe's features come from: a state file of other features is not read.
        features = f"{config.model}|{config.quantization}|projection seed {PROJECTION_SEED}"
        self.length_state = open_length_state(self.scheduler, features)
        self._in_flight: deque[tuple[SchedulerOutput, Future[ModelRunnerOutput]]] = deque()
        # The traced requests' phases (engine/tracing.py); empty unless a replica traces one.
        self.tracer = StepTracer()

    def _hybrid(self, config: EngineConfig) -> EngineConfig:
        """A hybrid model's config (workers/linear_state.py): what it cannot run refused, one
        recurrent-state slot per running request and, with prefix caching, its state
        checkpoints (scheduler/state_checkpoints.py); any other model's unchanged."""
        self.num_state_slots = self.num_state_checkpoints = 0
        if not is_hybrid_config(AutoConfig.from_pretrained(self.model_dir)):
            return config
        sched = config.scheduler
        check_hybrid_engine(
            preemption_mode=sched.preemption_mode,
            speculative=config.speculative is not None,
            kv_tiers=bool(config.kv_cpu_tier_gb or sched.num_cpu_tier_blocks),
            pipeline_parallel_size=config.pipeline_parallel_size,
        )
        self.num_state_slots = sched.max_num_seqs
        if sched.enable_prefix_caching:
            wanted = config.num_state_checkpoints
            self.num_state_checkpoints = sched.max_num_seqs if wanted is None else wanted
        if not self.num_state_checkpoints:  # no hit could restore the linear layers' state
            sched = replace(sched, enable_prefix_caching=False)
        # Eager: the decode graphs would capture no state slots.
        return replace(config, enforce_eager=True, scheduler=sched)

    def _draft_model_dir(self) -> str | None:
        """The draft model's directory, once checked against the model (speculative.method
        `draft`)."""
        spec = self.config.speculative
        if spec is None or spec.draft_model is None:
            return None
        from workers.draft import check_draft_model

        return check_draft_model(
            spec.draft_model,
            self.config.cache_dir,
            self.model_dir,
            self.vocab_size,
            self.max_model_len,
        )

    def _phase(self, name: str, since: float) -> float:
        now = time.perf_counter()
        self.startup[name] = now - since
        return now

    def _num_cpu_blocks(self) -> int:
        if self.config.scheduler.num_cpu_blocks is not None:
            return self.config.scheduler.num_cpu_blocks
        if self.config.swap_space_gb == 0:
            return 0
        return self._kv_spec().blocks_in(self.config.swap_space_gb * GiB)

    def _kv_spec(self) -> KVCacheSpec:
        """One rank's KV block shape, before the workers report it (pools sized in GiB; an FP8
        cache's blocks take half of bf16's bytes)."""
        return KVCacheSpec.from_hf_config(
            AutoConfig.from_pretrained(self.model_dir).get_text_config(),
            self.config.block_size,
            cache_dtype(self.config.kv_cache_dtype, DTYPES[self.config.dtype]),
            self.config.tensor_parallel_size,
        )

    def _kv_tiers(self) -> KVTierConfig | None:
        """The prefix cache's lower tiers: pinned in blocks, else sized from GiB; None when off.
        The disk tier gets a directory of this engine's own under kv_disk_tier_dir."""
        cfg, sched = self.config, self.config.scheduler
        cpu, disk = sched.num_cpu_tier_blocks, sched.num_disk_tier_blocks
        if cpu is None:
            cpu = self._kv_spec().blocks_in(cfg.kv_cpu_tier_gb * GiB) if cfg.kv_cpu_tier_gb else 0
        if disk is None:
            disk = disk_tier_blocks(self._kv_spec(), cfg.kv_disk_tier_gb)
        if not cpu:
            if disk:
                raise ValueError(
                    "kv_disk_tier_gb: the disk tier is fed by the CPU tier; set kv_cpu_tier_gb"
                )
            return None
        if not sched.enable_prefix_caching:
            raise ValueError(
                "kv_cpu_tier_gb: the KV tiers keep prefix-cache blocks; they need "
                "enable_prefix_caching"
            )
        disk_dir = None
        if disk:
            disk_dir = os.path.join(
                os.path.expanduser(cfg.kv_disk_tier_dir), f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
            )
        return KVTierConfig(cpu, disk, disk_dir)

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request (its end-of-turn ids default to the model's); ValueError if it cannot
        run."""
        if self.images is not None:  # placeholders expanded, pixels preprocessed, on this thread
            request = self.images.expand(request)
        elif request.images or request.mm_inputs is not None:
            raise ValueError(f"images: model {self.config.model!r} takes no images")
        ids = request.prompt_token_ids
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            # An id outside the embedding table would fail the whole batch's forward, not just this
            # request.
            raise ValueError(
                f"prompt_token_ids: token ids must be in [0, {self.vocab_size}), "
                f"got {min(ids)}..{max(ids)}"
            )
        request.sampling_params.check_vocab(self.vocab_size)
        request = self.loras.keyed(request)  # UnknownLoraError for a name not loaded
        if not request.eos_token_ids:
            request = replace(request, eos_token_ids=self.eos_token_ids)
        if self.weights.admit(request):  # held while a weight update waits for the engine to drain
            self.scheduler.add_request(Request(request))

    # ---- LoRA adapters (engine/loras.py) --------------------------------------------------------
    def add_lora(self, name: str, path: str) -> None:
        """Make a PEFT adapter directory available as `name`: read and checked now (ValueError
        naming a bad file, a rank over max_lora_rank, a target the model lacks, a path outside
        lora_root), loaded into a device slot when a request first needs it. The running batch
        is not touched."""
        self.loras.add(name, path)

    def remove_lora(self, name: str) -> None:
        """Forget an adapter. Refused (LoraInUseError, a ValueError) while unfinished requests
        use it, never waited for; UnknownLoraError (a LookupError) for an unknown name."""
        users = sum(
            1
            for r in self.scheduler.requests.values()
            if not r.is_finished and r.spec.lora_name == name
        )
        self.loras.remove(name, users)

    def list_loras(self) -> list[str]:
        """The adapters requests may name, in the order they were added."""
        return self.loras.slots.names()

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        return self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests() or bool(self._in_flight) or self.weights.busy()
        )

    def step(self) -> list[RequestOutput]:
        """Schedule one batch, run it, and return what each request produced."""
        if self.failure is not None:
            raise RuntimeError(
                f"engine failed in an earlier step: {self.failure!r}"
            ) from self.failure
        self.weights.before_step()  # a pending weight update, once the engine reached its point
        if self.pipeline is not None:
            return self._step_overlapped(self.pipeline)
        scheduler_output = self._schedule()
        try:
            runner_output = self.executor.execute_model(scheduler_output)
        except BaseException as exc:
            # The scheduler already counted this step's tokens as computed, but their KV was never
            # written: later steps would read garbage or stall, so the engine stays failed.
            self.failure = exc
            raise
        return self._update(scheduler_output, runner_output)

    def _step_overlapped(self, pipeline: StepPipeline) -> list[RequestOutput]:
        """Async scheduling or pipeline stages: launch steps until `_depth` are in flight, then
        wait for the oldest and return its outputs; the later ones run while the caller handles
        them."""
        queue = self._in_flight
        if not queue:
            queue.append(self._launch(pipeline, self._schedule()))
        self._fill(pipeline)
        scheduler_output, future = queue.popleft()
        try:
            runner_output = future.result()
        except BaseException as exc:
            self.failure = exc  # as in a synchronous step; the pipeline runs no later step
            raise
        outputs = self._update(scheduler_output, runner_output)
        if self._post_early:
            # Stage 0 is free once it handed its micro-batch on: the requests just updated go
            # back to it now, not after the caller has handled their outputs.
            self._fill(pipeline)
        return outputs

    def _fill(self, pipeline: StepPipeline) -> None:
        """Launch steps until `_depth` are in flight or nothing more can run."""
        queue = self._in_flight
        while len(queue) < self._depth and self.scheduler.has_unfinished_requests():
            if self.weights.holds_launch():
                break
            queue.append(self._launch(pipeline, self._schedule()))
            if queue[-1][0].is_empty:  # every request that can run is in a step in flight
                break

    def _schedule(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        if self.tracer.requests:  # tracing off: this test alone
            self.tracer.scheduled(out, self.scheduler.requests)
        return out

    def _update(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.tracer.requests or self.tracer.pending:
            self.tracer.updated(scheduler_output, outputs)
        if self.length_state is not None:
            self.length_state.maybe_save()
        return _with_pooled(outputs, runner_output)

    @staticmethod
    def _launch(
        pipeline: StepPipeline, out: SchedulerOutput
    ) -> tuple[SchedulerOutput, Future[ModelRunnerOutput]]:
        if out.is_empty and not (out.finished_req_ids or out.preempted_req_ids or out.has_copies):
            done: Future[ModelRunnerOutput] = Future()  # nothing for the runner to do or to hear
            done.set_result(ModelRunnerOutput([], []))
            return out, done
        return out, pipeline.submit(out)

    # ---- weight updates and sleep (engine/weights.py, docs/rl.md) ------------------------------
    def update_weights(
        self, path: str | None = None, from_group: bool = False, in_flight: str = "finish"
    ) -> Future[int]:
        """New weights from a checkpoint (`path`: a safetensors directory or file) or from the
        trainer of the weight group (`from_group`), read and checked on every rank before any is
        replaced (ValueError naming a missing tensor, a wrong shape or dtype, a NaN or inf, a
        quantized layer: the old weights keep serving). Requests in flight finish on the old
        weights first (`in_flight="finish"`: new ones wait) or are recomputed on the new ones
        (`"recompute"`). The future resolves to the number of tensors once applied: at once when
        nothing is in flight, else at a later step."""
        if from_group == (path is not None):
            raise ValueError("update_weights: give either a path or from_group=True")
        return self.weights.update(path, in_flight)

    def init_weight_group(self, spec: WeightGroupSpec) -> None:
        """Join a trainer's weight group (workers/weight_transfer.py); blocks until every member
        has joined."""
        self.weights.join_group(spec)

    def destroy_weight_group(self) -> None:
        self.weights.leave_group()

    def sleep(self, level: int = 1, discard_weights: bool = False) -> None:
        """Free the KV cache and the KV tiers' memory (level 1); level 2 also moves the weights
        to host memory (CUDA), or drops them (`discard_weights`: an update_weights must follow).
        Refused while requests are in flight; requests are refused (EngineAsleepError) until
        wake_up."""
        self.weights.sleep(level, discard_weights)

    def wake_up(self) -> None:
        """Reallocate the KV cache (and bring offloaded weights back)."""
        self.weights.wake_up()

    @property
    def sleep_level(self) -> int:
        """0 awake, else the level of the sleep."""
        return self.weights.asleep

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def expert_load(self) -> list[int]:
        """Mixture-of-experts models: (token, expert) rows each tensor-parallel rank computed so
        far, summed over layers and steps; empty for dense models."""
        return list(self.scheduler.expert_tokens_per_rank)

    def predicted_load(self) -> PredictedLoad:
        """Predicted remaining output tokens of the queued and running requests (the router's
        predicted_tokens load signal)."""
        return self.scheduler.predicted_load()

    def prefix_report(self, limit: int) -> PrefixReport:
        """Hashes of up to `limit` most recently cached KV blocks (what the router's prefix index
        mirrors), numbered, with their change since the previous report."""
        return self.scheduler.kv.pool.prefix_report(limit)

    def tier_hashes(self, limit: int) -> list[int] | None:
        """Up to `limit` hashes the prefix cache's lower tiers hold, most recently used last; None
        when the tiers are off."""
        connector = self.scheduler.connector
        return None if connector is None else connector.hashes(limit)

    def shutdown(self) -> None:
        if self.length_state is not None:
            self.length_state.save()
        if self.pipeline is not None:
            self.pipeline.shutdown()
        self.executor.shutdown()
        if self.tiers is not None and self.tiers.disk_dir is not None:
            shutil.rmtree(self.tiers.disk_dir, ignore_errors=True)  # this engine's files alone


def step_features(
    spec: SpeculativeConfig | None, overlap: bool, micro_batches: int = 1
) -> list[StepFeature]:
    """The scheduler's features for these settings, in the order their hooks run: speculation
    settles a step's draft slots before async overlap drops the rows it no longer speaks for.
    Pipeline micro-batches keep steps in flight as async overlap does, without placeholders."""
    features: list[StepFeature] = []
    if spec is not None:
        features.append(SpecDecoding(spec, overlap))
    if micro_batches > 1:
        features.append(MicroBatches(micro_batches))
    elif overlap:
        features.append(AsyncOverlap())
    return features


def _with_pooled(
    outputs: list[RequestOutput], runner_output: ModelRunnerOutput
) -> list[RequestOutput]:
    """Embedding requests' vectors go out with the one token each sampled."""
    if runner_output.pooled:
        for out in outputs:
            out.pooled = runner_output.pooled.get(out.request_id)
    return outputs
