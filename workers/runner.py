"""ModelRunner: per-request state kept in sync from SchedulerOutput diffs, one forward per step.

It only ever sees SchedulerOutput and answers with ModelRunnerOutput, so the same object runs
in-process or inside a Ray worker (one per tensor-parallel rank; only rank 0 samples).
"""

from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers import AutoConfig

from scheduler.kv_connector import KVTransfers
from scheduler.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from scheduler.sampling_params import SamplingParams
from scheduler.speculative import SpeculativeConfig
from workers.cuda_graphs import DecodeGraphs, decode_graphs_enabled
from workers.draft import DraftModel, DraftRow
from workers.draft_pacing import DraftPacing
from workers.kv_cache import KVCache, KVCacheSpec, cpu_num_blocks, cuda_num_blocks
from workers.kv_fp8 import cache_dtype, check_device
from workers.kv_tiers import KVTierConfig, KVTiers
from workers.kv_transfer import KVReceiver
from workers.layers.attention import AttentionMetadata, select_backend
from workers.length_features import LengthFeatures, ends_prompt
from workers.loader import load_model
from workers.lora.manager import LoraManager
from workers.model_files import load_tokenizer
from workers.parallel import all_reduce, get_tp_rank, get_tp_world_size, set_expert_parallel
from workers.pooling import Pooler
from workers.process import set_niceness
from workers.prompt_logprobs import prompt_logprobs
from workers.proposer import make_proposer
from workers.sampler import Sampler, SamplerOutput, SamplingState
from workers.spec_verify import accepted_run, position_states
from workers.verify_rows import (
    AttentionRows,
    attention_rows,
    graph_batch_size,
    logits_positions,
    token_offsets,
)

if TYPE_CHECKING:
    # Imported at the first constrained request: llguidance's torch module pulls in
    # torch._dynamo and inductor, seconds of every replica's cold start.
    from workers.structured import PendingMasks, StructuredDecoding

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class RunnerConfig:
    """What a worker needs to build its model and cache (plain values: travels to Ray workers).

    Derived by engine.config.EngineConfig.runner_config, where each setting is declared.
    """

    model_dir: (
        str  # an HF directory (GGUF files are converted by workers.model_files.resolve_model)
    )
    dtype: str
    device: str  # "cpu" or "cuda" / "cuda:N"
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    seed: int
    attention_backend: str
    kv_cache_memory_gb: float
    gpu_memory_utilization: float
    load_progress: bool
    cpu_threads: int | None = None
    process_niceness: int | None = None
    enforce_eager: bool = False
    grammar_timeout_s: float = 10.0
    grammar_mask_deadline_s: float = 1.0
    # The engine schedules a step before the previous one's tokens are back (TP = 1 only): the
    # runner appends what it samples itself, and the scheduler sends no sampled token back.
    async_scheduling: bool = False
    # MoE layers hold whole experts per rank (workers/layers/moe.py).
    expert_parallel: bool = False
    # Speculative decoding: the runner proposes after sampling and verifies what is scheduled.
    speculative: SpeculativeConfig | None = None
    # method `draft`: the draft's HF directory (and GGUF file, when its blocks stay quantized).
    draft_model_dir: str | None = None
    draft_gguf_file: str | None = None
    # A GGUF file whose Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K weights are multiplied as stored (CPU);
    # None: model_dir's float weights.
    gguf_file: str | None = None
    # `fp8`: quantize the float checkpoint's linears to FP8 at load; other values: the
    # checkpoint's own format (workers/quant_config.py).
    quantization: str = "none"
    # LoRA: device slots (0: off), their rank, and the adapters each rank keeps read on the CPU.
    max_loras: int = 0
    max_lora_rank: int = 16
    max_cpu_loras: int = 0
    # The prefix cache's lower tiers (workers/kv_tiers.py); None: off.
    kv_tiers: KVTierConfig | None = None
    # `fp8`: K/V stored as E4M3 codes with per-layer scales (workers/kv_fp8.py); `auto`: dtype.
    kv_cache_dtype: str = "auto"
    # Floats of each prompt's last hidden state sent to the length probe (0: off;
    # workers/length_features.py).
    length_feature_dim: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        cache_dtype(self.kv_cache_dtype, DTYPES[self.dtype])  # raises on an unknown name
        if self.kv_cache_dtype == "fp8" and not self.device.startswith("cuda"):
            raise ValueError(
                f"kv_cache_dtype: 'fp8' needs a CUDA GPU, this engine runs on {self.device} "
                "(the CPU paged-decode kernel reads float caches only); use 'auto'"
            )


