"""Constrained decoding with llguidance: compile once per process, mask the constrained rows only.

Grammars compile in a thread pool with a time limit and are cached by their text; each request
owns a matcher that catches up on its output tokens before every mask, so a request preempted,
swapped, resumed or migrated rebuilds its state from the tokens it already has. Masks are filled
by llguidance's native threads (the GIL is released) while the forward runs, then applied to the
constrained rows' logits in one op. No row constrained: nothing here runs.
"""
from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from scheduler.structured_output import StructuredOutput

logger = logging.getLogger(__name__)

DEFAULT_COMPILE_TIMEOUT_S = 10.0
MAX_CACHED_GRAMMARS = 256


def to_grammar(constraint: StructuredOutput) -> str:
    """The llguidance grammar (its JSON text) of a constraint."""
    kind, spec = constraint.kind, constraint.spec
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(spec)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        alternatives = " | ".join(json.dumps(c) for c in constraint.choices)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    return llguidance.LLMatcher.grammar_from_lark(spec)


def check_constraint(constraint: StructuredOutput, timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> str:
    """The grammar text of a valid constraint; ValueError naming the field when it is invalid,
    uses an unsupported keyword, or takes longer than timeout_s to check."""
    def check() -> str:
        grammar = to_grammar(constraint)
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error:
            raise ValueError(f"{constraint.field_name}: {error.strip().splitlines()[0]}")
        return grammar
    return _with_timeout(check, timeout_s, constraint.field_name)


_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")


def _with_timeout(fn: Any, timeout_s: float, field_name: str) -> Any:
    future = _POOL.submit(fn)
    try:
        return future.result(timeout=timeout_s)
    except FutureTimeout:
        raise ValueError(f"{field_name}: took longer than {timeout_s:g}s to compile") from None
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - llguidance reports bad grammars as plain exceptions
        raise ValueError(f"{field_name}: {exc}") from None


class GrammarCompiler:
    """Per-process: the llguidance tokenizer (built once) and an LRU of compiled matchers by text."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int,
                 timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def _tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            self._ll_tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size)
        return self._ll_tokenizer

    def matcher(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher at the start of the constraint; ValueError naming the field if it fails."""
        key = f"{constraint.kind}\0{constraint.spec}"
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                return template.deep_copy()
        template = _with_timeout(lambda: self._compile(constraint), self.timeout_s, constraint.field_name)
        with self._lock:
            self._cache[key] = template
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return template.deep_copy()

    def _compile(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._tokenizer(), to_grammar(constraint))
        if matcher.is_error():
            raise ValueError(f"{constraint.field_name}: {matcher.get_error()}")
        return matcher


@dataclass(slots=True)
class _Row:
    matcher: llguidance.LLMatcher
    consumed: int = 0  # output tokens the matcher has accepted


@dataclass(slots=True)
class PendingMasks:
    """Bitmasks being filled for some batch rows (positions in the sampled logits)."""

    rows: list[int]
    bitmask: torch.Tensor
    future: Future | None


class StructuredDecoding:
    """The matchers of the constrained requests of one runner."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._rows: dict[str, _Row] = {}
        self._executor = llguidance.LLExecutor()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")

    def add(self, req_id: str, constraint: StructuredOutput) -> None:
        """Start a request's matcher; the outputs it already has are consumed at its next mask."""
        self._rows[req_id] = _Row(self.compiler.matcher(constraint))

    def drop(self, req_id: str) -> None:
        self._rows.pop(req_id, None)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._rows

    def start_masks(self, req_ids: list[str], outputs: list[list[int]]) -> PendingMasks | None:
        """Catch each constrained request (of those sampled, in order) up on its outputs and start
        filling their masks in the background. None when none of them is constrained."""
        positions, matchers = [], []
        for pos, (rid, out) in enumerate(zip(req_ids, outputs)):
            row = self._rows.get(rid)
            if row is None:
                continue
            if row.consumed < len(out):
                row.matcher.consume_tokens(out[row.consumed:])
                row.consumed = len(out)
            positions.append(pos)
            matchers.append(row.matcher)
        if not positions:
            return None
        bitmask = llguidance.torch.allocate_token_bitmask(len(positions), self.compiler.vocab_size)
        pairs = [(m, i) for i, m in enumerate(matchers)]
        future = self._pool.submit(llguidance.torch.fill_next_token_bitmask_par, self._executor, pairs, bitmask)
        return PendingMasks(positions, bitmask, future)


def apply_masks(logits: torch.Tensor, pending: PendingMasks) -> torch.Tensor:
    """Disallowed tokens of the constrained rows to -inf, in one vectorised op. Out of place."""
    if pending.future is not None:
        pending.future.result()
    vocab = logits.shape[-1]
    bits = pending.bitmask.to(logits.device)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bits[:, :, None] >> shifts) & 1).bool().view(bits.shape[0], -1)[:, :vocab]
    index = torch.tensor(pending.rows, device=logits.device)
    masked = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, index, masked)
