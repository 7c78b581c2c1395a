"""EngineCore: requests in, RequestOutputs out, one scheduled batch per step()."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from scheduler import EngineRequest, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama")
    core = EngineCore(
        EngineConfig(model=path, device="cpu", kv_cache_memory_gb=0.01, load_progress=False)
    )
    yield core
    core.shutdown()


def drain(engine: EngineCore) -> dict[str, list]:
    """Step until idle; every RequestOutput per request id, in order."""
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


def test_kv_pool_is_sized_from_kv_cache_memory_gb(engine):
    spec_bytes = 2 * 2 * 16 * 2 * 16 * 4  # K+V, 2 layers, 16 tokens, 2 KV heads, head_dim 16, fp32
    assert engine.num_gpu_blocks == int(0.01 * (1 << 30)) // spec_bytes
    assert engine.stats().num_free_blocks == engine.num_gpu_blocks
    assert engine.max_model_len == 512  # the checkpoint's max_position_embeddings


def test_a_max_model_len_past_the_model_s_positions_is_refused_before_any_step(tiny_checkpoint):
    """The checkpoint has 512 positions: 2048 would fail the whole engine (every request on it) at
    the first sequence that reaches position 512, so it is a config error, naming the field."""
    path, _ = tiny_checkpoint("llama")
    with pytest.raises(ValueError, match="scheduler.max_model_len: must fit in 64 bits"):
        EngineConfig.from_kwargs(max_model_len=2**64)  # no setting holds more than 64 bits
    with pytest.raises(ValueError, match="scheduler.max_model_len: must be <= 2147483647"):
        EngineConfig.from_kwargs(max_model_len=2**63 - 1)  # positions are 32-bit
    for too_long in (2048, 2**31 - 1):
        with pytest.raises(
            ValueError, match=f"max_model_len: {too_long} exceeds the model's context of 512"
        ):
            EngineCore(
                EngineConfig.from_kwargs(
                    model=path,
                    device="cpu",
                    kv_cache_memory_gb=0.01,
                    load_progress=False,
                    max_model_len=too_long,
                )
            )
    at_limit = EngineCore(
        EngineConfig.from_kwargs(
            model=path,
            device="cpu",
            kv_cache_memory_gb=0.01,
            load_progress=False,
            max_model_len=512,
        )
    )
    at_limit.shutdown()


def test_step_streams_one_token_per_request_until_max_tokens(engine):
    engine.add_request(
        EngineRequest(
            "a", [5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        )
    )
    engine.add_request(
        EngineRequest(
            "b", list(range(40, 90)), SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        )
    )
    seen = drain(engine)
    assert [len(o.new_token_ids) for o in seen["a"]] == [1, 1, 1]
    assert [o.finished for o in seen["b"]] == [False] * 4 + [True]
    assert seen["b"][-1].finish_reason == "length"
    assert seen["b"][-1].num_output_tokens == 5 and seen["b"][-1].num_prompt_tokens == 50


def test_eos_defaults_to_the_models(engine):
    engine.add_request(EngineRequest("eos-default", [1, 2, 3], SamplingParams(max_tokens=2)))
    assert 2 in engine.scheduler.requests["eos-default"].eos_token_ids
    drain(engine)


def test_abort_finishes_a_request_and_frees_its_blocks(engine):
    free = engine.stats().num_free_blocks
    engine.add_request(
        EngineRequest(
            "long", list(range(100, 164)), SamplingParams(max_tokens=400, ignore_eos=True)
        )
    )
    engine.step()
    assert engine.stats().num_free_blocks < free
    [out] = engine.abort_requests(["long"])
    assert out.finished and out.finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    engine.step()  # tells the runner, which drops the request's state
    assert "long" not in engine.executor.runner.requests
    assert engine.stats().num_free_blocks == free


@pytest.mark.parametrize("past_end", [False, True])
def test_a_token_id_outside_the_vocabulary_is_rejected_and_others_still_run(engine, past_end):
    bad_id = engine.vocab_size if past_end else -1
    engine.add_request(
        EngineRequest("fine", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    )
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request(EngineRequest("bad", [5, bad_id], SamplingParams(max_tokens=2)))
    seen = drain(engine)
    assert seen["fine"][-1].finished and "bad" not in seen


def test_duplicate_request_id_is_rejected(engine):
    engine.add_request(EngineRequest("dup", [1, 2, 3], SamplingParams(max_tokens=2)))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request(EngineRequest("dup", [1, 2, 3], SamplingParams(max_tokens=2)))
    drain(engine)


def test_seeded_sampling_is_reproducible_across_batches(engine):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7)
    engine.add_request(EngineRequest("s1", [9, 10, 11], params))
    first = drain(engine)["s1"]
    engine.add_request(EngineRequest("s2", [9, 10, 11], params))
    engine.add_request(
        EngineRequest("other", [3, 4, 5, 6], SamplingParams(max_tokens=8, temperature=1.0))
    )
    second = drain(engine)["s2"]
    assert [t for o in first for t in o.new_token_ids] == [
        t for o in second for t in o.new_token_ids
    ]


@pytest.mark.parametrize(
    "field, value",
    [
        ("dtype", "float64"),
        ("device", "tpu"),
        ("tensor_parallel_size", 0),
        ("kv_cache_memory_gb", 0),
        ("gpu_memory_utilization", 1.5),
        ("num_gpu_blocks", 0),
        ("max_model_len", 0),
        ("attention_backend", "xformers"),
        ("model", ""),
        ("seed", -1),
        ("seed", 2**64),
        ("kv_cache_memory_gb", float("nan")),
        ("cpu_threads", 0),
        ("tensor_parallel_size", True),
        ("process_niceness", -21),
        ("process_niceness", 20),
        ("process_niceness", 2**64),
        ("process_niceness", float("nan")),
        ("process_niceness", True),
        ("stream_interval", 0),
        ("stream_interval", -1),
        ("stream_interval", 2**64),
        ("stream_interval", float("nan")),
        ("stream_interval", 10**9),
        ("stream_interval", True),
    ],
)
def test_engine_config_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig.from_kwargs(**{field: value})


def test_engine_config_splits_scheduler_knobs():
    config = EngineConfig.from_kwargs(model="default", max_num_batched_tokens=32, policy="priority")
    assert config.scheduler.max_num_batched_tokens == 32 and config.scheduler.policy == "priority"
    with pytest.raises(ValueError, match="not_a_knob"):
        EngineConfig.from_kwargs(not_a_knob=1)


def test_swap_needs_a_cpu_pool_before_any_model_loads():
    with pytest.raises(ValueError, match="swap_space_gb or num_cpu_blocks"):
        EngineConfig.from_kwargs(preemption_mode="swap")
    assert (
        EngineConfig.from_kwargs(preemption_mode="swap", swap_space_gb=0.5).scheduler.num_cpu_blocks
        is None
    )


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.8, 1234)])
def test_a_resumed_request_continues_exactly_where_it_stopped(engine, temperature, seed):
    # What a migrated choice does: prompt + the tokens already emitted, the same parameters.
    prompt = list(range(200, 230))
    params = SamplingParams(
        max_tokens=12, temperature=temperature, seed=seed, ignore_eos=True, presence_penalty=0.5
    )
    engine.add_request(EngineRequest("whole", prompt, params))
    whole = [t for o in drain(engine)["whole"] for t in o.new_token_ids]
    engine.add_request(EngineRequest("resumed", prompt, params, output_token_ids=whole[:5]))
    seen = drain(engine)["resumed"]
    assert [t for o in seen for t in o.new_token_ids] == whole[5:]
    assert seen[-1].finish_reason == "length" and seen[-1].num_output_tokens == 12


def test_a_resumed_request_must_leave_room_to_generate():
    with pytest.raises(ValueError, match="^output_token_ids"):
        EngineRequest("r", [1, 2], SamplingParams(max_tokens=2), output_token_ids=[3, 4])


def test_the_routers_prefix_index_follows_the_engines_reports_by_their_changes(engine):
    """What a replica sends (RoutingStats of engine.prefix_report) leaves the router's index holding
    exactly the engine's cached blocks; from the second report on, the report says what changed."""
    from router.config import RoutingConfig
    from router.fleet import FleetState
    from router.stats import RoutingStats
    from scheduler import hash_prompt_blocks

    router = FleetState(RoutingConfig())
    reports = []
    for i, prompt in enumerate(
        [list(range(100, 164)), list(range(100, 148)) + list(range(300, 340))]
    ):
        engine.add_request(
            EngineRequest(f"prefix-{i}", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
        )
        drain(engine)
        reports.append(engine.prefix_report(4096))
        sent = RoutingStats(engine.stats(), prefix=reports[-1]).to_dict()  # through Serve
        router.on_stats("replica", RoutingStats.from_dict(sent), now=i)
        assert router.index.blocks_of("replica") == set(engine.scheduler.kv.pool.cached)
    shared = hash_prompt_blocks(list(range(100, 148)), engine.scheduler.kv.block_size)
    assert set(shared) <= router.index.blocks_of("replica")
    assert reports[1].base_id == reports[0].report_id
    assert set(reports[1].listed) == set(reports[1].hashes) - set(reports[0].hashes)
