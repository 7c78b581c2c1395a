"""Async scheduling on vs off: the same tokens for every request, on a real model (CPU).

Engines over the tiny random Llama (sharp logits: no near-ties) run the same requests with
async_scheduling on and off: greedy and seeded rows mixed, chunked prefill, forced preemption by
recompute and by swap, stop ids and stop strings, aborts while a step is in flight, structured
outputs and a failover resume. Every KV block is back in the pool and the runner holds no request
state once the engine is idle.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.llm import LLM
from scheduler import EngineRequest, SamplingParams
from scheduler.features_async import AsyncOverlap
from scheduler.structured_output import StructuredOutput
from tests.engine.paired_engines import SMALL_POOL, paired_engines

# 12 blocks of 16 tokens hold a fraction of the workload: preemption is certain.


@pytest.fixture(scope="module")
def model(tiny_checkpoint) -> str:
    return tiny_checkpoint("llama")[0]


@pytest.fixture(scope="module")
def llms(model):
    """(off, on) LLM pairs by preemption mode, built once."""
    yield from paired_engines(model, "async_scheduling", (False, True))


def workload(seed: int, n: int = 12) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of 1-90 tokens; greedy and seeded rows, penalties and logprobs mixed."""
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(n):
        prompts.append([rng.randrange(3, 2000) for _ in range(rng.randint(1, 90))])
        greedy = rng.random() < 0.5
        params.append(
            SamplingParams(
                max_tokens=rng.randint(1, 30),
                temperature=0.0 if greedy else rng.choice([0.7, 1.0]),
                seed=None if greedy else rng.randrange(1 << 30),
                top_k=rng.choice([0, 0, 20]),
                presence_penalty=rng.choice([0.0, 0.0, 0.5]),
                ignore_eos=rng.random() < 0.7,
                logprobs=rng.choice([None, None, 2]),
            )
        )
    return prompts, params


