"""Verify rows as decode rows: how a step's tokens are laid out for attention.

A verify row runs a request's last token and its k proposed tokens: k + 1 query tokens at
positions p .. p + k over the request's cached context. Attention-wise that is k + 1 decodes of
the same request, the i-th with one query token at position p + i and a context of p + i + 1
tokens read through the request's block table: every layer writes the step's K/V to their slots
before it attends (workers/layers/attention.py), so row i finds the proposed tokens before it in
the cache. Laid out so, a verify step is a pure-decode step: it runs through the backends'
paged-decode kernels (the CPU C++ kernel, the Triton kernel) instead of the prefill path, and
through the captured decode graphs (workers/cuda_graphs.py) when its rows fit the largest one.

The token order is the batch's own (the rows of a verify row are its tokens, in order), so hidden
state t is token t either way and the logits rows and prompt-logprob rows do not move.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from scheduler.speculative import SpeculativeConfig

# The most decode rows graphs are captured for when speculation is on: past this, verify steps of
# many requests run eagerly (still through the decode kernels) rather than capture ever more.
MAX_SPEC_GRAPH_ROWS = 512


@dataclass(slots=True)
class AttentionRows:
    """One entry per attention row: the batch row it comes from, its first position, its query
    length. Rows with one query token (decodes, and every position of a verify row) come first."""

    batch_rows: list[int]
    starts: list[int]
    query_lens: list[int]

    @property
    def all_decodes(self) -> bool:
        return all(n == 1 for n in self.query_lens)

    @property
    def num_rows(self) -> int:
        return len(self.query_lens)


def attention_rows(
    starts: Sequence[int], query_lens: Sequence[int], verify: Collection[int]
) -> AttentionRows:
    """Batch row i computes query_lens[i] tokens from position starts[i]; the rows in `verify`
    become one decode row per token. The batch must order its one-token rows and verify rows
    before its other rows (workers/runner.py: _build_batch), so the decode rows lead."""
    rows = AttentionRows([], [], [])
    for i, (start, n) in enumerate(zip(starts, query_lens)):
        if n > 1 and i in verify:
            rows.batch_rows.extend([i] * n)
            rows.starts.extend(range(start, start + n))
            rows.query_lens.extend([1] * n)
        else:
            rows.batch_rows.append(i)
            rows.starts.append(start)
            rows.query_lens.append(n)
    return rows


def token_offsets(query_lens: Sequence[int]) -> list[int]:
    """Where each batch row's tokens start in the flattened batch, and the total at the end."""
    offsets = [0]
    for n in query_lens:
        offsets.append(offsets[-1] + n)
    return offsets


def logits_positions(
    offsets: Sequence[int], sample_rows: Sequence[int], num_drafts: Sequence[int]
) -> list[int]:
    """The flattened tokens whose logits are sampled: each sampling row's last token, and for a
    verify row (num_drafts[i] proposed tokens) its last k + 1 tokens, the last own token and
    every proposed one."""
    return [
        pos
        for i in sample_rows
        for pos in range(offsets[i + 1] - 1 - num_drafts[i], offsets[i + 1])
    ]


def graph_batch_size(
    max_num_seqs: int, max_num_batched_tokens: int, spec: SpeculativeConfig | None
) -> int:
    """Decode rows to capture graphs for: max_num_seqs, or with speculation the rows of a step
    whose every request verifies its most proposed tokens (only steps of at most
    spec.max_batch_size running requests speculate), within the token budget and
    MAX_SPEC_GRAPH_ROWS."""
    if spec is None:
        return max_num_seqs
    verify_rows = min(max_num_seqs, spec.max_batch_size) * (spec.proposal_length + 1)
    return max(max_num_seqs, min(verify_rows, max_num_batched_tokens, MAX_SPEC_GRAPH_ROWS))
