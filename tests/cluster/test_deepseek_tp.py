"""DeepSeek-V2, V3 and GLM-4-MoE over two Ray workers with expert parallelism: each rank holds half
of the attention heads (for MLA the latent projections and the cached latent rows whole) and half
of the routed experts, and the pair generates Hugging Face's greedy tokens, with chunked prefill,
a prefix hit and a recompute preemption in one batch. The KV bytes a token takes on each rank (the
latent row for MLA, half the KV heads for GLM) reach Ray's metrics export as
raylm_kv_cache_bytes_per_token, tagged by model."""

from __future__ import annotations

import re
import urllib.request

import pytest
import ray
import torch

from tests.deploy.conftest import wait_for

pytestmark = pytest.mark.slow

# Per rank, all 3 layers, fp32: MLA's latent row (48 + 16) is whole on each rank; GLM's two KV
# heads of 16 are split, K and V of one head each.
BYTES_PER_TOKEN = {"deepseek_v2": 3 * 64 * 4, "deepseek_v3": 3 * 64 * 4, "glm4_moe": 3 * 2 * 16 * 4}


def exported_bytes_per_token(model: str) -> float | None:
    port = ray._private.worker.global_worker.node.metrics_export_port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    pattern = rf'^ray_raylm_kv_cache_bytes_per_token{{[^}}]*model="{model}"[^}}]*}} (\S+)$'
    found = re.search(pattern, text, re.M)
    return float(found.group(1)) if found else None


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3", "glm4_moe"])
def test_tp2_expert_parallel_generates_hf_tokens(
    family, ray_cluster, tmp_path_factory, smollm2_tokenizer
):
    from transformers import AutoModelForCausalLM

    from cluster.metrics import ReplicaMetrics
    from cluster.ray_executor import ray_executor
    from engine.llm import LLM
    from scheduler import SamplingParams
    from tests.random_checkpoint import TINY_DEEPSEEK, TINY_GLM4_MOE, write_random_checkpoint
    from tests.workers.greedy import assert_greedy_match, hf_greedy

    path = str(tmp_path_factory.mktemp(f"tp-{family}"))
    spec = {**TINY_DEEPSEEK, "glm4_moe": TINY_GLM4_MOE}[family]
    write_random_checkpoint(spec, path, seed=sum(map(ord, family)), tokenizer=smollm2_tokenizer)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # 30, 70 and 45 tokens: the first runs alone, then again first in the batch (its full block
    # of 16 from the prefix cache) beside the others, which 8 blocks of 16 cannot hold as both
    # grow: one is preempted and recomputed.
    prompts = [
        [(7 * i) % 40000 + 100 for i in range(30)],
        [(11 * i) % 30000 + 900 for i in range(70)],
        list(range(300, 345)),
    ]
    refs = [hf_greedy(hf_model, p, 12) for p in prompts]
    llm = LLM(
        model=path,
        dtype="float32",
        tensor_parallel_size=2,
        expert_parallel=True,
        device="cpu",
        load_progress=False,
        num_gpu_blocks=8,
        preemption_mode="recompute",
        max_model_len=128,
        max_num_batched_tokens=16,
        executor_factory=ray_executor,
    )
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts[:1], params, use_tqdm=False)
        outs += llm.generate(prompts, params, use_tqdm=False)
        load = llm.engine.expert_load()
        bytes_per_token = llm.engine.kv_bytes_per_token
        preemptions = llm.engine.stats().num_preemptions
    finally:
        llm.shutdown()
    for i, (out, ref) in enumerate(zip(outs, refs[:1] + refs, strict=True)):
        assert_greedy_match(out.token_ids, ref, f"{family} TP=2 EP, output {i}")
    assert [out.num_cached_tokens for out in outs] == [0, 16, 0, 0]
    assert preemptions > 0
    assert len(load) == 2 and min(load) > 0  # each rank ran its own experts' rows
    assert bytes_per_token == BYTES_PER_TOKEN[family]
    ReplicaMetrics(f"tp-{family}", f"tiny-{family}").record_kv_layout(bytes_per_token)
    assert wait_for(lambda: exported_bytes_per_token(f"tiny-{family}"), 60) == bytes_per_token
