"""Constrained decoding with llguidance: compile off the engine thread, mask the constrained rows
only.

Grammars compile on the grammar pool (workers.grammar) and are cached by their text; the engine
thread only submits the work, so a new constrained request's compile overlaps its prefill. Each
request owns a matcher that catches up on its output tokens before every mask, so a request
preempted, swapped, resumed or migrated rebuilds its state from the tokens it already has. Masks
are filled on a background thread (llguidance releases the GIL) while the forward runs, then
applied to the constrained rows' logits in one op. No row constrained: nothing here runs.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from scheduler.structured_output import StructuredOutput
from workers.grammar import (
    DEFAULT_COMPILE_TIMEOUT_S,
    LIMITS,
    first_line,
    run_with_timeout,
    to_grammar,
)

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256


class GrammarCompiler:
    """Per-process: the llguidance tokenizer (built once) and an LRU of compiled matchers by
    text."""

    def __init__(
        self, load_tokenizer: Any, vocab_size: int, timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S
    ) -> None:
        self._load_tokenizer = (
            load_tokenizer  # () -> HF tokenizer; called once, on the grammar pool
        )
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher at the start of the constraint; ValueError naming the field if it
        fails."""
        key = f"{constraint.kind}\0{constraint.spec}"
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                return template.deep_copy()
        template = run_with_timeout(
            lambda: self._compile(constraint), self.timeout_s, constraint.field_name
        )
        with self._lock:
            self._cache[key] = template
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return template.deep_copy()

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._load_tokenizer(), n_vocab=self.vocab_size
                )
            return self._ll_tokenizer

    def _compile(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._tokenizer(), to_grammar(constraint), limits=LIMITS)
        if matcher.is_error():
            raise ValueError(f"{constraint.field_name}: {first_line(matcher.get_error())}")
        return matcher


@dataclass(slots=True)
class _Row:
    matcher: Future  # of an llguidance.LLMatcher, compiled on the grammar pool
    consumed: int = 0  # output tokens the matcher has accepted


@dataclass(slots=True)
class PendingMasks:
    """Bitmasks being filled for some batch rows (positions in the sampled logits)."""

    rows: list[int]
    req_ids: list[str]
    bitmask: torch.Tensor
    future: Future
    failed: dict[str, str] = field(default_factory=dict)  # req id -> why its constraint failed


class StructuredDecoding:
    """The matchers of the constrained requests of one runner."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._rows: dict[str, _Row] = {}
        self._executor = llguidance.LLExecutor()
        self._compiles = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")
        self._masks = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")

    def add(self, req_id: str, constraint: StructuredOutput) -> None:
        """Start compiling a request's matcher; the outputs it already has are consumed at its next
        mask."""
        self._rows[req_id] = _Row(self._compiles.submit(self.compiler.matcher, constraint))

    def drop(self, req_id: str) -> None:
        self._rows.pop(req_id, None)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._rows

    def start_masks(self, req_ids: list[str], outputs: list[list[int]]) -> PendingMasks | None:
        """Start filling the masks of the constrained requests among those sampled (in order), each
        caught up on its outputs first. None when none of them is constrained."""
        positions, rids, rows, new_tokens = [], [], [], []
        for pos, (rid, out) in enumerate(zip(req_ids, outputs)):
            row = self._rows.get(rid)
            if row is None:
                continue
            positions.append(pos)
            rids.append(rid)
            rows.append(row)
            new_tokens.append(
                out[row.consumed :]
            )  # a copy: the runner appends while the mask fills
            row.consumed = len(out)
        if not positions:
            return None
        bitmask = llguidance.torch.allocate_token_bitmask(len(positions), self.compiler.vocab_size)
        pending = PendingMasks(positions, rids, bitmask, Future())
        pending.future = self._masks.submit(self._fill, pending, rows, new_tokens)
        return pending

    def _fill(self, pending: PendingMasks, rows: list[_Row], new_tokens: list[list[int]]) -> None:
        """On the mask thread: wait for each compile, advance, then fill all masks in parallel."""
        ready: list[tuple[Any, int]] = []
        for i, (rid, row, tokens) in enumerate(zip(pending.req_ids, rows, new_tokens)):
            try:
                matcher = row.matcher.result()
                if tokens:
                    matcher.consume_tokens(tokens)
                if matcher.is_error():
                    raise ValueError(
                        f"the output left its constraint: {first_line(matcher.get_error())}"
                    )
            except Exception as exc:
                pending.failed[rid] = f"structured output: {exc}"
                pending.bitmask[i].fill_(
                    -1
                )  # every token allowed: the row is failed, not sampled from
                continue
            ready.append((matcher, i))
        if ready:
            llguidance.torch.fill_next_token_bitmask_par(self._executor, ready, pending.bitmask)


def apply_masks(logits: torch.Tensor, pending: PendingMasks) -> torch.Tensor:
    """Disallowed tokens of the constrained rows to -inf, in one vectorised op. Out of place."""
    pending.future.result()
    vocab = logits.shape[-1]
    bits = pending.bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bits[:, :, None] >> shifts) & 1).bool().view(bits.shape[0], -1)[:, :vocab]
    index = torch.tensor(pending.rows, device=logits.device)
    masked = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, index, masked)
