"""The draft-model proposer: a smaller model with the target's vocabulary proposes k tokens a step.

Its KV cache is paged by the target's own block ids. Each block id indexes one block of the
target's pool and one of the draft's (a separate set of tensors, of the draft's shape), so the
scheduler needs no second allocator: whatever it does to a block (allocate, free, share as a
prefix hit, swap to the CPU pool and back) it does to both. This holds because the draft runs over
every token the target computes, prefill chunks included: after each step the draft's KV is valid
for at least as many positions as the target's (`RequestState.draft_computed`), so a block the
prefix cache registers holds the draft's KV of the same tokens too, and a block swapped back holds
it as well (the runner swaps the draft's blocks with the target's). A block that comes in by a load
(a lower tier's, or one sent by a prefill engine) holds the target's KV only; the draft recomputes
its own over it (workers/features/draft.py).

Each step, after the target has sampled, `propose` runs k forwards of the draft:
1. a catch-up over each request's tokens the draft has not seen (what the target computed this
   step, the accepted proposals, and the token just sampled), for every row of the batch, so the
   draft's KV keeps up; its last logits give the first proposed token of the proposing rows;
2. k - 1 one-token forwards over the proposing rows, each feeding the token proposed last.
Proposals are greedy (the draft's argmax): a point mass, which spec_verify's verification keeps
exact. Proposed tokens' KV lands past the accepted positions; a later catch-up overwrites it.

Positions past a request's allocated blocks (the token just sampled and the proposed ones; the
scheduler allocates the next step's slots only in the next step) are written to scratch blocks
past the scheduler's pool, a few per proposing row. What lands there is computed again by the
next catch-up, into the blocks the scheduler has allocated by then.

Under tensor parallelism the draft runs whole on rank 0 (`single_rank`): the proposals already
travel back in ModelRunnerOutput.spec_token_ids and reach every rank in the next SchedulerOutput,
so the other ranks need neither its weights nor its KV, and its small forwards pay no all-reduce.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer

from workers.kv_cache import KVCache, KVCacheSpec
from workers.layers.attention import AttentionMetadata
from workers.layers.mla import bind_backend
from workers.loader import load_model
from workers.model_files import context_limit_of, resolve_model
from workers.parallel import single_rank

logger = logging.getLogger(__name__)

FIELD = "speculative.draft_model"


def check_draft_model(
    draft_model: str, cache_dir: str, model_dir: str, vocab_size: int, max_model_len: int
) -> str:
    """The draft's HF directory, once it is known to fit the model in model_dir: the same
    vocabulary size and tokenizer, and positions for max_model_len tokens. ValueError naming
    speculative.draft_model otherwise."""
    try:
        draft_dir = resolve_model(draft_model, cache_dir)
    except (ValueError, OSError) as exc:
        raise ValueError(f"{FIELD}: {exc}") from None
    config = AutoConfig.from_pretrained(draft_dir)
    if int(config.vocab_size) != vocab_size:
        raise ValueError(
            f"{FIELD}: the draft's vocabulary has {config.vocab_size} tokens, the model's "
            f"{vocab_size}; a draft must share the model's tokenizer"
        )
    limit = context_limit_of(config)
    if limit is not None and limit < max_model_len:
        raise ValueError(
            f"{FIELD}: the draft's context is {limit} tokens, shorter than max_model_len="
            f"{max_model_len}; lower max_model_len or use a draft with a longer context"
        )
    if draft_dir != model_dir:
        ours, theirs = (
            AutoTokenizer.from_pretrained(model_dir),
            AutoTokenizer.from_pretrained(draft_dir),
        )
        if ours.get_vocab() != theirs.get_vocab():
            raise ValueError(
                f"{FIELD}: the draft's tokenizer maps ids to other tokens than the model's; a "
                "draft must share the model's tokenizer"
            )
    return draft_dir


@dataclass(frozen=True, slots=True)
class ProposerSetup:
    """What a proposer model (a draft model, an MTP layer) is built for, beside its weights: the
    target's dtype, device, block size, context and attention backend, and the speculation's
    size (workers/features/draft.py `proposer_setup` reads it from the runner's config)."""

    dtype: torch.dtype
    device: torch.device
    block_size: int
    max_model_len: int
    attention_backend: str
    num_tokens: int  # tokens proposed per step
    max_rows: int  # rows that may propose in one step


@dataclass(slots=True)
class DraftRow:
    """One request of a step, as the draft sees it."""

    tokens: list[int]  # the request's tokens from position `start` on (what this step sampled
    # included)
    start: int  # the draft's KV holds positions [0, start)
    end: int  # feed positions [start, end)
    block_ids: list[int]  # the request's blocks (the target's ids)
    num_proposed: int  # tokens to propose after token_ids[end - 1] (0: catch up only)


class DraftModel:
    """Rank 0's draft model, its paged KV, and the proposal chain."""

    def __init__(self, model_dir: str, gguf_file: str | None, setup: ProposerSetup) -> None:
        with single_rank():
            hf_config = AutoConfig.from_pretrained(model_dir)
            dtype, device, max_len = setup.dtype, setup.device, setup.max_model_len
            model = load_model(model_dir, hf_config, dtype, device, max_len, False, gguf_file)
        self._bind(model, setup)

    def _bind(self, model: Any, setup: ProposerSetup) -> None:
        """Hold a built proposer model: its attention layers bound to the backend, its KV spec
        (the KV cache comes with init_kv_cache)."""
        self.model, self.device, self.block_size = model, setup.device, setup.block_size
        self.max_model_len = setup.max_model_len
        self.num_tokens, self.max_rows = setup.num_tokens, setup.max_rows
        # Blocks past the allocated ones one row may need: its last token's and k proposed.
        self.scratch_per_row = setup.num_tokens // setup.block_size + 2
        self.layers = self.model.attention_layers()
        # The target's rule, MLA's included (workers/layers/mla.py): one function for both.
        self.backend = bind_backend(
            self.layers, setup.device, setup.attention_backend, setup.dtype, setup.block_size
        )
        self.kv_spec = KVCacheSpec.of(self.layers, setup.block_size, setup.dtype)
        self.kv_cache: KVCache | None = None
        self.num_blocks = 0  # the scheduler's pool; scratch blocks follow it

    def share(self, blocks: int, target: KVCacheSpec) -> int:
        """Of `blocks` target blocks' memory, the block ids that fit once each also holds a draft
        block (and the scratch blocks are set aside)."""
        total = blocks * target.block_bytes - self.max_rows * self.scratch_per_row * (
            self.kv_spec.block_bytes
        )
        return max(total // (target.block_bytes + self.kv_spec.block_bytes), 0)

    def init_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.num_blocks = num_gpu_blocks
        scratch = self.max_rows * self.scratch_per_row
        self.kv_cache = KVCache(self.kv_spec, num_gpu_blocks + scratch, num_cpu_blocks, self.device)
        self.kv_cache.bind(self.layers)

    def swap(self, out_pairs: list[tuple[int, int]], in_pairs: list[tuple[int, int]]) -> None:
        """The scheduler's swap copies, applied to the draft's blocks too."""
        if self.kv_cache is not None:
            self.kv_cache.swap_out(out_pairs)
            self.kv_cache.swap_in(in_pairs)

    def propose(self, rows: list[DraftRow]) -> list[list[int]]:
        """Catch every row up, then propose for the rows that ask (at most max_rows); per row, its
        proposal. A row that does not propose must end within its blocks."""
        proposals: list[list[int]] = [[] for _ in rows]
        ask = [i for i, r in enumerate(rows) if r.num_proposed > 0]
        if len(ask) > self.max_rows:
            raise ValueError(f"num_proposed: {len(ask)} rows propose, at most {self.max_rows} may")
        tables = self._tables(rows, ask)
        feed = [i for i, r in enumerate(rows) if r.end > r.start]
        if not feed:
            return proposals
        feed.sort(key=lambda i: rows[i].end - rows[i].start != 1)  # one-token rows first
        tokens = [t for i in feed for t in rows[i].tokens[: rows[i].end - rows[i].start]]
        first = self._forward(
            tokens,
            [rows[i].start for i in feed],
            [rows[i].end - rows[i].start for i in feed],
            tables[feed],
        )
        by_row = dict(zip(feed, first))
        for i in ask:
            if i in by_row:
                proposals[i].append(by_row[i])
        chain = [i for i in ask if i in by_row]
        for j in range(1, self.num_tokens):
            chain = [i for i in chain if rows[i].num_proposed > j]
            if not chain:
                break
            nxt = self._forward(
                [proposals[i][-1] for i in chain],
                [rows[i].end - 1 + j for i in chain],
                [1] * len(chain),
                tables[chain],
            )
            for i, token in zip(chain, nxt):
                proposals[i].append(token)
        return proposals

    def _tables(self, rows: list[DraftRow], ask: list[int]) -> torch.Tensor:
        """[len(rows), width] block tables: each row's blocks, then scratch blocks for the
        positions past them that a proposing row writes."""
        bs = self.block_size
        tables = [list(r.block_ids) for r in rows]
        for r in rows:
            if not r.num_proposed and r.end > len(r.block_ids) * bs:
                raise ValueError(f"end: {r.end} is past the row's {len(r.block_ids)} blocks")
        for n, i in enumerate(ask):
            r = rows[i]
            last = r.end - 1 + r.num_proposed - 1  # the last position the chain writes
            missing = last // bs + 1 - len(r.block_ids)
            if missing > self.scratch_per_row:
                raise ValueError(
                    f"block_ids: a proposing row needs {missing} blocks past its own, more than "
                    f"the {self.scratch_per_row} scratch blocks it has"
                )
            base = self.num_blocks + n * self.scratch_per_row
            tables[i].extend(range(base, base + max(missing, 0)))
        width = max(max((len(t) for t in tables), default=1), 1)
        return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)

    def _inputs(
        self, tokens: list[int], starts: list[int], query_lens: list[int], tables: torch.Tensor
    ) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A proposer forward's metadata (prepared for the backend), positions and input ids of
        rows that feed query_lens[i] tokens from starts[i], and each row's last token index."""
        dev = self.device
        width = -(-max(s + n for s, n in zip(starts, query_lens)) // self.block_size)
        meta, positions = AttentionMetadata.from_tables(
            starts, query_lens, tables[:, :width].contiguous(), self.block_size, dev
        )
        self.backend.prepare(meta)
        input_ids = torch.tensor(tokens, dtype=torch.long).to(dev, non_blocking=True)
        last = torch.tensor(meta.query_start_loc_cpu[1:], dtype=torch.long, device=dev) - 1
        return meta, positions, input_ids, last

    def _forward(
        self, tokens: list[int], starts: list[int], query_lens: list[int], tables: torch.Tensor
    ) -> list[int]:
        """The draft's greedy token after each row's last query token."""
        meta, positions, input_ids, last = self._inputs(tokens, starts, query_lens, tables)
        with single_rank():
            hidden = self.model(input_ids, positions, meta)
            logits = self.model.compute_logits(hidden[last])
        assert logits is not None  # rank 0 of 1 holds the whole vocabulary
        return logits.argmax(dim=-1).tolist()
