"""A runner's per-request state and the host-side inputs of one step: RequestState, Batch and the
persistent block-table rows."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from scheduler.outputs import CachedRequestData, SchedulerOutput, TokenLogprobs
from workers.sampler import SamplingState


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


def apply_cached(cached: CachedRequestData, requests: dict[str, RequestState]) -> None:
    """A step's diff of requests the runner holds: their new tokens (also the sampling state's
    outputs), new blocks (the whole table when resumed) and computed-token counts."""
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
        else:
            state.block_ids.extend(blocks)
        state.num_computed_tokens = computed


@dataclass(slots=True)
class Batch:
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


def build_batch(out: SchedulerOutput, requests: dict[str, RequestState]) -> Batch:
    """The step's scheduled requests as one batch."""
    batch = Batch()
    # Decodes, then verify rows, then prefill chunks: the attention backends batch decodes as
    # one block, and a verify row attends as decodes (workers/verify_rows.py).
    scheduled, spec = out.num_scheduled_tokens, out.scheduled_spec_tokens
    order = sorted(scheduled, key=lambda r: 0 if scheduled[r] == 1 else 1 if r in spec else 2)
    for rid in order:
        state = requests.get(rid)
        if state is not None:  # absent: it failed to start this step and is being finished
            add_to_batch(batch, rid, state, scheduled[rid], spec.get(rid))
    return batch


def add_to_batch(
    batch: Batch, rid: str, state: RequestState, n: int, drafts: list[int] | None = None
) -> None:
    start = state.num_computed_tokens
    end = start + n - len(drafts or ())
    if end > len(state.token_ids) or (drafts and end != len(state.token_ids)):
        raise ValueError(
            f"num_scheduled_tokens: {rid!r} scheduled past its {len(state.token_ids)} tokens"
        )
    if end == len(state.token_ids):
        batch.sample_rows.append(len(batch.req_ids))
    batch.req_ids.append(rid)
    batch.input_ids.extend(state.token_ids[start:end])
    if drafts:
        batch.input_ids.extend(drafts)
        batch.drafts[rid] = drafts
    batch.starts.append(start)
    batch.query_lens.append(n)
