"""Incremental detokenization and stop strings, on the embedded model's byte-level BPE tokenizer."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.detokenizer import MAX_HELD_DELTAS, IncrementalDetokenizer, StopMatcher
from workers.model_files import load_tokenizer

TEXTS = [
    "plain ascii text, with punctuation!",
    "héllo wörld — naïve café",
    "emoji 🌍🚀 and CJK 世界你好, mixed: Ω≈ç√",
    "  leading spaces\nand\ttabs\n\n",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_deltas_rebuild_the_text_without_broken_characters(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("Say something:", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.add([t]) for t in ids] + [detok.flush()]
    assert "".join(deltas) == tokenizer.decode(ids) == detok.text
    assert all("\ufffd" not in d for d in deltas)


def test_multi_byte_character_split_over_tokens_is_held_back_until_complete(tokenizer):
    ids = tokenizer.encode(" 🌍", add_special_tokens=False)
    assert len(ids) > 1  # the emoji's UTF-8 bytes span several byte-level tokens
    detok = IncrementalDetokenizer(tokenizer)
    partial = [detok.add([t]) for t in ids[:-1]]
    assert "".join(partial) in ("", " ")
    assert detok.add(ids[-1:]).endswith("🌍")


def test_several_tokens_at_once_and_special_tokens_skipped(tokenizer):
    ids = tokenizer.encode("one two three", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(ids[:2]) + detok.add(ids[2:] + [tokenizer.eos_token_id]) == "one two three"


def test_flush_emits_a_truncated_character_as_replacement(tokenizer):
    ids = tokenizer.encode("🚀", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(ids[:1]) == ""
    assert "\ufffd" in detok.flush()


def test_stop_string_cuts_text_and_never_leaks_a_prefix():
    m = StopMatcher(["STOP"])
    assert m.feed("hello S") == "hell"  # "o S" might be the start of "STOP": held back
    assert m.feed("TO") == "o "
    assert m.feed("P and more") == ""
    assert m.stopped and m.text == "hello "


def test_false_alarm_is_released_and_final_flushes_the_tail():
    m = StopMatcher(["\n\n"])
    out = m.feed("a\n") + m.feed("b") + m.feed("c", final=True)
    assert out == "a\nbc" and not m.stopped


def test_the_stop_string_that_completes_first_wins():
    m = StopMatcher(["world", "lo"])
    assert m.feed("hello world", final=True) == "hel"
    assert m.stopped
    # "b" is complete before "SbS" is, whether the text comes at once or in pieces.
    assert StopMatcher(["SbS", "b"]).feed("SSbS", final=True) == "SS"


def test_without_stop_strings_everything_passes_at_once():
    m = StopMatcher([])
    assert m.feed("abc") == "abc" and m.feed("d", final=True) == "d"


class CountingTokenizer:
    """The real tokenizer, counting the token ids each decode call is given."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decoded_ids = 0

    def decode(self, ids, **kwargs):
        self.decoded_ids += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


def _lone_continuation_byte(tokenizer) -> int:
    """The byte-level token of 0x80: a UTF-8 continuation byte, never the start of a character.

    Byte-level BPE spells byte 0x80 as "Ģ" (GPT-2's byte-to-unicode table) and 0xC3 as "Ã"."""
    token, lead = tokenizer.convert_tokens_to_ids(["Ģ", "Ã"])
    assert tokenizer.decode([lead, token]) == "À"  # C3 80: it is the byte 0x80
    assert tokenizer.decode([token]) == "\ufffd"
    return token


def _decode_work(tokenizer, ids: list[int]) -> tuple[str, int]:
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting)
    text = "".join(detok.add([t]) for t in ids) + detok.flush()
    return text, counting.decoded_ids


def test_a_run_of_incomplete_bytes_costs_linear_decode_work(tokenizer):
    """A logit_bias toward a lone continuation byte: every token leaves the text ending in U+FFFD.
    The text is what the tokenizer decodes, and the ids decoded per token stay bounded: twice the
    tokens cost about twice the decode work, not four times."""
    byte = _lone_continuation_byte(tokenizer)
    text, work = _decode_work(tokenizer, [byte] * 1000)
    assert text == tokenizer.decode([byte] * 1000) == "\ufffd" * 1000
    _, twice_the_work = _decode_work(tokenizer, [byte] * 2000)
    assert twice_the_work <= 2.1 * work
    assert work <= 4 * (MAX_HELD_DELTAS + 1) * 1000


def test_a_run_of_skipped_special_tokens_costs_linear_decode_work(tokenizer):
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    text, work = _decode_work(tokenizer, [special] * 1000)
    assert text == ""
    assert _decode_work(tokenizer, [special] * 2000)[1] <= 2.1 * work


CHARACTERS = "aé世界🌍🚀Ωç—\n "


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet=CHARACTERS, min_size=1, max_size=40),
    cuts=st.lists(st.integers(1, 6), max_size=40),
)
def test_any_chunking_of_the_tokens_rebuilds_the_text(tokenizer, text, cuts):
    """However the tokens arrive (one at a time, or in chunks that end inside a character), the
    deltas join to the tokenizer's own decoding, with no replacement character."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    deltas, start = [], 0
    for size in cuts:
        deltas.append(detok.add(ids[start : start + size]))
        start += size
    deltas += [detok.add(ids[start:]), detok.flush()]
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab\nS", max_size=30),
    stops=st.lists(st.text(alphabet="ab\nS", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 5), max_size=30),
)
def test_stop_strings_cut_the_same_text_however_it_is_split(text, stops, cuts):
    """Fed in any pieces, the text sent is the text up to the stop string that completes first
    (all of it when none appears), and nothing is sent after a stop."""
    m = StopMatcher(stops)
    sent, start = [], 0
    for size in cuts:
        sent.append(m.feed(text[start : start + size]))
        start += size
    sent.append(m.feed(text[start:], final=True))
    ends = [(i + len(s), i) for s in stops if (i := text.find(s)) != -1]
    expected = text[: min(ends)[1]] if ends else text
    assert "".join(sent) == expected == m.text
    assert m.stopped == bool(ends)
