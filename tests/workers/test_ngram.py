"""The n-gram (prompt lookup) proposer against a plain reference, and its rules."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from scheduler.speculative import SpeculativeConfig
from workers.ngram import propose_ngram
from workers.proposer import NgramProposer, make_proposer


def reference(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """Longest n first, most recent earlier match, continued periodically past the end."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i : i + n] == suffix:
                out = []
                seq = list(tokens)
                for j in range(k):
                    seq.append(seq[i + n + j])
                    out.append(seq[-1])
                return out
    return []


@given(
    tokens=st.lists(st.sampled_from([0, 1, 2, 255, 256, 2**40, 2**40 + 1]), max_size=60),
    lo=st.integers(1, 4),
    extra=st.integers(0, 3),
    k=st.integers(0, 6),
)
def test_matches_the_reference(tokens, lo, extra, k):
    # Large ids make packed bytes match across token boundaries: the alignment check must skip
    # those.
    assert propose_ngram(tokens, lo, lo + extra, k) == reference(tokens, lo, lo + extra, k)


def test_the_longest_suffix_wins_and_the_most_recent_match():
    tokens = [1, 2, 9, 8, 3, 2, 7, 1, 2, 5, 6, 3, 2]
    assert propose_ngram(tokens, 1, 2, 2) == [7, 1]  # "3 2" matched, not "2"'s later match
    assert propose_ngram(tokens, 1, 1, 2) == [5, 6]  # "2" alone: its most recent earlier match


def test_nothing_matches_nothing_is_proposed():
    assert propose_ngram([1, 2, 3, 4], 1, 3, 4) == []
    assert propose_ngram([7], 1, 3, 4) == []
    assert propose_ngram([1, 2, 1, 2], 2, 3, 0) == []


def test_a_repeating_run_continues_past_the_context():
    assert propose_ngram([7, 1, 2, 1, 2, 1, 2], 2, 3, 5) == [1, 2, 1, 2, 1]


def test_the_proposer_follows_its_settings():
    proposer = make_proposer(SpeculativeConfig(num_tokens=2, ngram_min=1, ngram_max=2))
    assert isinstance(proposer, NgramProposer)
    assert proposer.propose([[1, 2, 3, 1, 2], [5]]) == [[3, 1], []]
    assert make_proposer(None) is None
    adaptive = make_proposer(SpeculativeConfig(num_tokens=2, max_num_tokens=5, ngram_max=2))
    assert adaptive is not None  # proposes the most a request may verify; the scheduler cuts
    assert adaptive.propose([[1, 2, 3, 1, 2]]) == [[3, 1, 2, 3, 1]]
