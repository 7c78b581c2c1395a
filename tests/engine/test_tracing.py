"""The engine's record of a traced request (engine/tracing.py): queue wait, each prefill chunk,
the decode steps, a KV load from the prefix cache's CPU tier and a disaggregated transfer, on a
real model; an untraced request leaves the tracer empty."""

from __future__ import annotations

import itertools
import random
import time

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.disagg import DecodeSide, PrefillSide, decode_request, prefill_request
from scheduler import EngineRequest, SamplingParams
from workers.kv_transfer import InProcessTransport

# 16 device blocks of 16 tokens and a 64-token step budget: a 200-token prompt takes four chunks,
# and two more such prompts evict it to the CPU tier.
BUDGET = 64
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    core = EngineCore(
        EngineConfig.from_kwargs(
            model=tiny_model_dir,
            device="cpu",
            load_progress=False,
            num_gpu_blocks=16,
            max_model_len=256,
            max_num_batched_tokens=BUDGET,
            num_cpu_tier_blocks=64,
        )
    )
    yield core
    core.shutdown()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 2000) for _ in range(200)] for _ in range(3)]


def run(
    engine: EngineCore,
    rid: str,
    prompt: list[int],
    traced: bool,
    request: EngineRequest | None = None,
) -> list[int]:
    if traced:
        engine.tracer.watch(rid, time.time_ns())
    engine.add_request(request or EngineRequest(rid, prompt, GREEDY))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


def test_a_traced_request_records_its_queue_chunks_and_decode_steps(engine, prompts):
    before = time.time_ns()
    run(engine, "a", prompts[0], traced=True)
    trace = engine.tracer.pop("a")
    assert trace is not None and engine.tracer.pop("a") is None  # popped once
    assert before <= trace.arrival_ns <= trace.scheduled_ns
    assert [(c.first, c.tokens) for c in trace.prefill] == [(0, 64), (64, 64), (128, 64), (192, 8)]
    decode = trace.decode
    assert decode.steps == decode.tokens == GREEDY.max_tokens - 1  # the 1st came with the prompt
    assert decode.first == 200
    chunks = [*trace.prefill, decode]
    assert all(c.start_ns < c.end_ns for c in chunks)
    assert all(a.end_ns <= b.start_ns for a, b in itertools.pairwise(chunks))  # in step order
    assert trace.finish_reason == "length" and trace.finish_ns >= chunks[-1].end_ns
    assert trace.kv_loads == [] and trace.num_cached_tokens == 0
    assert not engine.tracer.requests and not engine.tracer.pending and not engine.tracer.done


def test_a_prefix_loaded_back_from_the_cpu_tier_shows_as_a_kv_load(engine, prompts):
    first = run(engine, "turn1", prompts[1], traced=False)
    run(engine, "evict1", prompts[2], traced=False)
    run(engine, "evict2", prompts[0], traced=False)
    run(engine, "turn2", prompts[1] + first + [5] * 20, traced=True)
    trace = engine.tracer.pop("turn2")
    assert trace is not None
    assert trace.num_cached_tokens == 192  # the first turn's 12 full blocks came back
    assert len(trace.kv_loads) == 1
    start, end = trace.kv_loads[0]
    assert trace.arrival_ns <= start < end <= trace.prefill[0].start_ns
    assert trace.prefill[0].first == 192  # only the rest of the prompt is computed


def test_an_untraced_request_leaves_the_tracer_empty(engine, prompts):
    run(engine, "quiet", prompts[2][:40], traced=False)
    assert not engine.tracer.requests and not engine.tracer.pending and not engine.tracer.done


def test_a_cancelled_traced_request_is_popped_where_it_stopped(engine, prompts):
    fresh = [random.Random(8).randrange(3, 2000) for _ in range(200)]  # nothing of it cached
    engine.tracer.watch("gone", time.time_ns())
    engine.add_request(EngineRequest("gone", fresh, GREEDY))
    engine.step()  # its first chunk
    engine.abort_requests(["gone"])
    while engine.has_unfinished_requests():
        engine.step()
    trace = engine.tracer.pop("gone")
    assert trace is not None and trace.finish_ns is None
    assert [(c.first, c.tokens) for c in trace.prefill] == [(0, 64)]
    assert not engine.tracer.requests and not engine.tracer.pending


def test_a_disaggregated_decode_shows_the_transfer_as_a_remote_kv_load(engine, tiny_model_dir):
    """The module's engine prefills and sends the prompt's blocks; a decode engine traced for the
    request loads them (LOADING_KV) and computes only what follows them."""
    transport = InProcessTransport()
    decoder = EngineCore(
        EngineConfig.from_kwargs(
            model=tiny_model_dir, device="cpu", load_progress=False, num_gpu_blocks=48
        )
    )
    try:
        prefill, decode = PrefillSide(engine, transport), DecodeSide(decoder, transport)
        prompt = [random.Random(9).randrange(3, 2000) for _ in range(100)]  # 6 full blocks
        request = EngineRequest("pd", prompt, GREEDY)
        first = run(engine, "pd", prompt, traced=False, request=prefill_request(request))
        handle = prefill.export(request)
        decoder.tracer.watch("pd", time.time_ns())
        decode.add(decode_request(request, first), handle)
        while decoder.has_unfinished_requests():
            decoder.step()
        trace = decoder.tracer.pop("pd")
    finally:
        decoder.shutdown()
    assert trace is not None and trace.finish_reason == "length"
    assert trace.num_cached_tokens == 96
    (load,) = trace.kv_loads
    assert trace.arrival_ns <= load[0] < load[1] <= trace.prefill[0].start_ns
    # Only the prompt's tail and the prefill's token are computed here, in contiguous chunks.
    assert trace.prefill[0].first == 96
    assert all(a.first + a.tokens == b.first for a, b in itertools.pairwise(trace.prefill))
    assert trace.prefill[-1].first + trace.prefill[-1].tokens == 101
    assert trace.decode.steps == GREEDY.max_tokens - 2