@dataclass(slots=True)
class RequestState:
    """What the runner holds per request between steps."""

    token_ids: list[int]  # prompt followed by the outputs the scheduler has sent back
    block_ids: list[
        int
    ]  # grows by appends; replaced (resumption) only with num_synced_blocks reset
    num_computed_tokens: int
    sampling: SamplingState
    table_row: int = -1  # its row of BlockTableRows, once it has run
    num_synced_blocks: int = 0  # block_ids already written to that row
    # prompt_logprobs: the entries so far (rank 0 only) until they go out with the first token,
    # and how many prompt positions are done (every rank, so all compute the same rows).
    prompt_logprobs: list[TokenLogprobs] | None = None
    num_prompt_logprobs: int = 0
    lora_name: str | None = None  # its LoRA adapter (None: the base model)
    draft_computed: int = 0  # the draft model's KV holds positions [0, draft_computed)


@dataclass(slots=True)
class _Batch:
    """Host-side inputs of one step, requests ordered decodes first."""

    req_ids: list[str] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # computed tokens before the step
    query_lens: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)  # batch rows that sample this step
    pooling_rows: list[int] = field(default_factory=list)  # rows of embedding requests
    pooled: dict[str, list[float]] = field(default_factory=dict)  # their vectors, when complete
    length_features: dict[str, list[float]] = field(default_factory=dict)  # prompts that ended
    # Speculative decoding: the proposed tokens each verify row runs after its last token; such a
    # row samples len(drafts) + 1 positions.
    drafts: dict[str, list[int]] = field(default_factory=dict)


class BlockTableRows:
    """Every running request's block table as one row of a persistent int32 tensor.

    A request's blocks are written once, when they arrive in a SchedulerOutput diff (a decode
    gets a new block every block_size steps); a step selects its requests' rows instead of
    padding each table from a Python list. Rows are recycled when requests finish.
    """

    def __init__(self, max_blocks_per_seq: int, rows: int = 64) -> None:
        self.table = torch.zeros((rows, max_blocks_per_seq), dtype=torch.int32)
        self.free = list(range(rows - 1, -1, -1))

    def sync(self, rid: str, state: RequestState) -> int:
        """Write the blocks of `state` not yet in its row (a row is given on first use); its row."""
        if state.table_row < 0:
            state.table_row, state.num_synced_blocks = self._allocate(), 0
            self.table[state.table_row].zero_()  # padding reads block 0, as padded lists did
        blocks, done = state.block_ids, state.num_synced_blocks
        if len(blocks) > self.table.shape[1]:
            raise ValueError(
                f"block_ids: {rid!r} has {len(blocks)} blocks, more than max_model_len allows"
            )
        if len(blocks) < done:  # replaced without a reset: rewrite the whole row
            done = 0
        if len(blocks) > done:
            self.table[state.table_row, done : len(blocks)] = torch.tensor(
                blocks[done:], dtype=torch.int32
            )
            state.num_synced_blocks = len(blocks)
        return state.table_row

    def release(self, state: RequestState) -> None:
        if state.table_row >= 0:
            self.free.append(state.table_row)
            state.table_row = -1

    def select(self, rows: list[int], width: int) -> torch.Tensor:
        """[len(rows), width] copy of those rows' first `width` entries. Past a row's own blocks: 0
        or blocks it held before a preemption; readers stop at ceil(seq_len / block_size) or
        mask."""
        return self.table[:, :width].index_select(0, torch.tensor(rows, dtype=torch.long))

    def _allocate(self) -> int:
        if not self.free:  # more requests alive than rows: double the rows
            n = self.table.shape[0]
            self.table = torch.cat([self.table, torch.zeros_like(self.table)])
            self.free = list(range(2 * n - 1, n - 1, -1))
        return self.free.pop()