def generate(llm: LLM, prompts, params) -> list[tuple]:
    """Per request: tokens, finish reason, text, and the logprobs' token ids."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.token_ids, o.finish_reason, o.text, _logprob_ids(o.logprobs)) for o in outs]


def _logprob_ids(logprobs: list | None) -> list | None:
    # The values themselves move in the last bits with the batch a row shares a matmul with, and
    # the two modes batch a step's neighbours differently; the ranked ids must not move.
    return None if logprobs is None else [[t for t, _ in entry] for entry in logprobs]


def assert_idle_and_clean(engine: EngineCore) -> None:
    """Nothing in flight, every block free, no request state left in the runner."""
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # tells the runner of the last finishes
    assert engine.stats().num_free_blocks == engine.num_gpu_blocks
    assert engine.executor.runner.requests == {}
    assert all(r.num_output_placeholders == 0 for r in engine.scheduler.running)


def test_async_scheduling_is_a_setting_off_until_asked_for_and_off_under_tp():
    # Unset is off on every device until the overlapped path has been measured on a GPU.
    assert not EngineConfig(device="cpu").uses_async_scheduling()
    assert not EngineConfig(device="cuda").uses_async_scheduling()
    assert EngineConfig(device="cuda", async_scheduling=True).uses_async_scheduling()
    assert EngineConfig(device="cpu", async_scheduling=True).uses_async_scheduling()
    assert not EngineConfig(device="cuda", async_scheduling=False).uses_async_scheduling()
    # Only rank 0 samples: under tensor parallelism a step waits for the previous one's tokens.
    assert not EngineConfig(
        device="cuda", tensor_parallel_size=2, async_scheduling=True
    ).uses_async_scheduling()
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig.from_kwargs(async_scheduling="yes")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_mixed_batches_under_preemption_give_the_same_tokens(llms, mode):
    off, on = llms(mode)
    assert [type(f) for f in on.engine.scheduler.features] == [AsyncOverlap]
    assert off.engine.scheduler.features == []
    assert on.engine.pipeline is not None and off.engine.pipeline is None
    prompts, params = workload(seed=len(mode))
    # Every third request stops at a token it would sample midway (greedy or seeded: the same).
    free = off.generate(prompts, params, use_tqdm=False)
    params = [
        replace(sp, stop_token_ids=[out.token_ids[len(out.token_ids) // 2]]) if i % 3 == 0 else sp
        for i, (sp, out) in enumerate(zip(params, free))
    ]
    before = [llm.engine.stats().num_preemptions for llm in (off, on)]
    want, got = generate(off, prompts, params), generate(on, prompts, params)
    assert got == want
    assert {r[1] for r in want} == {"length", "stop"}  # stop ids and caps both reached
    for llm, n in zip((off, on), before):
        assert llm.engine.stats().num_preemptions > n, "the pool was meant to force preemption"
        assert_idle_and_clean(llm.engine)


def test_stop_strings_end_both_runs_at_the_same_text(llms):
    off, on = llms()
    prompts, _ = workload(seed=7, n=8)
    free = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    texts = [o.text for o in off.generate(prompts, free, use_tqdm=False)]
    # A stop string taken from the middle of each text: the frontend cuts there, mid-stream.
    params = [
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[t[len(t) // 2 :][:3]])
        for t in texts
    ]
    want, got = generate(off, prompts, params), generate(on, prompts, params)
    assert got == want
    assert sum(r[1] == "stop" for r in got) >= 4
    assert_idle_and_clean(on.engine)


def test_aborts_while_a_step_is_in_flight_keep_the_other_requests_exact(model):
    prompts, params = workload(seed=11, n=10)
    params = [
        SamplingParams(max_tokens=30, temperature=p.temperature, seed=p.seed, ignore_eos=True)
        for p in params
    ]
    abort_after = {f"r{i}": i for i in range(0, 10, 2)}  # r0 before any token, r2 after two, ...
    runs = []
    for on in (False, True):
        engine = EngineCore(
            EngineConfig.from_kwargs(
                model=model, device="cpu", load_progress=False, async_scheduling=on, **SMALL_POOL
            )
        )
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            engine.add_request(EngineRequest(f"r{i}", prompt, sp))
        engine.abort_requests(["r0"])
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                got = tokens.setdefault(out.request_id, [])
                got.extend(out.new_token_ids)
                # Under async scheduling the next step is already running: this abort lands
                # mid-step, and the token it is sampling for the request is dropped.
                if len(got) == abort_after.get(out.request_id, -1) and not out.finished:
                    engine.abort_requests([out.request_id])
        assert_idle_and_clean(engine)
        engine.shutdown()
        runs.append(tokens)
    assert runs[0] == runs[1]
    for rid, n in abort_after.items():
        assert len(runs[1].get(rid, [])) == n


def test_structured_outputs_give_the_same_tokens_and_obey(llms):
    off, on = llms()
    choices = ["red", "green", "blue", "yellow"]
    prompts, _ = workload(seed=5, n=6)
    params = [
        SamplingParams(
            max_tokens=12, temperature=0.9, seed=i, structured=StructuredOutput.choice(choices)
        )
        for i in range(3)
    ] + [
        SamplingParams(
            max_tokens=16,
            temperature=0.0 if i == 3 else 0.8,
            seed=i,
            structured=StructuredOutput("regex", r"[a-z]{2,6}-[0-9]{1,3}"),
        )
        for i in range(3, 6)
    ]
    want, got = generate(off, prompts, params), generate(on, prompts, params)
    assert got == want
    for _, reason, text, _ in got[:3]:
        assert reason == "stop" and text in choices
    assert_idle_and_clean(on.engine)


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.8, 1234)])
def test_a_failover_resume_continues_exactly_under_async_scheduling(llms, temperature, seed):
    """What the ingress does when a replica fails: prompt + the tokens already emitted."""
    off, on = llms()
    prompt = list(range(200, 230))
    params = SamplingParams(
        max_tokens=16, temperature=temperature, seed=seed, ignore_eos=True, presence_penalty=0.5
    )
    [whole] = off.generate([prompt], params, use_tqdm=False)
    for engine in (off.engine, on.engine):
        engine.add_request(
            EngineRequest("resumed", prompt, params, output_token_ids=whole.token_ids[:6])
        )
        tokens = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens.extend(out.new_token_ids)
        assert tokens == whole.token_ids[6:]
        assert_idle_and_clean(engine)
