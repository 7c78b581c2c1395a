"""ModelRunner: per-request state kept in sync from SchedulerOutput diffs, one forward per step.

It only ever sees SchedulerOutput and answers with ModelRunnerOutput, so the same object runs
in-process or inside a Ray worker (one per tensor-parallel rank; only rank 0 samples). What can be
switched on (LoRA, KV tiers and transfers, a draft model, verification, async scheduling,
proposers, pooling, prompt logprobs, length features, structured output) is a feature
(workers/features/): the runner calls each feature's hooks in the order of one list built from
RunnerConfig, and never asks which features it has.
"""

from __future__ import annotations

import logging
import time
from typing import TypeVar

import torch
from transformers import AutoConfig, PretrainedConfig

from scheduler.outputs import ModelRunnerOutput, NewRequestData, SchedulerOutput
from workers.cuda_graphs import DecodeGraphs, decode_graphs_enabled
from workers.features.base import CausalLM, RunnerContext, RunnerFeature, SampleStep
from workers.features.build import build_features
from workers.features.kv_loads import KVLoadsFeature
from workers.features.length import LengthFeature
from workers.features.lora import LoraFeature
from workers.features.ngram import ProposerFeature
from workers.kv_cache import KVCache, KVCacheSpec, cpu_num_blocks, cuda_num_blocks
from workers.kv_fp8 import cache_dtype, check_device
from workers.kv_transfer import KVReceiver
from workers.layers import invariant
from workers.layers.attention import AttentionMetadata
from workers.layers.mla import bind_backend
from workers.length_features import LengthFeatures
from workers.linear_state import state_features
from workers.loader import load_model
from workers.lora.manager import LoraManager
from workers.parallel import get_tp_rank, set_expert_parallel
from workers.pipeline import current_stage, set_stage_layers
from workers.proposer import Proposer
from workers.runner_config import DTYPES, RunnerConfig
from workers.runner_process import tune_process
from workers.sampler import Sampler, SamplingState
from workers.step_sample import sample_step
from workers.step_state import (
    Batch,
    BlockTableRows,
    RequestState,
    add_to_batch,
    apply_cached,
    build_batch,
)
from workers.verify_rows import (
    AttentionRows,
    attention_rows,
    graph_batch_size,
    logits_positions,
    token_offsets,
)
from workers.weight_update import RankWeights

# Names older callers import from here.
__all__ = ["DTYPES", "BlockTableRows", "ModelRunner", "RequestState", "RunnerConfig", "_Batch"]
_Batch = Batch

logger = logging.getLogger(__name__)
F = TypeVar("F", bound=RunnerFeature)


def _need(feature: F | None) -> F:
    if feature is None:
        raise ValueError("this runner was built without that feature (RunnerConfig)")
    return feature


