"""Constraints -> llguidance grammars, and their validation with a time limit. No torch.

Both the ingress (to answer a bad schema with a 400 before anything is queued) and the worker
(to compile it against the tokenizer) come through here, so they agree on what a constraint means.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

import llguidance

from scheduler.structured_output import StructuredOutput

DEFAULT_COMPILE_TIMEOUT_S = 10.0

# llguidance meters its own work in "fuel"; these caps make a hostile grammar fail fast inside
# the library instead of running on in a thread that the time limit can only abandon.
LIMITS = llguidance.LLParserLimits(
    initial_lexer_fuel=5_000_000, max_grammar_size=500_000, verbose_errors=False
)

T = TypeVar("T")

# Grammar work runs here: the caller waits at most its time limit, and a grammar that still
# runs past it holds one of these threads, never the event loop or the engine thread.
_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="grammar")


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


def check_constraint(
    constraint: StructuredOutput, timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S
) -> str:
    """The grammar text of a valid constraint; ValueError naming the field when it is invalid,
    uses an unsupported keyword, or takes longer than timeout_s to check."""

    def check() -> str:
        grammar = to_grammar(constraint)
        error = llguidance.LLMatcher.validate_grammar(grammar, limits=LIMITS)
        if error:
            raise ValueError(f"{constraint.field_name}: {first_line(error)}")
        return grammar

    return run_with_timeout(check, timeout_s, constraint.field_name)


def first_line(message: str) -> str:
    """llguidance errors can run to many lines of parser state; the first says what is wrong."""
    lines = message.strip().splitlines()
    return lines[0][:500] if lines else "invalid grammar"


def run_with_timeout(fn: Callable[[], T], timeout_s: float, field_name: str) -> T:
    """fn() on the grammar pool; ValueError naming field_name if it fails or overruns timeout_s."""
    future = _POOL.submit(fn)
    try:
        return future.result(timeout=timeout_s)
    except FutureTimeout:
        raise ValueError(f"{field_name}: took longer than {timeout_s:g}s to compile") from None
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(f"{field_name}: {first_line(str(exc))}") from None
