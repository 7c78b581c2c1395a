"""Untrusted grammar work cannot crash, stall or exhaust the process that asks for it.

Bounds refuse the shapes that made llguidance overflow a stack (thousands of chained rules or
`$ref`s) or build a million-state regex (`a{1000}{1000}`) before any native call; what is
accepted runs on threads whose stacks fit it; the ingress's check runs in a child process under a
time and an address-space limit; and in the engine a late mask fails its own row, not the batch.
"""

from __future__ import annotations

import json
import math
import re
import time

import llguidance
import llguidance.hf
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from scheduler.sampling_params import SamplingParams
from scheduler.structured_output import StructuredOutput
from workers import grammar_bounds
from workers.grammar import big_stack_pool, compile_matcher, validate
from workers.grammar_bounds import (
    MAX_GRAMMAR_RULES,
    MAX_REGEX_EXPANSION,
    MAX_SCHEMA_DEPTH,
    check_bounds,
    regex_expansion,
)
from workers.grammar_sandbox import GrammarSandbox, TokenizerSpec
from workers.model_files import default_model_path, load_tokenizer
from workers.structured import GrammarCompiler, StructuredDecoding, apply_masks


def rule_chain(links: int) -> StructuredOutput:
    rules = "".join(f"r{i}: r{i + 1}\n" for i in range(links))
    return StructuredOutput("grammar", f'start: r0\n{rules}r{links}: "x"\n')


def ref_chain(links: int) -> StructuredOutput:
    defs: dict = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(links)}
    defs[f"d{links}"] = {"type": "string"}
    return StructuredOutput.json_schema({"$ref": "#/$defs/d0", "$defs": defs})


# ---- bounds, before any native call -------------------------------------------------------------
@pytest.mark.parametrize(
    "constraint, message",
    [
        (rule_chain(3_000), "3002 rules"),
        (ref_chain(3_000), "3001 definitions"),
        (ref_chain(MAX_SCHEMA_DEPTH + 5), "\\$ref chain is deeper"),
        (StructuredOutput("regex", "a{1000}{1000}"), "expands past"),
        (StructuredOutput("regex", "(ab|c[de]{100}){1000}"), "expands past"),
        (StructuredOutput("regex", "a{9999999999}"), "repetition count"),
        (StructuredOutput.json_schema({"type": "string", "pattern": "x{300}{300}"}), "expands"),
        (StructuredOutput("grammar", "start: /a{1000}{1000}/"), "expands past"),
        (StructuredOutput("grammar", 'start: "a"~150000'), "repetition count"),
    ],
)
def test_specs_past_the_bounds_are_refused_naming_the_field(constraint, message):
    with pytest.raises(ValueError, match=f"^{re.escape(constraint.field_name)}: .*{message}"):
        check_bounds(constraint)


def test_a_recursive_schema_is_as_deep_as_one_unrolling():
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            }
        },
        "$ref": "#/$defs/node",
    }
    check_bounds(StructuredOutput.json_schema(tree))


@given(
    atoms=st.lists(
        st.tuples(st.sampled_from(["a", "[a-z]", "\\d", "(xy|z)"]), st.integers(1, 40)),
        min_size=1,
        max_size=6,
    ),
    outer=st.integers(1, 30),
)
def test_expansion_counts_what_the_repetitions_write_out(atoms, outer):
    size = {"a": 1, "[a-z]": 1, "\\d": 1, "(xy|z)": 3}
    body = "".join(f"{atom}{{{count}}}" for atom, count in atoms)
    expected = outer * sum(size[atom] * count for atom, count in atoms)
    assert regex_expansion(f"({body}){{{outer}}}", "f") == expected


# ---- what is accepted fits the grammar threads --------------------------------------------------
@pytest.fixture(scope="module")
def ll_tokenizer():
    return llguidance.hf.from_tokenizer(load_tokenizer(str(default_model_path())))


@pytest.mark.parametrize(
    "constraint",
    [
        rule_chain(MAX_GRAMMAR_RULES - 2),
        ref_chain(MAX_SCHEMA_DEPTH - 1),
        StructuredOutput("regex", f"a{{{MAX_REGEX_EXPANSION}}}"),
    ],
    ids=["deepest-rule-chain", "deepest-ref-chain", "widest-regex"],
)
def test_the_largest_accepted_specs_validate_compile_and_mask_on_grammar_threads(
    constraint, ll_tokenizer
):
    def whole_check() -> bytes:
        validate(constraint)
        return compile_matcher(ll_tokenizer, constraint).matcher.compute_bitmask()

    assert any(big_stack_pool(1, "test").submit(whole_check).result())


# ---- the checker process ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer_spec():
    return TokenizerSpec.of(load_tokenizer(str(default_model_path())))


