"""The offline API: LLM(...).generate / .chat over prompts given as text or token ids."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from scheduler import SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


@pytest.mark.slow
def test_chat_answers_with_the_default_model(smollm2_llm):
    [out] = smollm2_llm.chat(
        [[{"role": "user", "content": "What is the capital of France?"}]], GREEDY, use_tqdm=False
    )
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # <|im_end|>, the model's EOS
    assert out.token_ids[-1] == smollm2_llm.tokenizer.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.slow
def test_text_and_token_id_prompts_give_the_same_completion(smollm2_llm):
    text = "The three primary colours are"
    ids = smollm2_llm.tokenizer.encode(text)
    by_text, by_ids = smollm2_llm.generate([text, ids], GREEDY, use_tqdm=False)
    assert by_text.token_ids == by_ids.token_ids
    assert by_text.prompt == text and by_ids.prompt is None
    assert by_text.text == smollm2_llm.tokenizer.decode(by_text.token_ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def tiny_llm(tiny_checkpoint, llm_factory):
    path, _ = tiny_checkpoint("qwen2")
    return llm_factory(model=path, dtype="float32")


def test_outputs_come_back_in_prompt_order_with_per_prompt_params(tiny_llm):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 1, 6)]
    outs = tiny_llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [len(o.token_ids) for o in outs] == [3, 1, 6]
    assert all(o.finish_reason == "length" for o in outs)


def test_logprobs_list_the_sampled_token_then_the_top_n(tiny_llm):
    [out] = tiny_llm.generate(
        [[20, 21, 22]],
        SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True),
        use_tqdm=False,
    )
    assert len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs):
        assert entry[0][0] == token and len(entry) == 4
        assert entry[1][0] == token  # greedy: the sampled token is the top-1
        assert entry[1][1] >= entry[2][1] >= entry[3][1]


def test_stop_string_truncates_the_text(tiny_llm):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    [full] = tiny_llm.generate([[30, 31, 32]], params, use_tqdm=False)
    # A stop string taken from the output itself, starting at its second half's first visible
    # character: it always occurs, so the test always runs.
    half = range(len(full.text) // 2, len(full.text))
    start = next(i for i in half if not full.text[i].isspace())
    stop = full.text[start : start + 3]
    [cut] = tiny_llm.generate(
        [[30, 31, 32]],
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]
    assert not tiny_llm.engine.has_unfinished_requests()


def test_stop_string_completed_by_the_last_token_still_finishes_as_stop(tiny_llm):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    [full] = tiny_llm.generate([[40, 41, 42]], params, use_tqdm=False)
    # The shortest tail of the text that occurs nowhere earlier: only the final token completes it.
    tails = [
        full.text[-k:]
        for k in range(1, len(full.text) + 1)
        if full.text[-k:].strip() and full.text.find(full.text[-k:]) == len(full.text) - k
    ]
    assert tails, f"the whole text {full.text!r} is a tail that occurs once, unless it is blank"
    [cut] = tiny_llm.generate(
        [[40, 41, 42]],
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, stop=[tails[0]]),
        use_tqdm=False,
    )
    assert cut.finish_reason == "stop" and cut.text == full.text[: -len(tails[0])]


def test_a_bad_prompt_leaves_none_of_its_batch_queued(tiny_llm):
    too_long = [7] * (tiny_llm.engine.max_model_len + 1)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        tiny_llm.generate([[5, 6], [8, 9], too_long], GREEDY, use_tqdm=False)
    assert not tiny_llm.engine.has_unfinished_requests()
    [out] = tiny_llm.generate([[5, 6]], GREEDY, use_tqdm=False)  # and the next call works
    assert out.finish_reason in ("stop", "length")


def test_more_than_one_sample_per_prompt_is_refused(tiny_llm):
    with pytest.raises(ValueError, match="n:"):
        tiny_llm.generate([[1, 2]], SamplingParams(n=2), use_tqdm=False)


@pytest.mark.parametrize(
    "model, message",
    [
        ("/does/not/exist", "does not exist"),
        (__file__, "neither a .gguf file nor"),
    ],
)
def test_bad_model_paths_raise_clear_errors(model, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=model, device="cpu")


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}'
    )
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(model=str(tmp_path), device="cpu")


# What the GPU machines lack: the TP=1 offline engine must not need any of it.
ABSENT_ON_GPU_MACHINES = (
    "ray",
    "pydantic",
    "fastapi",
    "starlette",
    "uvicorn",
    "gguf",
    "flash_attn",
)


def test_the_offline_engine_runs_without_ray_or_the_serving_stack(tiny_checkpoint):
    import subprocess
    import sys

    model_dir, _ = tiny_checkpoint("qwen3")
    code = f"""
import sys
for name in {ABSENT_ON_GPU_MACHINES!r}:
    sys.modules[name] = None  # any import of it raises ImportError
from engine.llm import LLM
from scheduler import SamplingParams
llm = LLM(model={model_dir!r}, device="cpu", load_progress=False, kv_cache_memory_gb=0.01)
out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
assert len(out[0].token_ids) == 3, out
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_with_block_releases_the_engine(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen2")
    with LLM(model=path, device="cpu", load_progress=False, kv_cache_memory_gb=0.05) as llm:
        [out] = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
        assert out.token_ids
    assert llm.engine.executor.runner is None  # the model and cache are released
    llm.shutdown()  # a second close does nothing


def test_a_dropped_llm_releases_its_engine_when_collected(tiny_checkpoint):
    import gc
    import weakref

    path, _ = tiny_checkpoint("qwen2")
    llm = LLM(model=path, device="cpu", load_progress=False, kv_cache_memory_gb=0.05)
    executor, dropped = llm.engine.executor, weakref.ref(llm)
    del llm
    gc.collect()
    assert dropped() is None
    assert executor.runner is None


def test_a_failed_construction_releases_the_executor_it_made(tiny_checkpoint):
    """The workers start, then the KV pool proves too small for max_model_len: the executor does
    not stay behind."""
    from engine.executor import local_executor

    path, _ = tiny_checkpoint("qwen2")
    made = []

    def recording(config, runner_config):
        made.append(local_executor(config, runner_config))
        return made[-1]

    with pytest.raises(ValueError, match="num_gpu_blocks"):
        LLM(
            model=path,
            device="cpu",
            load_progress=False,
            kv_cache_memory_gb=1e-5,
            max_model_len=512,
            executor_factory=recording,
        )
    assert made and made[0].runner is None
