"""An offline tensor-parallel LLM gives back its worker actors and placement group when dropped,
so the next one in the same process can start (gloo on CPU)."""

from __future__ import annotations

import gc
import weakref

import pytest

from scheduler import SamplingParams

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def tp2_llm(model_dir: str):
    from cluster.ray_executor import ray_executor
    from engine.llm import LLM

    return LLM(
        model=model_dir,
        tensor_parallel_size=2,
        device="cpu",
        load_progress=False,
        kv_cache_memory_gb=0.05,
        max_model_len=128,
        executor_factory=ray_executor,
    )


def live_groups() -> set[str]:
    from ray.util.placement_group import placement_group_table

    return {pg for pg, row in placement_group_table().items() if row["state"] != "REMOVED"}


@pytest.fixture
def room_for_one_tp2_engine(ray_cluster):
    """Every CPU of the test cluster but two taken, as a 2-GPU node holds one TP=2 engine: a
    second engine can start only once the first has given its two back."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    spare = ray.available_resources().get("CPU", 0.0) - 2
    filler = placement_group([{"CPU": spare}]) if spare > 0 else None
    if filler is not None:
        ray.get(filler.ready(), timeout=60)
    yield
    if filler is not None:
        remove_placement_group(filler)


def test_a_dropped_tp2_llm_frees_its_workers_for_the_next_one(
    room_for_one_tp2_engine, tiny_checkpoint
):
    model_dir, _ = tiny_checkpoint("llama")  # 4 heads, 2 KV heads, with a tokenizer
    before = live_groups()
    first = tp2_llm(model_dir)
    [group] = live_groups() - before
    expected = first.generate([[3, 4, 5, 6]], PARAMS, use_tqdm=False)[0].token_ids
    dropped = weakref.ref(first)
    del first  # no shutdown()
    gc.collect()
    assert dropped() is None
    assert group not in live_groups()  # removed, not left holding two CPUs
    with tp2_llm(model_dir) as second:
        [out] = second.generate([[3, 4, 5, 6]], PARAMS, use_tqdm=False)
    assert out.token_ids == expected
    # The with block gave the second one's group back too. Only this test's groups are compared:
    # a group that was live before may go meanwhile (test_multinode deletes its PP app without
    # blocking, and Serve removes that replica's group in the background).
    assert not live_groups() - before
