"""Expert parallelism end to end: an LLM over two Ray workers, each holding half of the experts
(`expert_parallel: true`), generates the greedy tokens of one process and reports the load of
each rank."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_llm_with_expert_parallel_2_generates_what_one_process_does(ray_cluster, tiny_checkpoint):
    from cluster.ray_executor import ray_executor
    from engine.executor import local_executor
    from engine.llm import LLM
    from scheduler import SamplingParams

    model_dir, _ = tiny_checkpoint("qwen2_moe")  # 8 experts, top-4, a shared expert
    prompts = [[1 + (11 * i + 3 * j) % 1000 for j in range(6 + 4 * i)] for i in range(3)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens, load = {}, {}
    for tp in (1, 2):
        llm = LLM(
            model=model_dir,
            tensor_parallel_size=tp,
            expert_parallel=True,
            device="cpu",
            load_progress=False,
            kv_cache_memory_gb=0.05,
            max_model_len=128,
            executor_factory=ray_executor if tp > 1 else local_executor,
        )
        try:
            tokens[tp] = [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
            load[tp] = llm.engine.expert_load()
        finally:
            llm.shutdown()
    assert tokens[2] == tokens[1]
    # Each rank computed its own experts' rows; together, every row that one process computed.
    assert len(load[2]) == 2 and min(load[2]) > 0
    assert sum(load[2]) == load[1][0]
