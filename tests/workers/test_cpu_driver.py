"""The CPU decoder-layer driver (workers/layers/backends/cpu_driver.py) runs a decode step's layer
loop in one C++ call on the default quantized path (the embedded SmolLM2's Q4_1 blocks through
the int8 kernel), and its logits are bit for bit those of the layers run one by one in Python:
`torch.equal` on every step's logits over the same workload run both ways, at batch 1 cold and
after a prefix hit, and at batch 8 in a pool small enough to preempt. Speculation's verify rows
(k + 1 decode rows of one sequence) run in it too, with plain decoding's greedy tokens.
"""

from __future__ import annotations

import random

import pytest
import torch

from scheduler import SamplingParams
from workers.layers.backends import cpu_driver
from workers.layers.backends.cpu_driver import LayerDriver

pytestmark = pytest.mark.slow

PROMPT = 40
# Blocks of 16. The eight requests share the first prompt's two cached blocks and fill a third
# block each (10 in all); past position 47 each needs a fourth, and only 4 are left: the batch
# decodes 8 rows for 8 steps, then preempts.
POOL = 14


@pytest.fixture(scope="module")
def llm(llm_factory):
    return llm_factory(
        model="default",
        quantization="auto",
        num_gpu_blocks=POOL,
        max_model_len=128,
        max_num_batched_tokens=64,
    )


def workload() -> list[tuple[list[list[int]], list[SamplingParams]]]:
    """A prompt alone (cold), one sharing its first two blocks alone (a prefix hit), then eight
    seeded sampled requests sharing them too (one prefill step of 8 x 8 tokens)."""
    rng = random.Random(53)
    a = [rng.randrange(3, 40000) for _ in range(PROMPT)]
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    batch = [a[:32] + [rng.randrange(3, 40000) for _ in range(8)] for _ in range(8)]
    sampled = [
        SamplingParams(max_tokens=12, temperature=0.8, seed=i, ignore_eos=True) for i in range(8)
    ]
    return [([a], [greedy]), ([a[:32] + a[:8]], [greedy]), (batch, sampled)]


def run(llm, monkeypatch) -> tuple[list[torch.Tensor], list[int], list[int], int]:
    """Every step's logits, the row counts of the driver's calls, each phase's cached tokens and
    the preemptions, over the workload from an empty prefix cache."""
    llm.engine.weights.reset_prefix_cache()
    model = llm.engine.executor.runner.model
    logits: list[torch.Tensor] = []
    rows: list[int] = []
    compute, call = model.compute_logits, LayerDriver.__call__

    def keep(hidden):
        out = compute(hidden)
        logits.append(out.clone())
        return out

    def counted(self, x, positions, meta):
        rows.append(x.shape[0])
        return call(self, x, positions, meta)

    monkeypatch.setattr(model, "compute_logits", keep)
    monkeypatch.setattr(LayerDriver, "__call__", counted)
    before = llm.engine.stats().num_preemptions
    cached = []
    for prompts, params in workload():
        outs = llm.generate(prompts, params, use_tqdm=False)
        cached.append(sum(o.num_cached_tokens for o in outs))
    monkeypatch.undo()
    return logits, rows, cached, llm.engine.stats().num_preemptions - before


def test_driver_logits_equal_the_python_layers(llm, monkeypatch):
    with cpu_driver.driver_off():
        want, off_rows, off_cached, off_preempted = run(llm, monkeypatch)
    got, rows, cached, preempted = run(llm, monkeypatch)
    assert off_rows == [], "driver_off() must keep every step in Python"
    assert {1, 8} <= set(rows), f"the driver must run batch-1 and batch-8 steps, ran {rows}"
    assert cached == off_cached == [0, 32, 8 * 32], cached
    assert preempted == off_preempted and preempted > 0, "the batch of eight must preempt"
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"step {step}: max |diff| {(a - b).abs().max()}"


def test_plan_names_a_malformed_layout():
    if cpu_driver.load() is None:
        pytest.skip("the int8 GGUF kernel (AVX512-VNNI) is not built on this CPU")
    with pytest.raises(ValueError, match="tensors: 14 per layer and 3 more, got 4"):
        torch.classes.raylm_driver.Plan([torch.ones(1)] * 4, [1, 1, 1], [1e-5, 0.125])
    with pytest.raises(ValueError, match="ints/floats: 11 and 2 expected, got 3 and 2"):
        torch.classes.raylm_driver.Plan([torch.ones(1)] * 17, [1, 1, 1], [1e-5, 0.125])


def test_the_library_is_ready_when_the_model_is_loaded(llm):
    """Built at load, so the first decode step of a fresh machine waits for no compiler; a model
    it refuses never builds it."""
    assert cpu_driver.load.cache_info().currsize == 1  # called by the loader, before any step
    assert cpu_driver._model_refusal(llm.engine.executor.runner.model.model) is None


PASSAGE = (
    "The river rose through the night, and by morning the lower streets of the town were under "
    "water. The bakers carried their flour to the upper floors, and the children watched from the "
    "bridge."
)


@pytest.fixture(scope="module")
def spec_llm():
    from engine.llm import LLM

    spec = LLM(
        "default",
        device="cpu",
        load_progress=False,
        quantization="auto",
        kv_cache_memory_gb=0.25,
        enable_prefix_caching=False,
        speculative={"num_tokens": 4},
    )
    yield spec
    spec.shutdown()


def test_verify_rows_run_in_the_driver_and_keep_the_plain_tokens(
    spec_llm, smollm2_gguf_llm, monkeypatch
):
    """An n-gram verify step (the request's last token and 4 proposed ones: 5 decode rows of one
    sequence) runs in one call of the driver, not the Python layers, and greedy copying gives
    the tokens plain decoding gives (bench/spec_bench.py's copy prompt, shortened)."""
    spec = spec_llm
    rows: list[int] = []
    call = LayerDriver.__call__

    def counted(self, x, positions, meta):
        rows.append(x.shape[0])
        return call(self, x, positions, meta)

    conv = [[{"role": "user", "content": f"Repeat this passage word for word.\n\n{PASSAGE}"}]]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    monkeypatch.setattr(LayerDriver, "__call__", counted)
    got = spec.chat(conv, params, use_tqdm=False)[0].token_ids
    monkeypatch.undo()
    want = smollm2_gguf_llm.chat(conv, params, use_tqdm=False)[0].token_ids
    assert got == want
    assert rows.count(5) >= 3, f"verify steps of 5 rows must run in the driver, ran {rows}"
    assert spec.engine.stats().num_spec_accepted_tokens >= 12
