"""The MTP proposer as a runner feature (rank 0 only, workers/mtp.py): its KV beside the model's in
the same block ids, swapped with the model's; after each forward it keeps the step's hidden states,
and after sampling it catches every row up over the positions the model computed and proposes for
the rows that sampled, paced as a draft model is (workers/draft_pacing.py).

A block that enters the pool by a load (a lower tier's, or one from a prefill engine) holds the
model's KV only, and the hidden states that would rebuild the MTP's are gone: the MTP attends to
whatever that block's MTP half holds. That can cost acceptance on such a request, never a token:
verification keeps every output exact.
"""

from __future__ import annotations

import logging
import time

import torch

from scheduler.outputs import ModelRunnerOutput, NewRequestData, SchedulerOutput
from workers.draft_pacing import DraftPacing
from workers.features.base import RunnerContext, RunnerFeature
from workers.features.draft import proposer_setup
from workers.kv_cache import KVCache, KVCacheSpec
from workers.mtp import MTPModel, MTPRow
from workers.step_state import Batch, RequestState

logger = logging.getLogger(__name__)


def load_mtp(ctx: RunnerContext) -> MTPModel:
    t0 = time.perf_counter()
    mtp = MTPModel(ctx.config.model_dir, proposer_setup(ctx))
    logger.info("MTP layer loaded in %.1fs", time.perf_counter() - t0)
    return mtp


class MTPFeature(RunnerFeature):
    def __init__(self, ctx: RunnerContext) -> None:
        self.ctx = ctx
        self.mtp = load_mtp(ctx)
        self.pacing = DraftPacing()
        self.hidden: torch.Tensor | None = None  # the step's, in batch token order
        self.offsets: list[int] = []

    def share_blocks(self, blocks: int, target: KVCacheSpec) -> int:
        return self.mtp.share(blocks, target)

    def init_kv_cache(self, cache: KVCache, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.mtp.init_kv_cache(num_gpu_blocks, num_cpu_blocks)

    def start(self, new: NewRequestData, state: RequestState) -> None:
        state.draft_computed = new.num_computed_tokens  # a prefix hit's blocks hold its KV

    def update(self, out: SchedulerOutput) -> None:
        self.pacing.schedule(out)

    def after_copies(self, out: SchedulerOutput) -> list[int]:
        self.mtp.swap(out.blocks_to_swap_out, out.blocks_to_swap_in)
        return []

    def after_forward(self, batch: Batch, hidden: torch.Tensor, offsets: list[int]) -> None:
        self.hidden, self.offsets = hidden, offsets

    def propose(self, batch: Batch, output: ModelRunnerOutput) -> None:
        rows = [self._row(batch, i, output.sampled_token_ids[i]) for i in range(len(batch.req_ids))]
        if sum(r.num_proposed > 0 for r in rows) > self.mtp.max_rows:
            for r in rows:
                r.num_proposed = 0
        output.spec_token_ids = self.mtp.propose_mtp(rows)
        for rid, r in zip(batch.req_ids, rows):
            self.ctx.requests[rid].draft_computed = r.end
        self.hidden = None

    def proposed(self, batch: Batch, output: ModelRunnerOutput) -> None:
        if output.spec_token_ids is not None:
            self.pacing.proposed(batch.req_ids, output.spec_token_ids)

    def _row(self, batch: Batch, i: int, new: list[int]) -> MTPRow:
        """Positions [start, end) the model computed this step and kept (a verify row's accepted
        run), fed with the token after each; a gap before the step (none in a normal run) is
        skipped: its KV then costs acceptance only."""
        rid, cfg = batch.req_ids[i], self.ctx.config
        state = self.ctx.requests[rid]
        first = batch.starts[i]
        own_end = first + batch.query_lens[i] - len(batch.drafts.get(rid, ()))
        end = len(state.token_ids) + len(new) - 1 if new else own_end
        start = min(max(state.draft_computed, first), end)
        known = state.token_ids + new
        assert self.hidden is not None
        lo = self.offsets[i] + start - first
        hidden = self.hidden[lo : lo + end - start]
        asks = bool(new) and self.pacing.asks(rid)
        num = min(self.mtp.num_tokens, cfg.max_model_len - end - 1) if asks else 0
        return MTPRow(known[start + 1 : end + 1], hidden, start, end, state.block_ids, max(num, 0))
