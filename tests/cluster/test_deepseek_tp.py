"""DeepSeek-V2, V3 and GLM-4-MoE over two Ray workers with expert parallelism: each rank holds half
of the attention heads (for MLA the latent projections and the cached latent rows whole) and half
of the routed experts, and the pair generates Hugging Face's greedy tokens, with chunked
prefill."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3", "glm4_moe"])
def test_tp2_expert_parallel_generates_hf_tokens(
    family, ray_cluster, tmp_path_factory, smollm2_tokenizer
):
    from transformers import AutoModelForCausalLM

    from cluster.ray_executor import ray_executor
    from engine.llm import LLM
    from scheduler import SamplingParams
    from tests.random_checkpoint import TINY_DEEPSEEK, TINY_GLM4_MOE, write_random_checkpoint
    from tests.workers.greedy import assert_greedy_match, hf_greedy

    path = str(tmp_path_factory.mktemp(f"tp-{family}"))
    spec = {**TINY_DEEPSEEK, "glm4_moe": TINY_GLM4_MOE}[family]
    write_random_checkpoint(spec, path, seed=sum(map(ord, family)), tokenizer=smollm2_tokenizer)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [list(range(300, 345)), [(7 * i) % 40000 + 100 for i in range(30)]]
    refs = [hf_greedy(hf_model, p, 12) for p in prompts]
    llm = LLM(
        model=path,
        dtype="float32",
        tensor_parallel_size=2,
        expert_parallel=True,
        device="cpu",
        load_progress=False,
        kv_cache_memory_gb=0.05,
        max_model_len=128,
        max_num_batched_tokens=16,
        executor_factory=ray_executor,
    )
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        load = llm.engine.expert_load()
    finally:
        llm.shutdown()
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert_greedy_match(out.token_ids, ref, f"{family} TP=2 EP, prompt {i}")
    assert len(load) == 2 and min(load) > 0  # each rank ran its own experts' rows
