"""Incremental detokenization and stop strings, on the embedded model's byte-level BPE tokenizer."""

import pytest

from frontend.detokenizer import IncrementalDetokenizer, StopMatcher
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


def test_earliest_of_several_stop_strings_wins():
    m = StopMatcher(["world", "lo"])
    assert m.feed("hello world", final=True) == "hel"
    assert m.stopped


def test_without_stop_strings_everything_passes_at_once():
    m = StopMatcher([])
    assert m.feed("abc") == "abc" and m.feed("d", final=True) == "d"
