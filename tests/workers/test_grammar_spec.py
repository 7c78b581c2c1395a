"""Look-ahead under a grammar for verify rows: each position's mask is the one step-by-step
decoding gives there, rejected proposals are cut, and the request's matcher never moves."""

from __future__ import annotations

import llguidance
import llguidance.hf
import llguidance.torch
import pytest
import torch

from scheduler.structured_output import StructuredOutput
from workers.grammar import compile_matcher
from workers.grammar_spec import fill_verify_masks, grammar_prefix

REGEX = "(ab|cd){1,3}-[0-9]"


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def template(tok):
    ll = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
    return compile_matcher(ll, StructuredOutput("regex", REGEX)).matcher


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def mask_after(template, tokens: list[int], vocab: int) -> torch.Tensor:
    """The mask a plain decode step computes after `tokens`."""
    matcher = template.deep_copy()
    assert matcher.consume_tokens(tokens) if tokens else True
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
    return bitmask[0]


@pytest.mark.parametrize("outputs,drafts", [("ab", "cdab-"), ("", "ab"), ("abcd", "ab-7")])
def test_each_position_gets_the_mask_of_step_by_step_decoding(tok, template, outputs, drafts):
    vocab = len(tok)
    out, ahead = ids(tok, outputs), ids(tok, drafts)
    matcher = template.deep_copy()
    if out:
        matcher.consume_tokens(out)
    before = mask_after(template, out, vocab)
    bitmask = llguidance.torch.allocate_token_bitmask(len(ahead) + 3, vocab)
    fill_verify_masks(matcher, ahead, bitmask, 2)
    for j in range(len(ahead) + 1):
        assert torch.equal(bitmask[2 + j], mask_after(template, out + ahead[:j], vocab)), j
    # The request's matcher stands where it stood: nothing to roll back.
    after = llguidance.torch.allocate_token_bitmask(1, vocab)
    llguidance.torch.fill_next_token_bitmask(matcher, after, 0)
    assert torch.equal(after[0], before)


def test_a_rejected_draft_is_masked_out_of_its_own_position(tok, template):
    vocab = len(tok)
    ab, bad = ids(tok, "ab"), ids(tok, "x")
    drafts = ab + bad + ab
    bitmask = llguidance.torch.allocate_token_bitmask(len(drafts) + 1, vocab)
    fill_verify_masks(template.deep_copy(), drafts, bitmask, 0)
    rejected = len(ab)
    allowed = ((bitmask[rejected] >> torch.arange(32, dtype=torch.int32)[:, None]) & 1).T.flatten()
    assert allowed[bad[0]] == 0
    assert torch.equal(bitmask[rejected], mask_after(template, ab, vocab))
    assert all(torch.equal(bitmask[j], bitmask[rejected]) for j in range(rejected, len(drafts)))


def test_proposals_are_cut_before_the_first_rejected_token(tok, template):
    ab, cd, dash, x = (ids(tok, t) for t in ("ab", "cd", "-", "x"))
    assert grammar_prefix(template.deep_copy(), ab, cd + dash + x) == len(cd + dash)
    assert grammar_prefix(template.deep_copy(), [], cd + cd + cd + cd) == 3 * len(cd)
    assert grammar_prefix(template.deep_copy(), x, ab) == 0  # the outputs already left it
    assert grammar_prefix(template.deep_copy(), ab, []) == 0
