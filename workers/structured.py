"""Constrained decoding with llguidance: compile off the engine thread, mask the constrained rows
only, and never hold the batch past a deadline.

Grammars compile on big-stack grammar threads (workers.grammar) and are cached by their text;
the engine thread only submits the work, so a new constrained request's compile overlaps its
prefill. Each request owns a matcher that catches up on its output tokens before every mask, so
a request preempted, swapped, resumed or migrated rebuilds its state from the tokens it already
has. Each row's mask is filled on a mask thread (llguidance releases the GIL) while the forward
runs; a row whose mask is not ready by the deadline fails alone and the others are sampled. No
row constrained: nothing here runs.

Under speculative decoding a constrained request speculates too (workers.grammar_spec): its
proposals are cut before the first token its grammar rejects, and each position of its verify row
is masked by the grammar's state after the proposed tokens before it, computed on a copy of its
matcher; the matcher itself consumes only the tokens the request keeps.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from scheduler.structured_output import StructuredOutput
from workers.grammar import (
    DEFAULT_COMPILE_TIMEOUT_S,
    Template,
    big_stack_pool,
    compile_matcher,
    first_line,
    run_with_timeout,
)
from workers.grammar_spec import fill_verify_masks, grammar_prefix

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256
MAX_CACHED_GRAMMAR_BYTES = 256 << 20  # estimated (workers.grammar.Template)
DEFAULT_MASK_DEADLINE_S = 1.0
MASK_THREADS = 4


class GrammarCompiler:
    """Per-process: the llguidance tokenizer (built once) and an LRU of compiled matchers by
    text, bounded by count and by their estimated bytes."""

    def __init__(
        self, load_tokenizer: Any, vocab_size: int, timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S
    ) -> None:
        self._load_tokenizer = (
            load_tokenizer  # () -> HF tokenizer; called once, on the grammar pool
        )
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[str, Template] = OrderedDict()
        self.cached_bytes = 0
        self._lock = threading.Lock()
        self._pool = big_stack_pool(2, "grammar-compile")
        self._waiting = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-wait")

    def warm(self) -> None:
        """Build the tokenizer and compile a small grammar now, so that a request's first compile
        pays for neither (workers/grammar_warm.py calls it off the engine thread at start)."""
        self.matcher(StructuredOutput(kind="json_object", field_name="grammar warm-up"))

    def submit(self, constraint: StructuredOutput) -> Future:
        """matcher(constraint), started now: a Future of the matcher or of its ValueError."""
        return self._waiting.submit(self.matcher, constraint)

    def matcher(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher at the start of the constraint; ValueError naming the field if it
        fails."""
        key = f"{constraint.kind}\0{constraint.spec}"
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached.matcher.deep_copy()
        template = run_with_timeout(
            self._pool,
            lambda: compile_matcher(self._tokenizer(), constraint),
            self.timeout_s,
            constraint.field_name,
        )
        with self._lock:
            if key not in self._cache:
                self._cache[key] = template
                self.cached_bytes += template.estimated_bytes
            while len(self._cache) > MAX_CACHED_GRAMMARS or (
                self.cached_bytes > MAX_CACHED_GRAMMAR_BYTES and len(self._cache) > 1
            ):
                _, evicted = self._cache.popitem(last=False)
                self.cached_bytes -= evicted.estimated_bytes
        return template.matcher.deep_copy()

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._load_tokenizer(), n_vocab=self.vocab_size
                )
            return self._ll_tokenizer


@dataclass(slots=True)
class _Row:
    matcher: Future  # of an llguidance.LLMatcher, compiled on the grammar pool
    consumed: int = 0  # output tokens the matcher has accepted
    busy: Future | None = None  # its last mask, while a late one still runs
    after: int | None = None  # the token the constraint starts after (StructuredOutput.after)
    searched: int = 0  # output tokens searched for `after` so far

    def catch_up(self, out: list[int]) -> bool:
        """Whether the constraint applies yet: a row that starts after a token leaves the output
        free (unmasked) until that token is sampled, then consumes only what follows it."""
        if self.after is None:
            return True
        try:
            found = out.index(self.after, self.searched)
        except ValueError:
            self.searched = len(out)
            return False
        self.after, self.consumed = None, found + 1
        return True


@dataclass(slots=True)
class PendingMasks:
    """Bitmasks being filled for some rows of the sampled logits: one row per constrained request
    that samples, or one per position of its verify row (rows of the bitmask: `spans`)."""

    rows: list[int]  # per bitmask row: its row of the sampled logits
    req_ids: list[str]
    bitmask: torch.Tensor
    futures: list[Future]  # one per request: None, or raises why its constraint failed
    compiled: list[Future]  # each request's compile, waited on up to the compile timeout
    spans: list[range]  # each request's rows of the bitmask
    deadline_s: float
    compile_timeout_s: float
    failed: dict[str, str] = field(default_factory=dict)  # req id -> why its constraint failed


