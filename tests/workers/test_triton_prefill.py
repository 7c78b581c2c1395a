"""The varlen paged-prefill kernel against the per-request SDPA path it replaces.

Run by Triton's CPU interpreter (`make test-triton`; shapes stay tiny, it is slow) or, on a machine
with a CUDA GPU, compiled on the GPU (bfloat16 there). Each batch packs chunks whose contexts are
partly cached (a prefix hit, an earlier chunk) and partly this step's tokens, in scattered blocks
of a cache whose unused slots hold noise, so that a stray read shows.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

# First, before triton or a kernel module is imported (see triton_env's docstring).
from tests.workers.triton_env import DEVICE, HALF

# isort: split
from tests.workers.test_attention import SINKS, run_batch
from workers.layers.attention import AttentionMetadata, AttentionParams, LayerKV, write_kv
from workers.layers.backends.torch_ref import TorchBackend
from workers.layers.backends.triton_prefill import (
    PrefillTiles,
    TritonBackend,
    _PrefillState,
    paged_prefill,
)

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


@dataclass(frozen=True)
class Batch:
    """(tokens already cached, tokens computed this step) per request, decodes first as the
    runner orders them; heads, head size, block size."""

    requests: tuple[tuple[int, int], ...]
    hq: int = 4
    hk: int = 2
    d: int = 16
    block_size: int = 16
    dtype: torch.dtype = torch.float32


def lengths_batch(bs: int, hq: int, hk: int = 1) -> Batch:
    """Fresh prompts of 1, bs - 1, bs and bs + 1 tokens; a prefix hit of one whole block; chunks
    that continue two positions before a block (and key tile) ends, and mid-block after two
    earlier chunks."""
    requests = (
        (0, 1),
        (0, bs - 1),
        (0, bs),
        (0, bs + 1),
        (bs, 3),
        (bs - 2, 5),
        (2 * bs + 3, bs - 2),
    )
    return Batch(requests, hq=hq, hk=hk, block_size=bs)


def run_both(batch: Batch, seed: int = 0, window=None, softcap=None, sinks=None, tiles=None):
    """The Triton backend's output and the torch backend's (gathered context, SDPA per chunk)
    on one step, [tokens, Hq, D] each."""
    gen = torch.Generator().manual_seed(seed)
    bs = batch.block_size
    per_req = [-(-(c + n) // bs) for c, n in batch.requests]
    num_blocks = sum(per_req) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(b)] for b in per_req]
    shape = (num_blocks, bs, batch.hk, batch.d)
    k_cache = torch.randn(shape, generator=gen).to(DEVICE, batch.dtype)
    v_cache = torch.randn(shape, generator=gen).to(DEVICE, batch.dtype)
    tokens = sum(n for _, n in batch.requests)
    q, k, v = (
        torch.randn(tokens, h, batch.d, generator=gen).to(DEVICE, batch.dtype)
        for h in (batch.hq, batch.hk, batch.hk)
    )
    meta, _ = AttentionMetadata.build(
        [c for c, _ in batch.requests],
        [n for _, n in batch.requests],
        tables,
        bs,
        torch.device(DEVICE),
    )
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    outs = []
    for backend in (TritonBackend(tiles=tiles), TorchBackend()):
        backend.prepare(meta)
        scale = batch.d**-0.5
        kv = LayerKV(k_cache, v_cache, AttentionParams(scale, window, softcap, sinks))
        outs.append(backend.forward(q, k, v, meta, kv))
    return outs[0].float(), outs[1].float()


def check(batch: Batch, **kwargs) -> None:
    out, ref = run_both(batch, **kwargs)
    tol = TOL[batch.dtype]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("hq,hk", [(2, 2), (4, 2), (4, 1)], ids=["gqa1", "gqa2", "gqa4"])
def test_prefill_equals_sdpa_across_lengths_block_sizes_and_gqa(bs, hq, hk):
    check(lengths_batch(bs, hq, hk))


def test_prefill_of_several_chunks_over_many_blocks():
    """Three chunks of one long prompt at once, as chunked prefill runs them on successive steps
    (here as separate requests with the same context lengths), in tiles larger than a block."""
    batch = Batch(((0, 40), (40, 40), (80, 37)), hq=4, hk=2, block_size=16)
    check(batch, tiles=PrefillTiles(32, 32))


def test_mixed_batch_of_decodes_and_prefill_chunks():
    """Decode rows go to the decode kernel, the chunks after them to the prefill kernel."""
    check(Batch(((5, 1), (33, 1), (0, 18), (16, 17), (7, 1 + 16)), hq=4, hk=2))


@pytest.mark.parametrize("window", [1, 5, 20])
def test_prefill_sliding_window(window):
    """Windows shorter than the chunk, than the cached prefix, and spanning both; under the
    window whole key tiles are skipped and the first one is masked in part."""
    check(Batch(((3, 1), (0, 23), (37, 12), (16, 1 + 16))), window=window)


@pytest.mark.parametrize(
    "softcap,sinks", [(1.5, None), (None, SINKS), (1.5, SINKS)], ids=["cap", "sinks", "both"]
)
def test_prefill_soft_cap_and_sinks(softcap, sinks):
    check(
        Batch(((9, 1), (0, 17), (20, 6))),
        softcap=softcap,
        sinks=sinks.to(DEVICE) if sinks is not None else None,
    )


def test_prefill_sinks_in_a_sliding_window():
    """gpt-oss's layers: sinks and a window, where early rows see the window's first tiles."""
    check(Batch(((0, 21), (30, 5))), window=6, softcap=1.5, sinks=SINKS.to(DEVICE))


def test_prefill_odd_head_size_and_group_of_three():
    """Head size 24 (padded to 32 in the kernel), 3 query heads per KV head (rows padded to 4),
    4-token blocks (four per key tile)."""
    check(Batch(((0, 9), (6, 7)), hq=6, hk=2, d=24, block_size=4), tiles=PrefillTiles(16, 16))


def test_prefill_16_bit():
    check(Batch(((0, 19), (17, 15)), hq=4, hk=1, dtype=HALF), window=12)


def test_triton_backend_on_a_mixed_batch_equals_dense_attention():
    """The backend as the model calls it (K/V written by the layer) against transformers-style
    eager attention, in 4-token blocks."""
    out, ref = run_batch(TritonBackend(), DEVICE, softcap=1.5, sinks=SINKS)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_the_switch_keeps_the_per_request_path():
    """varlen_prefill=False is the old path (torch's per-chunk state), for the benchmark."""
    batch = lengths_batch(16, 4, 2)
    meta, _ = AttentionMetadata.build([0, 4], [5, 3], [[1], [2]], 16, torch.device(DEVICE))
    backend = TritonBackend(varlen_prefill=False)
    backend.prepare(meta)
    assert not isinstance(meta.backend_state, _PrefillState)
    assert len(meta.backend_state.prefills) == 2
    backend.varlen_prefill = True
    backend.prepare(meta)
    assert meta.backend_state.max_prefill_len == 5
    check(batch)


def test_paged_prefill_rejects_bad_shapes():
    q = torch.zeros(4, 4, 16, device=DEVICE)
    cache = torch.zeros(2, 16, 2, 16, device=DEVICE)
    tables = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="block_size"):
        c6 = torch.zeros(2, 6, 2, 16, device=DEVICE)
        paged_prefill(q, c6, c6, tables, cu, lens, 4, 1.0)
    with pytest.raises(ValueError, match="sinks"):
        paged_prefill(q, cache, cache, tables, cu, lens, 4, 1.0, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="q: 3 query heads"):
        paged_prefill(q[:, :3], cache, cache, tables, cu, lens, 4, 1.0)
    with pytest.raises(ValueError, match="tile_n"):
        PrefillTiles(16, 24)


@pytest.mark.skipif(DEVICE != "cuda", reason="GPU tile shapes: too slow for the interpreter")
@pytest.mark.parametrize("bs", [16, 32])
def test_prefill_at_gpu_tiles_and_llama_heads(bs):
    """Llama-3.2-1B's heads (32 / 8, head size 64) in bf16 and the GPU's default tiles (128 rows
    by 64 keys): chunks that cross several query and key tiles, fresh and after cached
    prefixes."""
    dtype = torch.bfloat16
    requests = ((100, 1), (0, 300), (200, 150), (129, 65), (0, 2 * bs + 1), (1000, 37))
    check(Batch(requests, hq=32, hk=8, d=64, block_size=bs, dtype=dtype), window=None)
    check(Batch(requests[1:4], hq=32, hk=8, d=64, block_size=bs, dtype=dtype), window=100)
