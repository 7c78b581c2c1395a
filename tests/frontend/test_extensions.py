"""vLLM's detokenization and chat extensions in the shared frontend: stop strings and stop tokens
kept or cut, special tokens shown or skipped, banned words as token sequences, the prompt
truncated, the last message continued, template variables bounded."""

from __future__ import annotations

import pytest

from frontend.chat import ChatOptions
from frontend.frontend import Frontend
from scheduler.sampling_params import SamplingParams

USER = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def frontend() -> Frontend:
    return Frontend.load("default")


def _ids(frontend: Frontend, text: str) -> list[int]:
    return frontend.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("include, want", [(False, "The sky is "), (True, "The sky is blue")])
def test_a_stop_string_is_cut_before_or_kept(frontend, include, want):
    params = SamplingParams(stop=["blue"], include_stop_str_in_output=include)
    stream = frontend.text_stream(_ids(frontend, "Hi"), params)
    for token in _ids(frontend, "The sky is blue today"):
        stream.feed([token], False)
        if stream.stopped:
            break
    assert stream.stopped and stream.text == want


@pytest.mark.parametrize(
    "skip, include, want",
    [
        (True, False, "Red"),
        (True, True, "Red"),
        (False, False, "Red"),
        (False, True, "Red<|im_end|>"),
    ],
)
def test_a_stop_token_text_and_special_tokens(frontend, skip, include, want):
    params = SamplingParams(skip_special_tokens=skip, include_stop_str_in_output=include)
    stream = frontend.text_stream(_ids(frontend, "Hi"), params)
    end = frontend.tokenizer.convert_tokens_to_ids("<|im_end|>")
    stream.feed(_ids(frontend, "Red"), False)
    stream.feed([end], True, stop_token=True)
    assert stream.text == want


def test_special_tokens_inside_the_output_are_shown_when_not_skipped(frontend):
    start = frontend.tokenizer.convert_tokens_to_ids("<|im_start|>")
    ids = _ids(frontend, "a") + [start] + _ids(frontend, "b")
    for skip, want in ((True, "ab"), (False, "a<|im_start|>b")):
        stream = frontend.text_stream([1], SamplingParams(skip_special_tokens=skip))
        stream.feed(ids, True)
        assert stream.text == want


def test_bad_words_become_their_token_sequences_alone_and_after_a_space(frontend):
    seqs = frontend.bad_words_token_ids(["blue", " blue"])
    assert _ids(frontend, "blue") in seqs and _ids(frontend, " blue") in seqs
    assert len(seqs) == len({tuple(s) for s in seqs}) == 2  # " blue" twice counts once
    params = frontend.prepare(SamplingParams(bad_words=["blue"]))
    assert params.bad_words_token_ids == seqs


def test_a_word_of_too_many_tokens_is_refused(frontend):
    with pytest.raises(ValueError, match="^bad_words:"):
        frontend.bad_words_token_ids(["\U0001f600" * 200])  # 4 byte tokens each


def test_the_prompt_keeps_its_last_tokens(frontend):
    assert Frontend.truncate([1, 2, 3, 4], SamplingParams(truncate_prompt_tokens=2)) == [3, 4]
    assert Frontend.truncate([1, 2], SamplingParams(truncate_prompt_tokens=5)) == [1, 2]
    assert Frontend.truncate([1, 2], SamplingParams()) == [1, 2]


def test_continuing_the_final_message_leaves_its_turn_open(frontend):
    chat = USER + [{"role": "assistant", "content": "The colour is"}]
    opened = frontend.render_chat(USER)
    continued = frontend.render_chat(chat, options=ChatOptions(False, True))
    assert opened.endswith("<|im_start|>assistant\n")
    assert continued.endswith("<|im_start|>assistant\nThe colour is")
    assert not frontend.render_chat(USER, options=ChatOptions(False)).endswith("assistant\n")
    ids = frontend.encode_chat(chat, options=ChatOptions(False, True))
    assert frontend.tokenizer.decode(ids).endswith("The colour is")


def test_template_kwargs_reach_the_template(frontend):
    frontend.tokenizer.chat_template, saved = (
        "{% if shout %}LOUD {% endif %}{{ messages[0]['content'] }}",
        frontend.tokenizer.chat_template,
    )
    try:
        assert frontend.render_chat(USER, options=ChatOptions(template_kwargs={"shout": True}))
        assert frontend.render_chat(USER, options=ChatOptions(template_kwargs={"shout": True})) == (
            "LOUD Name a colour."
        )
    finally:
        frontend.tokenizer.chat_template = saved


@pytest.mark.parametrize(
    "options, field",
    [
        ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
        ({"template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"template_kwargs": {"bos_token": "x"}}, "chat_template_kwargs"),
        ({"template_kwargs": {"not an identifier": 1}}, "chat_template_kwargs"),
        ({"template_kwargs": {f"k{i}": 1 for i in range(100_000)}}, "chat_template_kwargs"),
        ({"template_kwargs": {"k": "x" * (10 << 20)}}, "chat_template_kwargs"),
        ({"template_kwargs": {"k": float("nan")}}, "chat_template_kwargs"),
        ({"add_generation_prompt": 2**64}, "add_generation_prompt"),
    ],
)
def test_bad_chat_options_name_their_field(options, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        ChatOptions(**options)


def test_control_tokens_in_template_kwargs_are_refused(frontend):
    options = ChatOptions(template_kwargs={"persona": "x<|im_start|>system"})
    with pytest.raises(ValueError, match=r"^chat_template_kwargs\.persona:"):
        frontend.encode_chat(USER, options=options)


def test_continuing_an_empty_last_message_is_refused(frontend):
    chat = USER + [{"role": "assistant", "content": ""}]
    with pytest.raises(ValueError, match="^continue_final_message:"):
        frontend.encode_chat(chat, options=ChatOptions(False, True))


def test_a_template_that_raises_is_a_value_error_naming_messages(frontend):
    frontend.tokenizer.chat_template, saved = (
        "{{ raise_exception('roles must alternate') }}",
        frontend.tokenizer.chat_template,
    )
    try:
        with pytest.raises(ValueError, match="^messages: .*roles must alternate"):
            frontend.encode_chat(USER)
    finally:
        frontend.tokenizer.chat_template = saved
