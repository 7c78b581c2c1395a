"""The offline engine the GPU step benches time: every request of the batch fits at once, the KV
pool sized to exactly that on CUDA (so that a large card does not spend its memory on a pool the
run never touches), and the default pool on CPU for the smoke runs."""

from __future__ import annotations

from typing import Any


def step_llm(
    path: str,
    *,
    device: str,
    dtype: str,
    batch: int,
    request_tokens: int,
    budget: int,
    spare_blocks: int = 16,
    **settings: Any,
):
    """An LLM over `path` for `batch` requests of up to `request_tokens` tokens each (prompt,
    warm-up and timed steps), `budget` tokens a step; `settings` go to the LLM as they are."""
    from engine.llm import LLM

    blocks = -(-request_tokens // 16)
    pool = {"num_gpu_blocks": batch * blocks + spare_blocks} if device == "cuda" else {}
    return LLM(
        model=path,
        dtype=dtype,
        device=device,
        load_progress=False,
        max_num_seqs=batch,
        max_num_batched_tokens=budget,
        max_model_len=16 * blocks,
        kv_cache_memory_gb=0.25,
        **pool,
        **settings,
    )