def test_the_checker_answers_a_good_spec_and_names_the_field_of_a_bad_one(tokenizer_spec):
    sandbox = GrammarSandbox(tokenizer_spec)
    try:
        good = StructuredOutput.json_schema({"type": "object"})
        assert sandbox.check(good) == good
        bad = StructuredOutput("regex", "((", "structured_outputs.regex")
        with pytest.raises(ValueError, match="^structured_outputs.regex: "):
            sandbox.check(bad)
    finally:
        sandbox.close()


def test_a_check_past_its_memory_budget_costs_the_child_not_the_caller(tokenizer_spec):
    sandbox = GrammarSandbox(tokenizer_spec, processes=1, memory_mb=1)
    try:
        long_literal = StructuredOutput("grammar", 'start: "' + "ab" * 95_000 + '"')
        with pytest.raises(ValueError, match="memory and stack limits"):
            sandbox.check(long_literal)
        assert not sandbox._children  # the dead child was discarded, the caller lives on
    finally:
        sandbox.close()


def test_a_check_past_its_time_limit_is_a_400_and_the_child_is_replaced(tokenizer_spec):
    sandbox = GrammarSandbox(tokenizer_spec, processes=1, timeout_s=1e-3)
    try:
        child = sandbox._take()
        child.run(StructuredOutput("regex", "a"), 60)  # started and warm: time the check only
        sandbox._idle.put(child)
        # 19,000 atoms, within the bounds: about 20 ms to compile on an idle machine, 20x the limit
        # (a warm child checks a small schema in about 1 ms, the limit's own resolution).
        with pytest.raises(ValueError, match="took longer than"):
            sandbox.check(StructuredOutput("regex", "a{1000}{19}"))
        assert child.process.wait(timeout=5) is not None  # the overrunning child was killed
    finally:
        sandbox.close()


# ---- the engine's masks -------------------------------------------------------------------------
def test_a_late_mask_fails_its_own_row_and_the_neighbour_is_masked(monkeypatch):
    tokenizer = load_tokenizer(str(default_model_path()))
    vocab = len(tokenizer)
    # With the bounds lifted a regex bomb compiles, and its first mask takes seconds.
    monkeypatch.setattr(grammar_bounds, "MAX_REGEX_EXPANSION", 10**7)
    monkeypatch.setattr(grammar_bounds, "MAX_TOTAL_EXPANSION", 10**7)
    decoding = StructuredDecoding(GrammarCompiler(lambda: tokenizer, vocab), mask_deadline_s=0.2)
    decoding.add("bomb", StructuredOutput("regex", "a{1000}{1000}"))
    decoding.add("digits", StructuredOutput("regex", "[0-9]+"))
    for rid in ("bomb", "digits"):
        decoding._rows[rid].matcher.result()  # compiled (fast): only the mask is slow
    pending = decoding.start_masks(["digits", "bomb"], [[], []])
    started = time.monotonic()
    masked = apply_masks(torch.zeros(2, vocab), pending)
    assert time.monotonic() - started < 5  # far below the bomb's mask, which is not awaited
    assert set(pending.failed) == {"bomb"} and "took longer than 0.2s" in pending.failed["bomb"]
    allowed = torch.isfinite(masked[0]).nonzero().flatten().tolist()
    assert allowed and all(re.fullmatch("[0-9]+", tokenizer.decode([t])) for t in allowed[:50])


def test_the_template_cache_is_bounded_by_estimated_bytes(monkeypatch):
    from workers import structured

    tokenizer = load_tokenizer(str(default_model_path()))
    compiler = GrammarCompiler(lambda: tokenizer, len(tokenizer))
    big = [
        StructuredOutput("grammar", "start: " + " | ".join(f'"w{j}_{i}"' for j in range(2000)))
        for i in range(6)
    ]
    one = compiler._pool.submit(compile_matcher, compiler._tokenizer(), big[0]).result()
    monkeypatch.setattr(structured, "MAX_CACHED_GRAMMAR_BYTES", 3 * one.estimated_bytes)
    for constraint in big:
        compiler.matcher(constraint)
    assert len(compiler._cache) == 3 and compiler.cached_bytes <= 3 * one.estimated_bytes
    assert list(compiler._cache) == [f"grammar\0{c.spec}" for c in big[3:]]  # least recent out


# ---- logprobs come before the mask --------------------------------------------------------------
@pytest.mark.slow
def test_constrained_logprobs_are_the_models_and_finite(smollm2_llm):
    params = SamplingParams(
        max_tokens=8,
        temperature=0.0,
        logprobs=20,
        structured=StructuredOutput("regex", "[0-9]{8}"),
    )
    (out,) = smollm2_llm.generate(["My favourite word is"], params, use_tqdm=False)
    assert re.fullmatch("[0-9]{8}", out.text)
    values = [v for entry in out.logprobs for _, v in entry]
    assert all(math.isfinite(v) for v in values)
    # The model's own top choices after "is" are words, which the mask forbids: they are reported.
    top_texts = [smollm2_llm.tokenizer.decode([t]) for t, _ in out.logprobs[0][1:]]
    assert any(not text.strip().isdigit() for text in top_texts)
    json.dumps(values, allow_nan=False)
