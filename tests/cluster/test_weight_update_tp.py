"""Weight updates and sleep of a tensor-parallel engine (TP=2, one Ray worker actor per rank): each
rank checks and loads its own shard, from a path or over a gloo weight group that the trainer (a
thread of this process, rank 0) and both ranks join; the greedy tokens after the update are those
of a one-process engine loaded with the new weights."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from scheduler.sampling_params import SamplingParams
from tests.random_checkpoint import TINY_FAMILIES, write_random_checkpoint
from workers.distributed import free_port
from workers.weight_transfer import WeightGroupSpec, open_group, send_weights

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[1 + (11 * i + 3 * j) % 1000 for j in range(6 + 4 * i)] for i in range(3)]
KW = dict(device="cpu", load_progress=False, kv_cache_memory_gb=0.05, max_model_len=128)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> tuple[str, ...]:
    root = tmp_path_factory.mktemp("tp-weights")
    spec = TINY_FAMILIES["llama"]  # 4 heads over 2 KV heads: TP=2 splits them
    return tuple(
        write_random_checkpoint(spec, str(root / k), seed=s).path for k, s in (("a", 11), ("b", 12))
    )


def tokens(llm) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def one_process(ckpts) -> dict[str, list[list[int]]]:
    from engine.llm import LLM

    out = {}
    for key, path in zip("ab", ckpts):
        with LLM(path, **KW) as llm:
            out[key] = tokens(llm)
    assert out["a"] != out["b"]
    return out


@pytest.fixture(scope="module")
def tp2(ray_cluster, ckpts):
    from cluster.ray_executor import ray_executor
    from engine.llm import LLM

    with LLM(ckpts[0], tensor_parallel_size=2, executor_factory=ray_executor, **KW) as llm:
        yield llm


def test_tp2_updates_from_a_path_and_refuses_a_bad_one(tp2, ckpts, one_process, tmp_path):
    assert tokens(tp2) == one_process["a"]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(ValueError, match="missing from the update"):
        tp2.update_weights(str(bad))
    assert tokens(tp2) == one_process["a"]
    tp2.update_weights(ckpts[1])
    assert tokens(tp2) == one_process["b"]
    tp2.sleep(1)
    tp2.wake_up()
    assert tokens(tp2) == one_process["b"]


def test_tp2_updates_over_a_gloo_weight_group(tp2, ckpts, one_process):
    tensors: dict[str, torch.Tensor] = {}
    for f in Path(ckpts[0]).glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    nan = {n: t.clone() for n, t in tensors.items()}
    nan["model.norm.weight"][0] = math.nan
    spec = WeightGroupSpec(f"tcp://127.0.0.1:{free_port()}", world_size=3, rank=0, timeout_s=120)
    refused: list[Exception] = []

    def trainer() -> None:
        group = open_group(spec, torch.device("cpu"))
        send_weights(group, tensors.items(), bucket_bytes=1 << 16)
        try:
            send_weights(group, nan.items())
        except ValueError as exc:
            refused.append(exc)

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    tp2.init_weight_group(spec.init_method, 3, rank=1, timeout_s=120)  # ranks 1 and 2
    try:
        assert tp2.update_weights(from_group=True, in_flight="recompute") > 0
        assert tokens(tp2) == one_process["a"]
        with pytest.raises(ValueError, match=r"model\.norm\.weight: holds NaN"):
            tp2.update_weights(from_group=True)
        assert tokens(tp2) == one_process["a"]
    finally:
        tp2.destroy_weight_group()
    thread.join(timeout=60)
    assert refused and "values" in str(refused[0])