class ModelRunner:
    """Holds the model, the KV cache, request state and the features of one rank."""

    def __init__(self, config: RunnerConfig) -> None:
        self.config = config
        hf_config = AutoConfig.from_pretrained(config.model_dir)
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        tune_process(config, self.device)
        text = hf_config.get_text_config()  # a vision model's language model (else hf_config)
        set_stage_layers(  # before the model is built: a pipeline stage builds its layers only
            text, config.pipeline_parallel_size, config.pipeline_layer_split
        )
        self.model = self._load_model(hf_config)
        # The sampling rank: TP rank 0 of the last pipeline stage (rank 0 without stages).
        self.is_driver = get_tp_rank() == 0 and current_stage().is_last
        self.requests: dict[str, RequestState] = {}
        ctx = RunnerContext(
            config, self.model, text, self.device, self.dtype, self.is_driver, self.requests
        )
        # Before the backend is chosen: LoRA wraps the model's linears.
        self.features: list[RunnerFeature] = build_features(ctx)
        self.features += state_features(ctx)  # hybrid models' recurrent state slots
        self._init_attention()
        self.kv_cache: KVCache | None = None
        self.sampler = Sampler()
        self.block_tables = BlockTableRows(
            -(-config.max_model_len // config.block_size), config.max_num_seqs
        )
        # At any TP size: NCCL collectives are captured inside the graphs (workers/cuda_graphs.py).
        # Not per pipeline stage yet: a captured forward would have to hold its p2p hand-offs.
        self.use_graphs = config.pipeline_parallel_size == 1 and decode_graphs_enabled(
            self.device, config.enforce_eager, self.backend.supports_cuda_graphs
        )
        self.graphs: DecodeGraphs | None = None
        # Verify rows attend as decode rows (workers/verify_rows.py); False: as prefill chunks,
        # the layout before (kept for comparisons: tests and bench/spec_bench.py).
        self.verify_as_decodes = True
        # Weight updates and sleep, applied between steps (workers/weight_update.py).
        self.weights = RankWeights()

    def _load_model(self, hf_config: PretrainedConfig) -> CausalLM:
        cfg, t0 = self.config, time.perf_counter()
        set_expert_parallel(cfg.expert_parallel)  # read by the MoE layers as they are built
        model = load_model(
            cfg.model_dir,
            hf_config,
            self.dtype,
            self.device,
            cfg.max_model_len,
            progress=cfg.load_progress,
            gguf_file=cfg.gguf_file,
            quantization=cfg.quantization,
        )
        logger.info("model loaded in %.1fs", time.perf_counter() - t0)
        return model

    def _init_attention(self) -> None:
        cfg = self.config
        self.layers = self.model.attention_layers()
        self.backend = bind_backend(  # MLA's latent rows get latent_backend's rule
            self.layers, self.device, cfg.attention_backend, self.dtype, cfg.block_size
        )
        if cfg.kv_cache_dtype == "fp8":
            check_device(self.device, self.backend.name)
        kv_dtype = cache_dtype(cfg.kv_cache_dtype, self.dtype)
        self.kv_spec = KVCacheSpec.of(self.layers, cfg.block_size, kv_dtype)

    # ---- features, by what callers read or replace -------------------------------------------
    def feature(self, kind: type[F]) -> F | None:
        """The runner's feature of that kind, None when it is off."""
        return next((f for f in self.features if isinstance(f, kind)), None)

    @property
    def kv_receiver(self) -> KVReceiver | None:
        """KV arriving from a prefill engine (workers/kv_transfer.py); set by engine/disagg.py."""
        return _need(self.feature(KVLoadsFeature)).receiver

    @kv_receiver.setter
    def kv_receiver(self, receiver: KVReceiver | None) -> None:
        _need(self.feature(KVLoadsFeature)).receiver = receiver

    @property
    def proposer(self) -> Proposer | None:
        feature = self.feature(ProposerFeature)
        return None if feature is None else feature.proposer

    @proposer.setter
    def proposer(self, proposer: Proposer) -> None:
        _need(self.feature(ProposerFeature)).proposer = proposer

    @property
    def loras(self) -> LoraManager | None:
        feature = self.feature(LoraFeature)
        return None if feature is None else feature.manager

    @property
    def length_features(self) -> LengthFeatures | None:
        feature = self.feature(LengthFeature)
        return None if feature is None else feature.extractor

    # ---- KV cache ------------------------------------------------------------------------------
    def determine_num_blocks(self) -> int:
        """Device blocks for the KV cache: from kv_cache_memory_gb on CPU, profiled on CUDA (a
        feature's blocks, a draft model's, share the budget: each block id holds one of each)."""
        if self.device.type != "cuda":
            return self._share(cpu_num_blocks(self.kv_spec, self.config.kv_cache_memory_gb))
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run()
        torch.cuda.synchronize(self.device)
        blocks = cuda_num_blocks(self.kv_spec, self.device, self.config.gpu_memory_utilization)
        blocks = self._share(blocks)
        return blocks - 1 if self.use_graphs else blocks  # one block is the graphs' pad block

    def _share(self, blocks: int) -> int:
        for feature in self.features:
            blocks = feature.share_blocks(blocks, self.kv_spec)
        return blocks

    @torch.inference_mode()
    def _profile_run(self) -> None:
        """A forward over a full token budget of prefill, against a throwaway cache."""
        cfg = self.config
        num_tokens = cfg.max_num_batched_tokens
        num_seqs = min(-(-num_tokens // cfg.max_model_len), cfg.max_num_seqs)
        per_seq = min(num_tokens // num_seqs, cfg.max_model_len)
        blocks_per_seq = -(-per_seq // cfg.block_size)
        scratch = KVCache(self.kv_spec, num_seqs * blocks_per_seq, 0, self.device)
        scratch.bind(self.layers)
        batch = Batch()
        for i in range(num_seqs):
            blocks = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
            self.requests[f"profile-{i}"] = state = RequestState([0] * per_seq, blocks, 0, None)  # type: ignore[arg-type]
            add_to_batch(batch, f"profile-{i}", state, per_seq)
        try:
            self._forward(batch)
        finally:
            for rid in batch.req_ids:
                self.block_tables.release(self.requests.pop(rid))
            for layer in self.layers:  # drop the views so the scratch pool is freed now
                layer.k_cache = layer.v_cache = torch.empty(0)

    def init_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """Allocate the pools, bind them to the attention layers, and capture the decode graphs."""
        pad = 1 if self.use_graphs else 0  # a block past the scheduler's pool, for padded rows
        self.kv_cache = KVCache(self.kv_spec, num_gpu_blocks + pad, num_cpu_blocks, self.device)
        self.kv_cache.bind(self.layers)
        for feature in self.features:
            feature.init_kv_cache(self.kv_cache, num_gpu_blocks, num_cpu_blocks)
        if self.use_graphs:
            cfg = self.config
            self.graphs = DecodeGraphs(
                self.model,  # type: ignore[arg-type]  # an nn.Module, seen through CausalLM
                self.backend,
                graph_batch_size(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.speculative),
                -(-cfg.max_model_len // cfg.block_size),
                cfg.block_size,
                pad_block=num_gpu_blocks,
                device=self.device,
            )
            self.graphs.capture()

    # ---- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Apply the step's diffs, copy blocks, run the forward, sample and propose."""
        if self.kv_cache is None:
            raise RuntimeError("execute_model: init_kv_cache() must run first")
        failed = self._update_states(out)
        load_failed = self._copy_blocks(out, self.kv_cache)
        batch = self._build_batch(out) if out.total_num_scheduled_tokens else Batch()
        if not batch.req_ids:
            return ModelRunnerOutput([], [], failed=failed, kv_load_failed=load_failed)
        for feature in self.features:
            feature.before_forward(batch)  # grammar masks fill while the forward runs
        with invariant.batch_invariant(self.config.batch_invariant):
            output = self._sample(batch, self._forward(batch))
        for feature in self.features:
            feature.propose(batch, output)
        for feature in self.features:
            feature.proposed(batch, output)
        output.failed.update(failed)
        output.kv_load_failed = load_failed
        output.pooled, output.length_features = batch.pooled, batch.length_features
        expert_load = getattr(self.model, "expert_rows_per_rank", None)
        if expert_load is not None and self.is_driver:
            output.expert_tokens_per_rank = expert_load()
        return output  # the executor reads the sampling rank's (workers.pipeline.sampling_rank)

    def _copy_blocks(self, out: SchedulerOutput, cache: KVCache) -> list[int]:
        """The step's copies: the features' saves, the swaps, then the loads; the blocks whose
        load failed."""
        for feature in self.features:
            feature.before_copies(out)
        cache.swap_out(out.blocks_to_swap_out)
        cache.swap_in(out.blocks_to_swap_in)
        return [b for feature in self.features for b in feature.after_copies(out)]

    def _update_states(self, out: SchedulerOutput) -> dict[str, str]:
        """Apply the step's diffs; returns the new requests that could not start."""
        for rid in out.finished_req_ids:
            self._finish(rid)
        for rid in out.preempted_req_ids:
            state = self.requests.get(rid)
            if state is not None:  # a feature's per-request state holds until it resumes
                state.block_ids, state.num_synced_blocks = [], 0
        for rid, keep in out.truncated_block_tables.items():  # rejected proposals' blocks
            state = self.requests.get(rid)
            if state is not None:
                del state.block_ids[keep:]
                state.num_synced_blocks = min(state.num_synced_blocks, keep)
        failed: dict[str, str] = {}
        for new in out.scheduled_new_reqs:
            reason = self._start(new)
            if reason is not None:
                failed[new.req_id] = reason
        apply_cached(out.scheduled_cached_reqs, self.requests)
        for feature in self.features:
            feature.update(out)
        return failed

    def _finish(self, rid: str) -> None:
        state = self.requests.pop(rid, None)
        if state is not None:
            self.block_tables.release(state)
        for feature in self.features:
            feature.finish(rid)

    def _start(self, new: NewRequestData) -> str | None:
        """Add a new (or resent) request; why it could not start, or None."""
        try:
            sampling = SamplingState.create(
                new.sampling_params,
                new.prompt_token_ids,
                self.device,
                new.output_token_ids,
                new.eos_token_ids,
            )
            state = RequestState(
                list(new.prompt_token_ids) + list(new.output_token_ids),
                list(new.block_ids),
                new.num_computed_tokens,
                sampling,
                lora_name=new.lora_name,
            )
            for feature in self.features:
                feature.start(new, state)
        except Exception as exc:
            logger.warning("request %s failed to start: %r", new.req_id, exc)
            return f"sampling state: {exc!r}"
        if new.req_id in self.requests:  # sent again in full: its old state's table row is free
            self.block_tables.release(self.requests[new.req_id])
        self.requests[new.req_id] = state
        return None

    def _build_batch(self, out: SchedulerOutput) -> Batch:
        for feature in self.features:
            out = feature.schedule(out)
        return build_batch(out, self.requests)

    _add_to_batch = staticmethod(add_to_batch)  # bench/step_profile.py builds steps with it

    def _forward(self, batch: Batch) -> torch.Tensor | None:
        """Run the model on a batch; logits of the sampling rows (rank 0), None elsewhere."""
        # Verify rows attend as one decode row per token (workers/verify_rows.py).
        verify = [i for i, r in enumerate(batch.req_ids) if r in batch.drafts]
        rows = attention_rows(
            batch.starts, batch.query_lens, verify if self.verify_as_decodes else ()
        )
        offsets = token_offsets(batch.query_lens)
        eager = [feature.prepare(batch) for feature in self.features]  # every one prepares
        graphs = None if any(eager) else self.graphs
        if graphs is not None and rows.all_decodes and rows.num_rows <= graphs.max_batch:
            tables = [self.requests[batch.req_ids[i]].block_ids for i in rows.batch_rows]
            hidden = graphs.run(batch.input_ids, rows.starts, tables)  # a pure-decode step
        else:
            hidden = self._eager_forward(batch, rows)
        for feature in self.features:  # a prompt's last chunk may be one token long
            feature.after_forward(batch, hidden, offsets)
        if not batch.sample_rows:  # only partial prefills this step
            return None
        drafts = batch.drafts
        last = logits_positions(
            offsets, batch.sample_rows, [len(drafts.get(r, ())) for r in batch.req_ids]
        )
        if len(last) < hidden.shape[0]:
            hidden = hidden[torch.tensor(last, dtype=torch.long, device=self.device)]
        return self.model.compute_logits(hidden)

    def _eager_forward(self, batch: Batch, rows: AttentionRows) -> torch.Tensor:
        """The model over the batch's tokens, attention rows as `rows` lays them out."""
        bs, dev = self.config.block_size, self.device
        table_rows = [self.block_tables.sync(rid, self.requests[rid]) for rid in batch.req_ids]
        width = -(-max(s + n for s, n in zip(rows.starts, rows.query_lens)) // bs)
        tables = self.block_tables.select([table_rows[i] for i in rows.batch_rows], width)
        meta, positions = AttentionMetadata.from_tables(
            rows.starts, rows.query_lens, tables, bs, dev
        )
        self.backend.prepare(meta)
        input_ids = torch.tensor(batch.input_ids, dtype=torch.long).to(dev, non_blocking=True)
        return self.model(input_ids, positions, meta)

    def _sample(self, batch: Batch, logits: torch.Tensor | None) -> ModelRunnerOutput:
        """Rank 0 samples the rows that reached their end; the others answer empty lists."""
        if not self.is_driver or not batch.sample_rows or logits is None:
            return ModelRunnerOutput(batch.req_ids, [[] for _ in batch.req_ids])
        states = [self.requests[batch.req_ids[i]].sampling for i in batch.sample_rows]
        step = SampleStep(logits, list(batch.sample_rows), states)
        for feature in self.features:
            feature.before_sample(batch, step)
        output = sample_step(self.sampler, batch, step)
        for feature in self.features:
            feature.after_sample(batch, output)
        return output
