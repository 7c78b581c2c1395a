"""Paged attention equals plain causal attention over each request's own context.

A mixed batch (decodes, a fresh prefill, a chunk continuing a cached prefix) is laid out in a
paged cache with scattered blocks; every backend must match a dense per-request reference.
"""

from __future__ import annotations

import gc
import importlib.util
import weakref

import pytest
import torch

from workers.layers.attention import Attention, AttentionMetadata, select_backend
from workers.layers.backends.torch_ref import TorchBackend

BLOCK = 4
HQ, HK, D = 4, 2, 8
# (tokens already cached, tokens computed this step), decodes first as the runner orders them.
REQUESTS = [(5, 1), (16, 1), (39, 1), (0, 7), (20, 12), (3, 1 + BLOCK)]


def dense_reference(q, k, v, scale, softcap=None, sinks=None):
    """q: [Lq, HQ, D] for the last Lq positions of k/v: [L, HK, D]; causal, GQA by repetition;
    a tanh soft-cap on the scores and per-head sink logits as transformers' eager attention."""
    lq, lk = q.shape[0], k.shape[0]
    k = k.repeat_interleave(HQ // HK, dim=1)
    v = v.repeat_interleave(HQ // HK, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    allowed = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    logits = torch.cat([scores, sinks.view(HQ, 1, 1).expand(HQ, lq, 1)], dim=-1)
    return torch.einsum("hqk,khd->qhd", logits.softmax(-1)[..., :-1], v)


def run_batch(backend, device: str, dtype: torch.dtype = torch.float32, softcap=None, sinks=None):
    """Attention output of the REQUESTS batch and the dense reference, both [tokens, HQ, D]."""
    gen = torch.Generator().manual_seed(0)
    num_blocks = 64
    layer = Attention(HQ, D, HK, scale=D**-0.5, logit_softcap=softcap)
    if isinstance(backend, str):
        backend = select_backend(torch.device(device), backend, dtype)
    layer.backend = backend
    layer.k_cache = torch.zeros(num_blocks, BLOCK, HK, D, dtype=dtype, device=device)
    layer.v_cache = torch.zeros_like(layer.k_cache)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, qs, ks, vs, refs = [], [], [], [], []
    for cached, new in REQUESTS:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // BLOCK))]
        k = torch.randn(total, HK, D, generator=gen)
        v = torch.randn(total, HK, D, generator=gen)
        q = torch.randn(new, HQ, D, generator=gen)
        for pos in range(cached):  # earlier steps already wrote these
            layer.k_cache[table[pos // BLOCK], pos % BLOCK] = k[pos].to(dtype)
            layer.v_cache[table[pos // BLOCK], pos % BLOCK] = v[pos].to(dtype)
        tables.append(table)
        qs.append(q), ks.append(k[cached:]), vs.append(v[cached:])
        refs.append(dense_reference(q, k, v, layer.scale, softcap, sinks))
    meta, _ = AttentionMetadata.build(
        [c for c, _ in REQUESTS], [n for _, n in REQUESTS], tables, BLOCK, torch.device(device)
    )
    layer.backend.prepare(meta)
    cat = lambda xs: torch.cat(xs).to(device, dtype).flatten(1)  # noqa: E731
    sinks_dev = None if sinks is None else sinks.to(device)
    out = layer(cat(qs), cat(ks), cat(vs), meta, sinks=sinks_dev).view(-1, HQ, D).float().cpu()
    return out, torch.cat(refs)


# A cap of 1.5 bends most scores of this batch (|q.k| * D**-0.5 runs to about 3); sinks from
# well below to well above the scores.
SINKS = torch.tensor([-4.0, 0.0, 1.0, 3.0])


@pytest.mark.parametrize("paged_kernel", [True, False])
@pytest.mark.parametrize("softcap,sinks", [(1.5, None), (None, SINKS), (1.5, SINKS)])
def test_softcap_and_sinks_match_eager_attention(paged_kernel, softcap, sinks):
    """Decodes (C++ kernel or gather) and prefills, as transformers' eager attention computes."""
    from workers.layers.backends.torch_ref import TorchBackend

    out, ref = run_batch(
        TorchBackend(paged_kernel=paged_kernel), "cpu", softcap=softcap, sinks=sinks
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    plain, _ = run_batch(TorchBackend(paged_kernel=paged_kernel), "cpu")
    assert not torch.allclose(out, plain, atol=1e-3)  # the cap or the sinks mattered


def test_a_soft_cap_must_be_positive():
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="attn_logit_softcapping"):
            Attention(HQ, D, HK, scale=1.0, logit_softcap=bad)


def test_decode_and_prefill_layout():
    meta, positions = AttentionMetadata.build(
        [5, 0, 8], [1, 7, 12], [[9, 3], [1, 2], [4, 5, 6, 7, 8]], BLOCK, torch.device("cpu")
    )
    assert meta.num_decodes == 1
    assert meta.query_start_loc_cpu == [0, 1, 8, 20]
    assert meta.seq_lens_cpu == [6, 7, 20]
    assert positions.tolist() == [5] + list(range(7)) + list(range(8, 20))
    # Position 5 of request 0 is the second block of its table (block 3), offset 1.
    assert meta.slot_mapping[0].item() == 3 * BLOCK + 1
    assert meta.slot_mapping[1:8].tolist() == [4, 5, 6, 7, 8, 9, 10]
    assert meta.slot_mapping[8].item() == 6 * BLOCK  # position 8 opens the third block, block 6


def test_torch_backend_matches_dense_attention():
    out, ref = run_batch("torch", "cpu")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_kv_of_the_step_is_written_to_its_slots():
    gen = torch.Generator().manual_seed(1)
    layer = Attention(HQ, D, HK, scale=1.0)
    layer.backend = select_backend(torch.device("cpu"), "torch")
    layer.k_cache = torch.zeros(8, BLOCK, HK, D)
    layer.v_cache = torch.zeros(8, BLOCK, HK, D)
    meta, _ = AttentionMetadata.build([2], [3], [[6, 1]], BLOCK, torch.device("cpu"))
    layer.backend.prepare(meta)
    k = torch.randn(3, HK * D, generator=gen)
    layer(torch.randn(3, HQ * D, generator=gen), k, torch.randn(3, HK * D, generator=gen), meta)
    # Positions 2, 3 sit in block 6, position 4 starts block 1.
    assert torch.equal(layer.k_cache[6, 2:4].flatten(1), k[:2])
    assert torch.equal(layer.k_cache[1, 0].flatten(), k[2])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["torch", "triton", "flash_attn"])
def test_cuda_backends_match_dense_attention(backend):
    module = {"triton": "triton", "flash_attn": "flash_attn"}.get(backend)
    if module and importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")
    dtype = torch.float16 if backend == "flash_attn" else torch.float32
    tol = 2e-3 if backend == "flash_attn" else 1e-4
    out, ref = run_batch(backend, "cuda", dtype)
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    out, ref = run_batch(backend, "cuda", dtype, softcap=1.5)
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    if backend != "flash_attn":  # flash-attn has no sinks
        out, ref = run_batch(backend, "cuda", dtype, softcap=1.5, sinks=SINKS)
        torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def test_the_layer_passes_one_prebuilt_layer_kv_until_its_cache_or_sinks_change():
    """No object per layer per step: the backend gets the same LayerKV every call, rebuilt only
    when the cache is rebound (a weight update, a re-sized cache), an FP8 scale is bound, or
    other sinks are passed; and then it holds the new tensors."""
    layer = Attention(HQ, D, HK, scale=D**-0.5, sliding_window=3)
    layer.k_cache, layer.v_cache = torch.zeros(4, BLOCK, HK, D), torch.zeros(4, BLOCK, HK, D)
    first = layer.layer_kv()
    assert layer.layer_kv() is first
    assert (first.k_cache, first.v_cache) == (layer.k_cache, layer.v_cache)
    assert (first.p.scale, first.p.window, first.p.sinks) == (D**-0.5, 3, None)
    layer.v_cache = torch.zeros(8, BLOCK, HK, D)
    rebound = layer.layer_kv()
    assert rebound is not first and rebound.v_cache is layer.v_cache
    layer.kv_scale = torch.ones(2)
    scaled = layer.layer_kv()
    assert scaled is not rebound and scaled.p.kv_scale is layer.kv_scale
    sinks = torch.zeros(HQ)
    with_sinks = layer.layer_kv(sinks)
    assert with_sinks.p.sinks is sinks and layer.layer_kv(sinks) is with_sinks


def test_each_step_of_a_bound_layer_reuses_its_layer_kv():
    """Two forwards of the same layer hand the backend the same LayerKV object."""
    seen = []

    class Recording(TorchBackend):
        def forward(self, q, k, v, meta, kv):
            seen.append(kv)
            return super().forward(q, k, v, meta, kv)

    layer = Attention(HQ, D, HK, scale=1.0)
    layer.backend = Recording()
    layer.k_cache, layer.v_cache = torch.zeros(8, BLOCK, HK, D), torch.zeros(8, BLOCK, HK, D)
    for start in (0, 1):
        meta, _ = AttentionMetadata.build([start], [1], [[6]], BLOCK, torch.device("cpu"))
        layer.backend.prepare(meta)
        layer(torch.randn(1, HQ * D), torch.randn(1, HK * D), torch.randn(1, HK * D), meta)
    assert len(seen) == 2 and seen[0] is seen[1] and seen[0].k_cache is layer.k_cache


def test_unbinding_the_cache_frees_it_at_once():
    """The profile run's scratch pool and a weight update's freed cache are released when the
    layer drops them, not held on by the LayerKV of the last forward."""
    layer = Attention(HQ, D, HK, scale=1.0)
    layer.k_cache, layer.v_cache = torch.zeros(4, BLOCK, HK, D), torch.zeros(4, BLOCK, HK, D)
    old = weakref.ref(layer.k_cache)
    assert layer.layer_kv().k_cache is old()
    layer.k_cache = layer.v_cache = torch.empty(0)
    gc.collect()
    assert old() is None
