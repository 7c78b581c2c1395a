"""The reasoning splitter: a `<think>` block cut from the answer, whole or however the text is
streamed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from frontend.reasoning import PARSERS, Reasoning, ReasoningSplitter

R1, QWEN3 = PARSERS["deepseek_r1"], PARSERS["qwen3"]


def _split(splitter: ReasoningSplitter, pieces: list[str]) -> tuple[str, str]:
    reasoning = content = ""
    for piece in pieces:
        r, c = splitter.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize(
    "fmt, opened, text, expected",
    [
        (R1, True, "plan it</think>\n\nthe answer", ("plan it", "the answer")),
        (R1, True, "still thinking", ("still thinking", "")),
        (R1, False, "<think>plan</think>answer", ("plan", "answer")),
        (R1, False, "no markers at all", ("no markers at all", "")),  # R1 always opens
        (QWEN3, False, "no markers at all", ("", "no markers at all")),
        (QWEN3, False, "\n<think>\nplan\n</think>\n\nanswer", ("\nplan\n", "answer")),
        (QWEN3, True, "plan</think>answer </think> kept", ("plan", "answer </think> kept")),
        (QWEN3, False, "<thin", ("", "<thin")),  # a start that never completed is content
        (QWEN3, True, "plan</thi", ("plan</thi", "")),
    ],
)
def test_whole_replies_split_at_the_first_end_marker(fmt, opened, text, expected):
    opens = opened or fmt.always_opens
    assert _split(ReasoningSplitter(fmt, opens), [text]) == expected


@given(
    st.sampled_from(["<think>", ""]),
    st.text("ab</think>\n ", max_size=40),
    st.text("ab</thin>k\n ", max_size=40),
    st.lists(st.integers(0, 90), max_size=8),
)
def test_any_cut_into_deltas_splits_as_the_whole(start, reasoning, answer, cuts):
    text = f"{start}{reasoning}{answer}"
    pieces, last = [], 0
    for cut in sorted(cuts):
        pieces.append(text[last:cut])
        last = max(last, cut)
    pieces.append(text[last:])
    for fmt in (R1, QWEN3):
        for opened in (True, False):
            whole = _split(ReasoningSplitter(fmt, opened or fmt.always_opens), [text])
            streamed = _split(ReasoningSplitter(fmt, opened or fmt.always_opens), pieces)
            assert streamed == whole


class _Tokenizer:
    """Two markers as single tokens (ids 5 and 6); anything else several."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return {"<think>": [5], "</think>": [6]}.get(text, [1, 2])


def test_the_prompt_decides_whether_the_reply_starts_inside_the_block():
    qwen3 = Reasoning.of("qwen3", _Tokenizer())
    assert qwen3.opened_by([1, 5, 9])
    assert not qwen3.opened_by([1, 5, 9, 6, 3])
    assert not qwen3.opened_by([1, 2])
    assert Reasoning.of("deepseek_r1", _Tokenizer()).opened_by([1, 2])
    assert qwen3.num_reasoning_tokens([7, 7, 6, 8], opened=True) == 3
    assert qwen3.num_reasoning_tokens([5, 7, 6, 8], opened=False) == 3
    assert qwen3.num_reasoning_tokens([7, 8], opened=False) == 0


def test_a_parser_needs_its_markers_as_single_tokens():
    class Plain(_Tokenizer):
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [1, 2]

    with pytest.raises(ValueError, match="^reasoning_parser:"):
        Reasoning.of("qwen3", Plain())
    with pytest.raises(ValueError, match="^reasoning_parser:"):
        Reasoning.of("gpt-oss", _Tokenizer())
