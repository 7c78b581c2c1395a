"""Ray Data batch inference (cluster/ray_data.py): an actor pool of raylm engines over a Dataset.

The pipeline runs on the two extra nodes of tests/cluster/conftest.py (the head's CPUs are held
by a filler, so each engine actor can only start on a node of its own) and its generations equal
the offline LLM's, greedy, for text prompts and for chats under a structured-output constraint.
"""

from __future__ import annotations

import math

import pytest

from cluster.ray_data import GenerationStage, map_generations
from scheduler import SamplingParams
from scheduler.structured_output import StructuredOutput
from tests.conftest import TEST_KV_GB

ENGINE = {"device": "cpu", "load_progress": False, "kv_cache_memory_gb": TEST_KV_GB}
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
CHOICES = ["yes", "no", "maybe"]
CHOSEN = SamplingParams(max_tokens=6, temperature=0.0, structured=StructuredOutput.choice(CHOICES))
WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "ran", "home", "fast", "slow"]
PROMPTS = [
    " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(2 + i % 5)) for i in range(100)
]
CHATS = [[{"role": "user", "content": p}] for p in PROMPTS[:12]]
HOSTILE = [2**64, -1, math.nan, 10**30]


def engine_actors() -> dict[str, str]:
    """The generation stage's actors that ever ran, by id, with the node each ran on, from the
    GCS's actor table (it keeps dead actors: Ray Data ends the pool with the dataset)."""
    from ray._private.state import actors

    return {
        actor_id: a["Address"]["NodeID"]
        for actor_id, a in actors().items()
        if a["ActorClassName"] == "MapWorker(MapBatches(GenerationActor))"
    }


def stage(**changes) -> GenerationStage:
    return GenerationStage(model="unused", sampling_params=GREEDY, **changes)


@pytest.mark.parametrize("value", HOSTILE + [0, 1.5, True, "4"])
def test_batch_size_out_of_bounds_is_refused_by_name(value):
    with pytest.raises(ValueError, match="^batch_size: "):
        stage(batch_size=value)


@pytest.mark.parametrize("value", HOSTILE + [0, (3, 2), (1, 2, 3), (1, -1), (2**64, 2**64)])
def test_concurrency_out_of_bounds_is_refused_by_name(value):
    with pytest.raises(ValueError, match="^concurrency: "):
        stage(concurrency=value)


@pytest.mark.parametrize("name", ["num_cpus", "num_gpus"])
@pytest.mark.parametrize("value", [*HOSTILE, math.inf, "1"])
def test_actor_resources_out_of_bounds_are_refused_by_name(name, value):
    with pytest.raises(ValueError, match=f"^{name}: "):
        stage(**{name: value})


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"prompt_column": None}, "prompt_column"),  # neither column
        ({"messages_column": "messages"}, "prompt_column"),  # both
        ({"prompt_column": ""}, "prompt_column"),
        ({"prompt_column": "x" * 10**6}, "prompt_column"),
        ({"prompt_column": None, "messages_column": 2**64}, "messages_column"),
        ({"output_prefix": ""}, "output_prefix"),
        ({"prompt_column": "generation_text"}, "output_prefix"),  # would be overwritten
    ],
)
def test_bad_columns_are_refused_by_name(changes, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        stage(**changes)


def test_engine_and_sampling_settings_are_checked_before_any_actor_starts():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        stage(engine_kwargs={"tensor_parallel_size": 2**64})
    with pytest.raises(ValueError, match="^sampling_params.n: "):
        GenerationStage(model="unused", sampling_params=SamplingParams(n=2))


@pytest.fixture
def head_cpus_held(ray_cluster, extra_nodes):
    """Every free CPU of the head held, so that the pool's actors (one CPU each) can only start on
    the two extra nodes, one on each."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    head = ray.available_resources().get("CPU", 0.0) - len(extra_nodes)
    filler = None
    if head > 0:
        filler = placement_group([{"CPU": head, "node:__internal_head__": 0.001}])
        ray.get(filler.ready(), timeout=60)
    yield extra_nodes
    if filler is not None:
        remove_placement_group(filler)


@pytest.mark.slow
def test_a_pipeline_over_two_nodes_gives_the_offline_llms_greedy_generations(
    head_cpus_held, tiny_checkpoint, llm_factory
):
    import ray

    model_dir, _ = tiny_checkpoint("llama")  # SmolLM2's tokenizer and chat template
    rows = [{"id": i, "prompt": p} for i, p in enumerate(PROMPTS)]
    ds = map_generations(
        ray.data.from_items(rows),
        GenerationStage(
            model=model_dir,
            sampling_params=GREEDY,
            engine_kwargs=ENGINE,
            batch_size=16,
            concurrency=2,
        ),
    )
    before = engine_actors()
    got = sorted(ds.take_all(), key=lambda r: r["id"])
    ran = {a: node for a, node in engine_actors().items() if a not in before}
    assert sorted(ran.values()) == sorted(n.node_id for n in head_cpus_held)  # one on each
    expected = llm_factory(model=model_dir, **{k: v for k, v in ENGINE.items() if k != "device"})
    want = expected.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [r["prompt"] for r in got] == PROMPTS
    assert [list(r["generation_token_ids"]) for r in got] == [o.token_ids for o in want]
    assert [r["generation_text"] for r in got] == [o.text for o in want]
    assert all(r["generation_num_tokens"] == 6 for r in got)
    assert all(r["generation_finish_reason"] == "length" for r in got)


@pytest.mark.slow
def test_chat_rows_under_a_choice_constraint_equal_the_offline_llms_chat(
    head_cpus_held, tiny_checkpoint, llm_factory
):
    import ray

    model_dir, _ = tiny_checkpoint("llama")
    rows = [{"id": i, "messages": c} for i, c in enumerate(CHATS)]
    ds = map_generations(
        ray.data.from_items(rows),
        GenerationStage(
            model=model_dir,
            sampling_params=CHOSEN,
            engine_kwargs=ENGINE,
            batch_size=5,
            prompt_column=None,
            messages_column="messages",
            output_prefix="reply",
        ),
    )
    got = sorted(ds.take_all(), key=lambda r: r["id"])
    offline = llm_factory(model=model_dir, **{k: v for k, v in ENGINE.items() if k != "device"})
    want = offline.chat(CHATS, CHOSEN, use_tqdm=False)
    assert [r["reply_text"] for r in got] == [o.text for o in want]
    assert all(r["reply_text"] in CHOICES for r in got)
    assert [r["reply_finish_reason"] for r in got] == [o.finish_reason for o in want]
