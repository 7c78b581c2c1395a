"""The structured-output compiler is built and warmed off the engine thread when a runner starts
(workers/grammar_warm.py): the first constrained request finds the llguidance tokenizer built and
a grammar compiled, and the engine thread never builds them."""

from __future__ import annotations

import threading

import pytest
from transformers import AutoConfig

from engine.llm import LLM
from scheduler.sampling_params import SamplingParams
from scheduler.structured_output import StructuredOutput
from workers.features.structured import StructuredFeature
from workers.grammar_warm import WarmDecoding
from workers.model_files import load_tokenizer

pytestmark = pytest.mark.slow  # builds an llguidance tokenizer, loads a model

CHOICES = ["left", "right"]


def test_the_tokenizer_is_built_on_the_warm_up_thread_before_any_request(tiny_model_dir):
    builders: list[str] = []

    def loader():
        builders.append(threading.current_thread().name)
        return load_tokenizer(tiny_model_dir)

    # A key of its own: a compiler shared with another test would not call this loader.
    vocab_size = AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    warm = WarmDecoding(f"{tiny_model_dir}#warm-test", loader, vocab_size, 30.0, 1.0)
    decoding = warm.get()  # the test waits; an engine thread never does once it is ready
    assert warm.ready()
    assert len(builders) == 1 and builders[0] != threading.current_thread().name
    compiler = decoding.compiler
    assert compiler._ll_tokenizer is not None  # built at start
    assert len(compiler._cache) == 1 and compiler.cached_bytes > 0  # a grammar compiled too


def test_a_runner_warms_its_compiler_at_start_and_its_first_request_uses_it(tiny_model_dir):
    with LLM(tiny_model_dir, device="cpu", load_progress=False, kv_cache_memory_gb=0.05) as llm:
        runner = llm.engine.executor.runner  # type: ignore[attr-defined]
        (feature,) = [f for f in runner.features if isinstance(f, StructuredFeature)]
        assert feature.decoding is None  # no constrained request yet
        warmed = feature.warm.get()
        assert warmed.compiler._ll_tokenizer is not None  # before the first request
        constraint = StructuredOutput.choice(CHOICES)
        params = SamplingParams(max_tokens=16, temperature=0, structured=constraint)
        out = llm.generate(["Pick one:"], params, use_tqdm=False)[0]
        assert feature.decoding is warmed  # the warmed compiler served it
        assert out.text in CHOICES and out.finish_reason == "stop"