class StructuredDecoding:
    """The matchers of the constrained requests of one runner."""

    def __init__(
        self, compiler: GrammarCompiler, mask_deadline_s: float = DEFAULT_MASK_DEADLINE_S
    ) -> None:
        self.compiler = compiler
        self.mask_deadline_s = mask_deadline_s
        self._rows: dict[str, _Row] = {}
        self._masks = big_stack_pool(MASK_THREADS, "grammar-mask")

    def add(self, req_id: str, constraint: StructuredOutput) -> None:
        """Start compiling a request's matcher; the outputs it already has are consumed at its next
        mask."""
        self._rows[req_id] = _Row(self.compiler.submit(constraint), after=constraint.after)

    def drop(self, req_id: str) -> None:
        self._rows.pop(req_id, None)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._rows

    def start_masks(
        self,
        req_ids: list[str],
        outputs: list[list[int]],
        drafts: list[list[int]] | None = None,
    ) -> PendingMasks | None:
        """Start filling the masks of the constrained requests among those sampled (in order), each
        caught up on its outputs first. drafts: each request's proposed tokens, whose verify row
        samples len(drafts) + 1 logits rows, each masked after the drafts before it. None when
        none of them is constrained."""
        drafts = drafts if drafts is not None else [[] for _ in req_ids]
        positions: list[int] = []
        rids, rows, new_tokens, proposed, spans = [], [], [], [], []
        logit_row = 0
        for rid, out, ahead in zip(req_ids, outputs, drafts):
            row = self._rows.get(rid)
            first, logit_row = logit_row, logit_row + len(ahead) + 1
            if row is None or not row.catch_up(out):
                continue
            spans.append(range(len(positions), len(positions) + len(ahead) + 1))
            positions.extend(range(first, logit_row))
            rids.append(rid)
            rows.append(row)
            proposed.append(ahead)
            new_tokens.append(
                out[row.consumed :]
            )  # a copy: the runner appends while the mask fills
            row.consumed = len(out)
        if not positions:
            return None
        bitmask = llguidance.torch.allocate_token_bitmask(len(positions), self.compiler.vocab_size)
        futures = []
        for row, tokens, ahead, span in zip(rows, new_tokens, proposed, spans):
            if row.busy is not None and not row.busy.done():
                futures.append(_failed("its previous mask is still being computed"))
                continue
            row.busy = self._masks.submit(
                _fill_row, row.matcher, tokens, ahead, bitmask, span.start
            )
            futures.append(row.busy)
        return PendingMasks(
            positions,
            rids,
            bitmask,
            futures,
            [row.matcher for row in rows],
            spans,
            self.mask_deadline_s,
            self.compiler.timeout_s,
        )

    def allowed_proposal(self, req_id: str, outputs: list[int], proposal: list[int]) -> list[int]:
        """`proposal` cut before the first token the request's grammar rejects after `outputs`
        (its outputs with the tokens just sampled); [] while its matcher is busy or failed.
        Unconstrained requests keep their proposals. The matcher is not advanced."""
        row = self._rows.get(req_id)
        if row is None or not proposal:
            return proposal
        if row.after is not None:  # still free: its first step may not be a marker's
            try:
                found = outputs.index(row.after, row.searched)
            except ValueError:
                return proposal[: proposal.index(row.after)] if row.after in proposal else proposal
            tokens = outputs[found + 1 :]
        else:
            tokens = outputs[row.consumed :]
        busy = row.busy
        if not row.matcher.done() or row.matcher.exception() is not None:
            return []
        if busy is not None and (not busy.done() or busy.exception() is not None):
            return []
        ahead = row.matcher.result().deep_copy()
        return proposal[: grammar_prefix(ahead, tokens, proposal)]


def _failed(why: str) -> Future:
    future: Future = Future()
    future.set_exception(ValueError(why))
    return future


def _fill_row(
    compiled: Future, tokens: list[int], drafts: list[int], bitmask: torch.Tensor, first: int
) -> None:
    """On a mask thread: wait for the request's compile, advance it over its new outputs, fill
    its mask (one per verify position when drafts are proposed)."""
    matcher = compiled.result()
    if tokens:
        matcher.consume_tokens(tokens)
    if matcher.is_error():
        raise ValueError(f"the output left its constraint: {first_line(matcher.get_error())}")
    fill_verify_masks(matcher, drafts, bitmask, first)


def apply_masks(logits: torch.Tensor, pending: PendingMasks) -> torch.Tensor:
    """Disallowed tokens of the constrained rows to -inf, in one vectorised op. Out of place.

    Waits for the masks up to their deadline (a row still compiling gets up to the compile
    timeout: the ingress proved its compile fits in that); a late or failed row is recorded in
    `pending.failed` and left unmasked, since it is failed rather than sampled from."""
    _, late = wait(pending.futures, timeout=pending.deadline_s)
    compiling = [f for f, c in zip(pending.futures, pending.compiled) if f in late and not c.done()]
    if compiling:
        wait(compiling, timeout=pending.compile_timeout_s)
    for i, (rid, future) in enumerate(zip(pending.req_ids, pending.futures)):
        why = _why_failed(future, pending.deadline_s)
        if why is not None:
            pending.failed[rid] = f"structured output: {why}"
            span = pending.spans[i]
            pending.bitmask[span.start : span.stop].fill_(-1)
    vocab = logits.shape[-1]
    # A copy: a late row's thread may still write its (failed) row.
    bits = pending.bitmask.to(logits.device, copy=True)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bits[:, :, None] >> shifts) & 1).bool().view(bits.shape[0], -1)[:, :vocab]
    index = torch.tensor(pending.rows, device=logits.device)
    masked = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, index, masked)


def _why_failed(future: Future, deadline_s: float) -> str | None:
    if not future.done():
        return f"its mask took longer than {deadline_s:g}s"
    error = future.exception()
    return None if error is None else str(error)