def _keep_freed_memory() -> None:
    """glibc returns large freed blocks to the OS and page-faults them back on the next step;
    activations of a CPU forward are exactly such blocks, so keep them in the heap instead."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum on 64-bit
    libc.mallopt(m_trim_threshold, 1 << 30)


class ModelRunner:
    """Holds the model, the KV cache and request state of one rank."""

    def __init__(self, config: RunnerConfig) -> None:
        self.config = config
        hf_config = AutoConfig.from_pretrained(config.model_dir)
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        if config.process_niceness is not None:
            set_niceness(config.process_niceness)
        if self.device.type == "cpu":
            _keep_freed_memory()
            if config.cpu_threads:
                torch.set_num_threads(config.cpu_threads)
        torch.manual_seed(config.seed)
        t0 = time.perf_counter()
        set_expert_parallel(config.expert_parallel)  # read by the MoE layers as they are built
        self.model = load_model(
            config.model_dir,
            hf_config,
            self.dtype,
            self.device,
            config.max_model_len,
            progress=config.load_progress,
            gguf_file=config.gguf_file,
            quantization=config.quantization,
        )
        logger.info("model loaded in %.1fs", time.perf_counter() - t0)
        self.loras: LoraManager | None = None
        if config.max_loras:
            self.loras = LoraManager(
                self.model,
                hf_config,
                config.max_loras,
                config.max_lora_rank,
                config.max_cpu_loras,
                self.dtype,
                self.device,
            )
        self.layers = self.model.attention_layers()
        self.backend = select_backend(
            self.device,
            config.attention_backend,
            self.dtype,
            head_dim=self.layers[0].head_dim,
            block_size=config.block_size,
        )
        for layer in self.layers:
            layer.backend = self.backend
        if config.kv_cache_dtype == "fp8":
            check_device(self.device, self.backend.name)
        kv_dtype = cache_dtype(config.kv_cache_dtype, self.dtype)
        self.kv_spec = KVCacheSpec.of(self.layers, config.block_size, kv_dtype)
        self.kv_cache: KVCache | None = None
        self.tiers: KVTiers | None = None
        # KV arriving from a prefill engine (workers/kv_transfer.py); set by engine/disagg.py.
        self.kv_receiver: KVReceiver | None = None
        self.sampler = Sampler()
        self.proposer = make_proposer(config.speculative)
        self.is_driver = get_tp_rank() == 0
        self.draft = self._load_draft() if self.is_driver else None  # rank 0 only
        self.draft_pacing = DraftPacing()  # which requests the draft proposes for
        self.requests: dict[str, RequestState] = {}
        self.block_tables = BlockTableRows(
            -(-config.max_model_len // config.block_size), config.max_num_seqs
        )
        self.structured: StructuredDecoding | None = None  # built at the first constrained request
        self.pooler = Pooler()
        self.length_features = (
            LengthFeatures(int(hf_config.hidden_size), config.length_feature_dim, self.device)
            if config.length_feature_dim and self.is_driver
            else None
        )
        self._vocab_size = int(hf_config.vocab_size)
        # At any TP size: NCCL collectives are captured inside the graphs (workers/cuda_graphs.py).
        self.use_graphs = decode_graphs_enabled(
            self.device, config.enforce_eager, self.backend.supports_cuda_graphs
        )
        self.graphs: DecodeGraphs | None = None
        # Verify rows attend as decode rows (workers/verify_rows.py); False: as prefill chunks,
        # the layout before (kept for comparisons: tests and bench/spec_bench.py).
        self.verify_as_decodes = True

    def _load_draft(self) -> DraftModel | None:
        cfg, spec = self.config, self.config.speculative
        if spec is None or spec.method != "draft":
            return None
        if cfg.draft_model_dir is None:
            raise ValueError("speculative.draft_model: the runner got no draft directory")
        t0 = time.perf_counter()
        draft = DraftModel(
            cfg.draft_model_dir,
            cfg.draft_gguf_file,
            self.dtype,
            self.device,
            cfg.block_size,
            cfg.max_model_len,
            cfg.attention_backend,
            spec.num_tokens,
            min(spec.max_batch_size, cfg.max_num_seqs),
        )
        logger.info("draft model loaded in %.1fs", time.perf_counter() - t0)
        return draft

    # ---- KV cache ------------------------------------------------------------------------------
    def determine_num_blocks(self) -> int:
        """Device blocks for the KV cache: from kv_cache_memory_gb on CPU, profiled on CUDA (a
        draft model's blocks share the budget: each block id holds one of each)."""
        if self.device.type != "cuda":
            blocks = cpu_num_blocks(self.kv_spec, self.config.kv_cache_memory_gb)
            return blocks if self.draft is None else self.draft.share(blocks, self.kv_spec)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run()
        torch.cuda.synchronize(self.device)
        blocks = cuda_num_blocks(self.kv_spec, self.device, self.config.gpu_memory_utilization)
        if self.draft is not None:
            blocks = self.draft.share(blocks, self.kv_spec)
        return blocks - 1 if self.use_graphs else blocks  # one block is the graphs' pad block

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
        states = {}
        for i in range(num_seqs):
            blocks = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
            states[f"profile-{i}"] = RequestState([0] * per_seq, blocks, 0, None)
        batch = _Batch()
        for rid, st in states.items():
            self._add_to_batch(batch, rid, st, per_seq)
        saved, self.requests = self.requests, states
        try:
            self._forward(batch)
        finally:
            self.requests = saved
            for st in states.values():
                self.block_tables.release(st)
            for layer in self.layers:  # drop the views so the scratch pool is freed now
                layer.k_cache = layer.v_cache = torch.empty(0)

    def init_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """Allocate the pools, bind them to the attention layers, and capture the decode graphs."""
        pad = (
            1 if self.use_graphs else 0
        )  # a block past the scheduler's pool, for padded graph rows
        self.kv_cache = KVCache(self.kv_spec, num_gpu_blocks + pad, num_cpu_blocks, self.device)
        self.kv_cache.bind(self.layers)
        if self.draft is not None:
            self.draft.init_kv_cache(num_gpu_blocks, num_cpu_blocks)
        if self.config.kv_tiers is not None:
            self.tiers = KVTiers(self.kv_cache, self.config.kv_tiers, get_tp_rank())
        if self.use_graphs:
            cfg = self.config
            self.graphs = DecodeGraphs(
                self.model,
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
        """Apply the step's diffs, copy swapped blocks, run the forward and sample."""
        if self.kv_cache is None:
            raise RuntimeError("execute_model: init_kv_cache() must run first")
        failed = self._update_states(out)
        if self.draft is not None:
            self.draft_pacing.schedule(out)
        if out.lora_loads and self.loras is not None:
            self.loras.load(out.lora_loads)
        transfers, tiers = out.kv_transfers, self.tiers
        if tiers is not None:
            tiers.wait_for_loads()
            if transfers is not None:
                tiers.save(transfers)  # reads blocks that the swaps and the forward overwrite
        self.kv_cache.swap_out(out.blocks_to_swap_out)
        self.kv_cache.swap_in(out.blocks_to_swap_in)
        if self.draft is not None:
            self.draft.swap(out.blocks_to_swap_out, out.blocks_to_swap_in)
        load_failed = self._load_kv(tiers, transfers) if transfers is not None else []
        if out.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput([], [], failed=failed, kv_load_failed=load_failed)
        batch = self._build_batch(out)
        if not batch.req_ids:
            return ModelRunnerOutput([], [], failed=failed, kv_load_failed=load_failed)
        masks = self._start_masks(batch)  # filled by native threads while the forward runs
        logits = self._forward(batch)
        output = self._sample(batch, logits, masks)
        if self.draft is not None:
            output.spec_token_ids = self._propose_draft(self.draft, batch, output.sampled_token_ids)
        if output.spec_token_ids is not None and self.structured is not None:
            self._cut_to_grammar(self.structured, batch, output)
        if self.draft is not None and output.spec_token_ids is not None:
            self.draft_pacing.proposed(batch.req_ids, output.spec_token_ids)
        output.failed.update(failed)
        output.kv_load_failed = load_failed
        output.pooled = batch.pooled
        output.length_features = batch.length_features
        expert_load = getattr(self.model, "expert_rows_per_rank", None)
        if expert_load is not None and self.is_driver:
            output.expert_tokens_per_rank = expert_load()
        return output

    def _load_kv(self, tiers: KVTiers | None, transfers: KVTransfers) -> list[int]:
        """The step's loads: from the lower tiers, then from other engines' transfers."""
        failed = []
        if tiers is not None or transfers.has_tier_copies:
            failed = self._load_tiers(tiers, transfers)
        if transfers.load_remote:
            if self.kv_receiver is None:
                raise RuntimeError("kv_transfers: this runner receives no KV transfers")
            assert self.kv_cache is not None
            remote = self.kv_receiver.load(self.kv_cache, transfers.load_remote)
            if get_tp_world_size() > 1:  # a block that failed on any rank is recomputed on all
                blocks = [b for _, _, b in transfers.load_remote]
                flags = torch.tensor([b in remote for b in blocks], dtype=torch.int32)
                flags = all_reduce(flags.to(self.device)).cpu().tolist()
                remote = [b for b, flag in zip(blocks, flags) if flag]
            failed += remote
        return failed

    def _load_tiers(self, tiers: KVTiers | None, transfers: KVTransfers) -> list[int]:
        """Run the step's loads from the lower tiers; the device blocks that failed on any rank
        (every rank recomputes the same blocks)."""
        if tiers is None:
            raise RuntimeError("kv_transfers: this runner has no KV tiers (kv_tiers is unset)")
        failed = tiers.load(transfers)
        if get_tp_world_size() > 1 and (transfers.load_cpu or transfers.load_disk):
            blocks = [b for _, b, _ in transfers.load_cpu] + [b for _, b in transfers.load_disk]
            flags = torch.tensor([b in failed for b in blocks], dtype=torch.int32)
            flags = all_reduce(flags.to(self.device)).cpu().tolist()
            failed = [b for b, flag in zip(blocks, flags) if flag]
        return failed

    def _update_states(self, out: SchedulerOutput) -> dict[str, str]:
        """Apply the step's diffs; returns the new requests whose sampling state could not be
        built."""
        requests = self.requests
        failed: dict[str, str] = {}
        for rid in out.finished_req_ids:
            state = requests.pop(rid, None)
            if state is not None:
                self.block_tables.release(state)
            if self.structured is not None:
                self.structured.drop(rid)
            self.pooler.drop(rid)
        for rid in out.preempted_req_ids:
            state = requests.get(rid)
            if state is not None:  # its draft_computed holds until it resumes (below)
                state.block_ids, state.num_synced_blocks = [], 0
        for rid, keep in out.truncated_block_tables.items():  # rejected proposals' blocks
            state = requests.get(rid)
            if state is not None:
                del state.block_ids[keep:]
                state.num_synced_blocks = min(state.num_synced_blocks, keep)
        for new in out.scheduled_new_reqs:
            try:
                sampling = SamplingState.create(
                    new.sampling_params,
                    new.prompt_token_ids,
                    self.device,
                    new.output_token_ids,
                    new.eos_token_ids,
                )
                self._start_constraint(new.req_id, new.sampling_params)
            except Exception as exc:
                logger.warning("request %s failed to start: %r", new.req_id, exc)
                failed[new.req_id] = f"sampling state: {exc!r}"
                continue
            if new.req_id in requests:  # sent again in full: its old state's table row is free
                self.block_tables.release(requests[new.req_id])
            requests[new.req_id] = RequestState(
                list(new.prompt_token_ids) + list(new.output_token_ids),
                list(new.block_ids),
                new.num_computed_tokens,
                sampling,
                # A resumed request sent its prompt's entries before.
                prompt_logprobs=(
                    []
                    if new.sampling_params.prompt_logprobs is not None and not new.output_token_ids
                    else None
                ),
                lora_name=new.lora_name,
                # A prefix hit's blocks hold the draft's KV too (workers/draft.py).
                draft_computed=new.num_computed_tokens,
            )
        cached = out.scheduled_cached_reqs
        for rid, resumed, tokens, blocks, computed in zip(
            cached.req_ids,
            cached.resumed,
            cached.new_token_ids,
            cached.new_block_ids,
            cached.num_computed_tokens,
        ):
            state = requests[rid]
            if tokens:
                state.token_ids.extend(tokens)
                num_prompt = len(state.sampling.prompt_token_ids)
                outputs = state.sampling.output_token_ids
                outputs.extend(state.token_ids[num_prompt + len(outputs) :])
            if resumed:
                state.block_ids, state.num_synced_blocks = list(blocks), 0
                # A prefix hit's (full) blocks hold the draft's KV; swapped blocks hold it as far
                # as it had caught up (a row that did not propose lags by a partial block).
                state.draft_computed = min(state.draft_computed, computed)
            else:
                state.block_ids.extend(blocks)
            state.num_computed_tokens = computed
        return failed

    def _build_batch(self, out: SchedulerOutput) -> _Batch:
        batch = _Batch()
        # Decodes, then verify rows, then prefill chunks: the attention backends batch decodes as
        # one block, and a verify row attends as decodes (workers/verify_rows.py).
        scheduled, spec = out.num_scheduled_tokens, out.scheduled_spec_tokens
        order = sorted(scheduled, key=lambda r: 0 if scheduled[r] == 1 else 1 if r in spec else 2)
        for rid in order:
            state = self.requests.get(rid)
            if state is not None:  # absent: it failed to start this step and is being finished
                self._add_to_batch(batch, rid, state, scheduled[rid], spec.get(rid))
        return batch

    def _add_to_batch(
        self, batch: _Batch, rid: str, state: RequestState, n: int, drafts: list[int] | None = None
    ) -> None:
        start = state.num_computed_tokens
        end = start + n - len(drafts or ())
        if end > len(state.token_ids) or (drafts and end != len(state.token_ids)):
            raise ValueError(
                f"num_scheduled_tokens: {rid!r} scheduled past its {len(state.token_ids)} tokens"
            )
        if end == len(state.token_ids):
            batch.sample_rows.append(len(batch.req_ids))
        if state.sampling is not None and state.sampling.params.pooling is not None:
            batch.pooling_rows.append(len(batch.req_ids))
        batch.req_ids.append(rid)
        batch.input_ids.extend(state.token_ids[start:end])
        if drafts:
            batch.input_ids.extend(drafts)
            batch.drafts[rid] = drafts
        batch.starts.append(start)
        batch.query_lens.append(n)

    def _forward(self, batch: _Batch) -> torch.Tensor | None:
        """Run the model on a batch; logits of the sampling rows (rank 0), None elsewhere."""
        dev = self.device
        graphs = self.graphs
        # Verify rows attend as one decode row per token (workers/verify_rows.py).
        verify = [i for i, r in enumerate(batch.req_ids) if r in batch.drafts]
        rows = attention_rows(
            batch.starts, batch.query_lens, verify if self.verify_as_decodes else ()
        )
        offsets = token_offsets(batch.query_lens)
        if self.loras is not None and self._set_lora_batch(batch, self.loras):
            graphs = None  # the captured graphs hold no LoRA path: adapter steps run eagerly
        if (
            graphs is not None
            and rows.all_decodes
            and not batch.pooling_rows
            and rows.num_rows <= graphs.max_batch
        ):
            tables = [self.requests[batch.req_ids[i]].block_ids for i in rows.batch_rows]
            hidden = graphs.run(batch.input_ids, rows.starts, tables)  # a pure-decode step
        else:
            hidden = self._eager_forward(batch, rows)
            if batch.pooling_rows and self.is_driver:
                self._pool(batch, hidden, offsets)
        # A prompt's last chunk may be one token long, like a decode.
        self._prompt_logprobs(batch, hidden, offsets)
        self._length_features(batch, hidden, offsets)
        if not batch.sample_rows:  # only partial prefills this step
            return None
        drafts = batch.drafts
        last = logits_positions(
            offsets, batch.sample_rows, [len(drafts.get(r, ())) for r in batch.req_ids]
        )
        if len(last) < hidden.shape[0]:
            hidden = hidden[torch.tensor(last, dtype=torch.long, device=dev)]
        return self.model.compute_logits(hidden)

    def _eager_forward(self, batch: _Batch, rows: AttentionRows) -> torch.Tensor:
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

    def _set_lora_batch(self, batch: _Batch, loras: LoraManager) -> bool:
        """Tell the LoRA layers each token's adapter slot; True when any row has an adapter."""
        requests = self.requests
        slots = [loras.slot(requests[rid].lora_name) for rid in batch.req_ids]
        return loras.set_batch(slots, batch.query_lens)

    def _pool(self, batch: _Batch, hidden: torch.Tensor, query_start_loc: list[int]) -> None:
        """Embedding requests: pool their rows' hidden states (the vector when a prompt ends)."""
        for row in batch.pooling_rows:
            rid = batch.req_ids[row]
            state = self.requests[rid]
            begin, end = int(query_start_loc[row]), int(query_start_loc[row + 1])
            vector = self.pooler.pool(
                rid,
                state.sampling.params.pooling,
                hidden[begin:end],
                batch.starts[row],
                len(state.sampling.prompt_token_ids),
            )
            if vector is not None:
                batch.pooled[rid] = vector

    def _length_features(self, batch: _Batch, hidden: torch.Tensor, starts: list[int]) -> None:
        """The length probe's features of the prompts that ended this step (rank 0, when on)."""
        extractor = self.length_features
        if extractor is None or not batch.sample_rows:
            return
        ids, requests = batch.req_ids, self.requests
        ended = [
            i
            for i in batch.sample_rows
            if ends_prompt(
                batch.starts[i],
                len(requests[ids[i]].sampling.prompt_token_ids),
                len(requests[ids[i]].token_ids),
            )
        ]
        if ended:
            vectors = extractor.extract(hidden, [int(starts[i + 1]) - 1 for i in ended])
            batch.length_features = {ids[i]: v for i, v in zip(ended, vectors)}

    def _prompt_logprobs(self, batch: _Batch, hidden: torch.Tensor, starts: list[int]) -> None:
        """Entries for the prompt positions this step computed, of the requests that asked."""
        for i, rid in enumerate(batch.req_ids):
            state = self.requests[rid]
            if state.prompt_logprobs is None:
                continue
            num_prompt = len(state.sampling.prompt_token_ids)
            first = max(batch.starts[i], state.num_prompt_logprobs)  # recomputed ones once
            end = min(batch.starts[i] + batch.query_lens[i], num_prompt - 1)
            if end <= first:
                continue
            row = int(starts[i]) + first - batch.starts[i]
            entries = prompt_logprobs(
                self.model.compute_logits,
                hidden[row : row + end - first],
                state.token_ids[first + 1 : end + 1],
                state.sampling.params.prompt_logprobs or 0,
            )
            state.num_prompt_logprobs = end
            if entries is not None:
                state.prompt_logprobs.extend(entries)

    def _start_constraint(self, req_id: str, params: SamplingParams) -> None:
        """A new (or resumed) constrained request gets a fresh matcher; only the sampling rank
        masks."""
        if params.structured is None or not self.is_driver:
            return
        if self.structured is None:
            from workers.structured import GrammarCompiler, StructuredDecoding

            model_dir = self.config.model_dir
            compiler = GrammarCompiler(
                lambda: load_tokenizer(model_dir), self._vocab_size, self.config.grammar_timeout_s
            )
            self.structured = StructuredDecoding(compiler, self.config.grammar_mask_deadline_s)
        self.structured.add(req_id, params.structured)

    def _start_masks(self, batch: _Batch) -> PendingMasks | None:
        if self.structured is None or not self.is_driver or not batch.sample_rows:
            return None
        rids = [batch.req_ids[i] for i in batch.sample_rows]
        return self.structured.start_masks(
            rids,
            [self.requests[r].sampling.output_token_ids for r in rids],
            [batch.drafts.get(r, []) for r in rids],
        )

    def _sample(
        self, batch: _Batch, logits: torch.Tensor | None, masks: PendingMasks | None = None
    ) -> ModelRunnerOutput:
        sampled: list[list[int]] = [[] for _ in batch.req_ids]
        logprobs: list | None = None
        if not self.is_driver or not batch.sample_rows:
            return ModelRunnerOutput(batch.req_ids, sampled)
        rows, states = self._logit_rows(batch)
        failed: dict[str, str] = {}
        unmasked = None
        if masks is not None:
            from workers.structured import apply_masks

            unmasked = logits.float()
            logits = apply_masks(unmasked, masks)
            failed.update(masks.failed)
        try:
            results = [(rows, self.sampler.sample(logits.float(), states, unmasked))]
        except Exception:
            results = self._sample_rows_alone(batch, logits, rows, states, failed, unmasked)
        for rows_of, result in results:
            for row, token in zip(rows_of, result.token_ids):
                sampled[row].append(token)
            if result.logprobs is not None:
                logprobs = logprobs or [None] * len(batch.req_ids)
                for row, lp in zip(rows_of, result.logprobs):
                    if lp is not None:
                        logprobs[row] = (logprobs[row] or []) + [lp]
        if batch.drafts:
            self._keep_accepted(batch, sampled, logprobs, failed)
        if self.config.async_scheduling:
            self._append_sampled(batch, sampled)
        proposals = self._propose(batch, sampled) if self.proposer is not None else None
        output = ModelRunnerOutput(
            batch.req_ids, sampled, logprobs, failed, spec_token_ids=proposals
        )
        for row in batch.sample_rows:
            state = self.requests[batch.req_ids[row]]
            if state.prompt_logprobs is not None and sampled[row]:  # with its first token
                rid = batch.req_ids[row]
                if len(state.prompt_logprobs) == len(state.sampling.prompt_token_ids) - 1:
                    output.prompt_logprobs[rid] = state.prompt_logprobs
                else:  # a position skipped (never expected): fail it rather than answer short
                    output.failed[rid] = "prompt_logprobs: incomplete"
                state.prompt_logprobs = None
        return output

    def _logit_rows(self, batch: _Batch) -> tuple[list[int], list[SamplingState]]:
        """The batch row and the sampling state of each logits row: one per sampling request, and
        one per position of a verify row (spec_verify.position_states)."""
        requests, drafts = self.requests, batch.drafts
        if not drafts:
            return batch.sample_rows, [
                requests[batch.req_ids[i]].sampling for i in batch.sample_rows
            ]
        rows: list[int] = []
        states: list[SamplingState] = []
        for i in batch.sample_rows:
            rid = batch.req_ids[i]
            at = position_states(requests[rid].sampling, drafts.get(rid, []))
            rows.extend([i] * len(at))
            states.extend(at)
        return rows, states

    def _keep_accepted(
        self,
        batch: _Batch,
        sampled: list[list[int]],
        logprobs: list | None,
        failed: dict[str, str],
    ) -> None:
        """Cut each verify row to the run it keeps (spec_verify.accepted_run)."""
        for row, rid in enumerate(batch.req_ids):
            drafts = batch.drafts.get(rid)
            if not drafts or rid in failed:
                continue
            kept = len(accepted_run(sampled[row], drafts))
            del sampled[row][kept:]
            if logprobs is not None and logprobs[row] is not None:
                del logprobs[row][kept:]

    def _propose(self, batch: _Batch, sampled: list[list[int]]) -> list[list[int]]:
        """Proposals to follow each request's new tokens; none for a row that sampled nothing."""
        requests = self.requests
        rows = [i for i, tokens in enumerate(sampled) if tokens]
        proposals: list[list[int]] = [[] for _ in sampled]
        if not rows or self.proposer is None:
            return proposals
        contexts = [requests[batch.req_ids[i]].token_ids + sampled[i] for i in rows]
        for i, proposal in zip(rows, self.proposer.propose(contexts)):
            proposals[i] = proposal
        return proposals

    def _cut_to_grammar(
        self, structured: StructuredDecoding, batch: _Batch, output: ModelRunnerOutput
    ) -> None:
        """Constrained requests' proposals, cut before the first token their grammar rejects
        (workers/grammar_spec.py): such a token could never be accepted."""
        proposals = output.spec_token_ids
        assert proposals is not None
        for i, (rid, new) in enumerate(zip(batch.req_ids, output.sampled_token_ids)):
            if proposals[i] and rid in structured:
                outputs = self.requests[rid].sampling.output_token_ids + new
                proposals[i] = structured.allowed_proposal(rid, outputs, proposals[i])

    def _propose_draft(
        self, draft: DraftModel, batch: _Batch, sampled: list[list[int]]
    ) -> list[list[int]]:
        """The draft catches up with the rows' new tokens and proposes for the rows that sampled
        and are not paused (workers/draft_pacing.py; none at all when more rows ask than may
        speculate; a constrained row's are cut to its grammar afterwards, _cut_to_grammar). A row
        that does not propose catches up through its full blocks only: the rest waits for a
        later step, and every block the prefix cache can register holds the draft's KV."""
        bs, k, requests = self.config.block_size, draft.num_tokens, self.requests
        rows: list[DraftRow] = []
        for i, rid in enumerate(batch.req_ids):
            state, new = requests[rid], sampled[i]
            own_end = batch.starts[i] + batch.query_lens[i] - len(batch.drafts.get(rid, ()))
            start = state.draft_computed
            end = len(state.token_ids) + len(new) if new else own_end
            asks = bool(new) and self.draft_pacing.asks(rid)
            num = min(k, self.config.max_model_len - end) if asks else 0
            tail = state.token_ids[start:] + new
            rows.append(DraftRow(tail, start, end, state.block_ids, num))
        if sum(r.num_proposed > 0 for r in rows) > draft.max_rows:
            for r in rows:
                r.num_proposed = 0
        for r in rows:  # a row that does not propose catches up through full blocks only
            if not r.num_proposed:
                r.end = min(r.end // bs * bs, len(r.block_ids) * bs)
        proposals = draft.propose(rows)
        for rid, r in zip(batch.req_ids, rows):
            state = requests[rid]
            state.draft_computed = max(r.start, min(r.end, len(r.block_ids) * bs))
        return proposals

    def _append_sampled(self, batch: _Batch, sampled: list[list[int]]) -> None:
        """Async scheduling: the next step, already scheduled, decodes from these tokens (the
        scheduler's placeholders), and penalties, seeds and grammar masks read them."""
        for rid, tokens in zip(batch.req_ids, sampled):
            if tokens:
                state = self.requests[rid]
                state.token_ids.extend(tokens)
                state.sampling.output_token_ids.extend(tokens)

    def _sample_rows_alone(
        self,
        batch: _Batch,
        logits: torch.Tensor,
        rows: list[int],
        states: list[SamplingState],
        failed: dict[str, str],
        unmasked: torch.Tensor | None,
    ) -> list[tuple[list[int], SamplerOutput]]:
        """After a failed batched draw: each row on its own, so one request's fault fails it
        alone."""
        results = []
        for i, (row, state) in enumerate(zip(rows, states)):
            try:
                alone = None if unmasked is None else unmasked[i : i + 1]
                results.append(
                    ([row], self.sampler.sample(logits[i : i + 1].float(), [state], alone))
                )
            except Exception as exc:
                rid = batch.req_ids[row]
                logger.warning("request %s failed in the sampler: %r", rid, exc)
                failed[rid] = f"sampler: {exc!r}"
        return results
