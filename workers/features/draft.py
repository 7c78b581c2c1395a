"""A draft model as a runner feature (rank 0 only, workers/draft.py): its KV beside the model's in
the same block ids, swapped with the model's, caught up and proposing after each step's sampling,
paced by what the scheduler ran (workers/draft_pacing.py).

KV that enters the pool by a load (a lower tier's block, or one from a prefill engine) holds the
model's KV only: the tiers and the transfers carry the model's blocks, never the draft's. Such a
block is *stale* for the draft until the draft has recomputed it: every request whose blocks
include one catches the draft up from that block's first position (`DraftRows.start`), in the
same catch-up forward that follows every step. Recomputing is chosen over saving the draft's KV
beside the model's because it needs no second layout in the tiers' files, the transfer payloads or
their checks, and costs one draft prefill over the loaded tokens (the draft is a small fraction of
the model; a wrong draft KV would cost acceptance, never a token, as verification keeps every
output exact).
"""

from __future__ import annotations

import logging
import time

from scheduler.outputs import ModelRunnerOutput, NewRequestData, SchedulerOutput
from workers.draft import DraftModel, DraftRow, ProposerSetup
from workers.draft_pacing import DraftPacing
from workers.features.base import RunnerContext, RunnerFeature
from workers.kv_cache import KVCache, KVCacheSpec
from workers.step_state import Batch, RequestState

logger = logging.getLogger(__name__)


def proposer_setup(ctx: RunnerContext) -> ProposerSetup:
    """What the runner's config asks of a proposer model (the draft's or the MTP layer's)."""
    cfg, spec = ctx.config, ctx.config.speculative
    assert spec is not None
    return ProposerSetup(
        ctx.dtype,
        ctx.device,
        cfg.block_size,
        cfg.max_model_len,
        cfg.attention_backend,
        spec.num_tokens,
        min(spec.max_batch_size, cfg.max_num_seqs),
    )


def load_draft(ctx: RunnerContext) -> DraftModel:
    cfg = ctx.config
    if cfg.draft_model_dir is None:
        raise ValueError("speculative.draft_model: the runner got no draft directory")
    t0 = time.perf_counter()
    draft = DraftModel(cfg.draft_model_dir, cfg.draft_gguf_file, proposer_setup(ctx))
    logger.info("draft model loaded in %.1fs", time.perf_counter() - t0)
    return draft


class DraftFeature(RunnerFeature):
    def __init__(self, ctx: RunnerContext) -> None:
        self.ctx = ctx
        self.draft = load_draft(ctx)
        self.pacing = DraftPacing()  # which requests the draft proposes for
        self.stale: set[int] = set()  # device blocks loaded with the model's KV only

    def share_blocks(self, blocks: int, target: KVCacheSpec) -> int:
        return self.draft.share(blocks, target)

    def init_kv_cache(self, cache: KVCache, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.draft.init_kv_cache(num_gpu_blocks, num_cpu_blocks)

    def start(self, new: NewRequestData, state: RequestState) -> None:
        state.draft_computed = new.num_computed_tokens  # a prefix hit's blocks hold the draft's KV

    def update(self, out: SchedulerOutput) -> None:
        self.pacing.schedule(out)
        cached, requests = out.scheduled_cached_reqs, self.ctx.requests
        for rid, resumed, computed in zip(
            cached.req_ids, cached.resumed, cached.num_computed_tokens
        ):
            if resumed:  # swapped blocks hold its KV as far as it had caught up
                state = requests[rid]
                state.draft_computed = min(state.draft_computed, computed)
        if self.stale:
            self._forget_fresh(out)

    def _forget_fresh(self, out: SchedulerOutput) -> None:
        """Blocks allocated afresh are computed by the model and the draft alike: no longer
        stale (so the set empties even when a loaded block's request never caught up)."""
        bs, cached = self.draft.block_size, out.scheduled_cached_reqs
        for new in out.scheduled_new_reqs:  # past its hits
            self.stale.difference_update(new.block_ids[-(-new.num_computed_tokens // bs) :])
        for resumed, blocks in zip(cached.resumed, cached.new_block_ids):
            if not resumed:  # appended blocks (a resumed table holds hits)
                self.stale.difference_update(blocks)

    def after_copies(self, out: SchedulerOutput) -> list[int]:
        self.draft.swap(out.blocks_to_swap_out, out.blocks_to_swap_in)
        t = out.kv_transfers
        if t is not None:
            self.stale.update(b for _, b, _ in t.load_cpu)
            self.stale.update(b for _, b in t.load_disk)
            self.stale.update(b for _, _, b in t.load_remote)
        return []

    def propose(self, batch: Batch, output: ModelRunnerOutput) -> None:
        output.spec_token_ids = self._propose(batch, output.sampled_token_ids)

    def proposed(self, batch: Batch, output: ModelRunnerOutput) -> None:
        if output.spec_token_ids is not None:
            self.pacing.proposed(batch.req_ids, output.spec_token_ids)

    def _propose(self, batch: Batch, sampled: list[list[int]]) -> list[list[int]]:
        """The draft catches up with the rows' new tokens and proposes for the rows that sampled
        and are not paused (none at all when more rows ask than may speculate). A row that does
        not propose catches up through its full blocks only: the rest waits for a later step,
        and every block the prefix cache can register holds the draft's KV."""
        draft, requests = self.draft, self.ctx.requests
        rows = [self._row(batch, i, sampled[i]) for i in range(len(batch.req_ids))]
        if sum(r.num_proposed > 0 for r in rows) > draft.max_rows:
            for r in rows:
                r.num_proposed = 0
        bs = draft.block_size
        for r in rows:  # a row that does not propose catches up through full blocks only
            if not r.num_proposed:
                r.end = min(r.end // bs * bs, len(r.block_ids) * bs)
        proposals = draft.propose(rows)
        for rid, r in zip(batch.req_ids, rows):
            state = requests[rid]
            state.draft_computed = max(r.start, min(r.end, len(r.block_ids) * bs))
            if self.stale:
                self.stale.difference_update(r.block_ids[: state.draft_computed // bs])
        return proposals

    def _row(self, batch: Batch, i: int, new: list[int]) -> DraftRow:
        rid, cfg = batch.req_ids[i], self.ctx.config
        state = self.ctx.requests[rid]
        own_end = batch.starts[i] + batch.query_lens[i] - len(batch.drafts.get(rid, ()))
        start = self._start(state)
        end = len(state.token_ids) + len(new) if new else own_end
        asks = bool(new) and self.pacing.asks(rid)
        num = min(self.draft.num_tokens, cfg.max_model_len - end) if asks else 0
        return DraftRow(state.token_ids[start:] + new, start, end, state.block_ids, num)

    def _start(self, state: RequestState) -> int:
        """Where the draft's KV of the request stops being valid: its own count, or the first
        stale block's start."""
        bs, done = self.draft.block_size, state.draft_computed
        if self.stale:
            for j, block in enumerate(state.block_ids[: -(-done // bs)]):
                if block in self.stale:
                    return min(done, j * bs)
        return done
