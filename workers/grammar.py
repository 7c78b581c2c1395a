"""Constraints -> llguidance grammars and matchers, on threads whose stacks fit them. No torch.

The grammar checker (workers.grammar_sandbox, for the ingress and the offline LLM) and the worker
(workers.structured, to compile against the tokenizer and mask) both come through here, so they
agree on what a constraint means and on the limits it runs under.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, TypeVar

import llguidance

from scheduler.structured_output import StructuredOutput
from workers.grammar_bounds import check_bounds

DEFAULT_COMPILE_TIMEOUT_S = 10.0

# llguidance meters its own work in "fuel"; these caps make a hostile grammar fail fast inside
# the library instead of running on in a thread that the time limit can only abandon.
LIMITS = llguidance.LLParserLimits(
    initial_lexer_fuel=5_000_000, max_grammar_size=500_000, verbose_errors=False
)

# llguidance recurses once per rule while it validates and compiles (about 3 KB of stack a
# level): a 3,000-rule chain overflows a default 8 MiB thread stack and kills the process. Within
# the bounds of workers.grammar_bounds the deepest accepted spec needs a few MiB; a 200,000-char
# chain (the spec cap) needs about 60 MiB. The reservation is virtual: only touched pages count.
GRAMMAR_STACK_BYTES = 256 << 20

T = TypeVar("T")


def big_stack_pool(max_workers: int, name: str) -> ThreadPoolExecutor:
    """A thread pool whose threads all run on GRAMMAR_STACK_BYTES stacks, started now (the
    stack size is set only while they are created)."""
    pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name)
    started = threading.Barrier(max_workers + 1)
    with _STACK_SIZE_LOCK:
        previous = threading.stack_size(GRAMMAR_STACK_BYTES)
        try:
            for _ in range(max_workers):
                pool.submit(started.wait)
            started.wait()
        finally:
            threading.stack_size(previous)
    return pool


_STACK_SIZE_LOCK = threading.Lock()


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


def validate(constraint: StructuredOutput) -> str:
    """The grammar text of a constraint within bounds that llguidance accepts; ValueError naming
    the field otherwise. Call it on a big_stack_pool thread."""
    check_bounds(constraint)
    try:
        grammar = to_grammar(constraint)
    except Exception as exc:
        raise ValueError(f"{constraint.field_name}: {first_line(str(exc))}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar, limits=LIMITS)
    if error:
        raise ValueError(f"{constraint.field_name}: {first_line(error)}")
    return grammar


@dataclass(frozen=True, slots=True)
class Template:
    """A compiled matcher at the start of its constraint, and what keeping it costs."""

    matcher: llguidance.LLMatcher
    estimated_bytes: int


# A compiled matcher holds about 75 bytes per character of its llguidance grammar (a 64,000-char
# alternation keeps 4.7 MiB; a 20,000-atom regex or a 50-property schema under 0.1 MiB).
BYTES_PER_GRAMMAR_CHAR = 96
BYTES_PER_TEMPLATE = 64 << 10


def compile_matcher(ll_tokenizer: Any, constraint: StructuredOutput) -> Template:
    """A matcher at the start of the constraint; ValueError naming the field if it fails. Call it
    on a big_stack_pool thread."""
    check_bounds(constraint)
    try:
        grammar = to_grammar(constraint)
    except Exception as exc:
        raise ValueError(f"{constraint.field_name}: {first_line(str(exc))}") from None
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar, limits=LIMITS)
    if matcher.is_error():
        raise ValueError(f"{constraint.field_name}: {first_line(matcher.get_error())}")
    return Template(matcher, BYTES_PER_TEMPLATE + BYTES_PER_GRAMMAR_CHAR * len(grammar))


def first_line(message: str) -> str:
    """llguidance errors can run to many lines of parser state; the first says what is wrong."""
    lines = message.strip().splitlines()
    return lines[0][:500] if lines else "invalid grammar"


def run_with_timeout(
    pool: ThreadPoolExecutor, fn: Callable[[], T], timeout_s: float, field_name: str
) -> T:
    """fn() on `pool`; ValueError naming field_name if it fails or overruns timeout_s."""
    future = pool.submit(fn)
    try:
        return future.result(timeout=timeout_s)
    except FutureTimeout:
        raise ValueError(f"{field_name}: took longer than {timeout_s:g}s to compile") from None
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(f"{field_name}: {first_line(str(exc))}") from None
