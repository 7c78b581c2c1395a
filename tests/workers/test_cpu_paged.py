"""The CPU paged-decode kernel equals gather + SDPA over each request's context.

Random caches with scattered blocks, contexts that end mid-block (and at a block's end, and one
token long), GQA groups of 1 to 4 query heads per KV head, float32 and bfloat16. The kernel is
built on first use (about 10 s on a fresh machine, cached afterwards).

Tolerances: float32 within 1e-5 of the gather + SDPA path (both accumulate in float32 and differ
only in summation order). bfloat16: within 2^-8 (one bfloat16 step at unit scale, the rounding
of the output) of a float32 computation on the same bfloat16 inputs, since the kernel accumulates
in float32 and rounds once; and within 2e-2 of the bfloat16 gather + SDPA path, which rounds
its own intermediates.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from workers.layers.attention import AttentionMetadata, AttentionParams, LayerKV
from workers.layers.backends import cpu_paged
from workers.layers.backends.torch_ref import TorchBackend

pytestmark = pytest.mark.skipif(
    cpu_paged.load() is None, reason="the CPU kernel cannot be built here"
)

BLOCK = 16
# Context lengths: mid-block, exactly one block, one token, several blocks ending mid-block.
SEQ_LENS = [1, 16, 17, 150, 199, 33, 200, 64]


def paged_inputs(hq: int, hk: int, d: int, dtype: torch.dtype, seed: int):
    """q [n, hq, d], caches with every request's blocks at random places, int32 tables and
    lengths."""
    gen = torch.Generator().manual_seed(seed)
    n = len(SEQ_LENS)
    blocks = [-(-s // BLOCK) for s in SEQ_LENS]
    num_blocks = sum(blocks) + 5  # spare blocks hold garbage no request may read
    k_cache = (torch.randn(num_blocks, BLOCK, hk, d, generator=gen) * 2).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK, hk, d, generator=gen).to(dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks) + 2  # padded past the longest table, as the runner pads
    tables = torch.zeros(n, width, dtype=torch.int32)
    for i, nb in enumerate(blocks):
        tables[i, :nb] = torch.tensor([free.pop() for _ in range(nb)], dtype=torch.int32)
    q = torch.randn(n, hq, d, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(SEQ_LENS, dtype=torch.int32)


def kernel(q, k_cache, v_cache, tables, seq_lens, scale, window=0, softcap=0.0, sinks=None):
    out = torch.empty(q.shape, dtype=q.dtype)
    cpu_paged.paged_decode(
        out, q, k_cache, v_cache, tables, seq_lens, scale, window, softcap, sinks
    )
    return out


def gather_sdpa(q, k_cache, v_cache, tables, seq_lens, scale, window=None):
    """The torch backend's gather + masked SDPA decode path."""
    n = q.shape[0]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(n, dtype=torch.long),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=seq_lens,
        block_tables=tables,
        num_decodes=n,
        query_start_loc_cpu=list(range(n + 1)),
        seq_lens_cpu=seq_lens.tolist(),
        block_size=BLOCK,
    )
    backend = TorchBackend(paged_kernel=False)
    backend.prepare(meta)
    return backend.decode(q, meta, LayerKV(k_cache, v_cache, AttentionParams(scale, window)))


def dense_fp32(q, k_cache, v_cache, tables, seq_lens, scale, window=None, softcap=0.0, sinks=None):
    """Per request, per head: softmax(q K^T * scale) V in float32 over the request's own tokens
    (its last `window` of them); scores capped at softcap * tanh(score / softcap) and a sink
    logit per head in the denominator when given."""
    hq, hk = q.shape[1], k_cache.shape[2]
    outs = []
    for i, s in enumerate(seq_lens.tolist()):
        ids = tables[i, : -(-s // BLOCK)].long()
        first = max(0, s - window) if window else 0
        k = k_cache[ids].flatten(0, 1)[first:s].float().repeat_interleave(hq // hk, dim=1)
        v = v_cache[ids].flatten(0, 1)[first:s].float().repeat_interleave(hq // hk, dim=1)
        s = torch.einsum("hd,khd->hk", q[i].float(), k) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        if sinks is None:
            p = s.softmax(-1)
        else:
            p = torch.cat([s, sinks[:, None]], dim=-1).softmax(-1)[:, :-1]
        outs.append(torch.einsum("hk,khd->hd", p, v))
    return torch.stack(outs)


@pytest.mark.parametrize("hq,hk,d", [(9, 3, 64), (4, 4, 128), (8, 2, 64), (2, 1, 32)])
@pytest.mark.parametrize("seed", [0, 1])
def test_float32_matches_gather_sdpa(hq, hk, d, seed):
    inputs = paged_inputs(hq, hk, d, torch.float32, seed)
    scale = d**-0.5
    torch.testing.assert_close(
        kernel(*inputs, scale), gather_sdpa(*inputs, scale), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("window", [1, 7, 16, 24, 150])
def test_sliding_window_attends_to_the_last_window_tokens_only(window):
    """Windows shorter than a block, a block long, spanning blocks, and longer than some
    contexts: kernel, gather + SDPA and a dense float32 reference agree."""
    inputs = paged_inputs(8, 2, 64, torch.float32, 5)
    out = kernel(*inputs, 0.125, window)
    torch.testing.assert_close(out, dense_fp32(*inputs, 0.125, window), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, gather_sdpa(*inputs, 0.125, window), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, kernel(*inputs, 0.125), atol=1e-3)  # the window mattered


@pytest.mark.parametrize("softcap,with_sinks", [(2.0, False), (0.0, True), (2.0, True)])
def test_softcap_and_sinks_match_a_dense_reference(softcap, with_sinks):
    """Gemma 2's tanh cap and gpt-oss's sinks (one per query head, here 8 heads over 2 KV heads,
    with a 24-token window as gpt-oss's sliding layers have)."""
    inputs = paged_inputs(8, 2, 64, torch.float32, 6)
    sinks = torch.linspace(-3.0, 4.0, 8) if with_sinks else None
    for window in (0, 24):
        out = kernel(*inputs, 0.125, window, softcap, sinks)
        ref = dense_fp32(*inputs, 0.125, window or None, softcap, sinks)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(out, kernel(*inputs, 0.125, window), atol=1e-3)


def test_bad_sinks_raise_value_error_naming_the_field():
    inputs = paged_inputs(8, 2, 64, torch.float32, 6)
    for bad in (torch.zeros(7), torch.zeros(8, dtype=torch.float64)):
        with pytest.raises(ValueError, match="sinks"):
            kernel(*inputs, 0.125, 0, 0.0, bad)
    with pytest.raises(ValueError, match="softcap"):
        kernel(*inputs, 0.125, 0, -1.0)


@pytest.mark.parametrize("hq,hk,d", [(9, 3, 64), (16, 8, 128)])
@pytest.mark.parametrize("seed", [0, 1])
def test_bfloat16_rounds_a_float32_result_once(hq, hk, d, seed):
    inputs = paged_inputs(hq, hk, d, torch.bfloat16, seed)
    scale = d**-0.5
    out = kernel(*inputs, scale)
    assert out.dtype == torch.bfloat16
    ref = dense_fp32(*inputs, scale)
    torch.testing.assert_close(out.float(), ref, atol=2**-8, rtol=2**-8)
    torch.testing.assert_close(
        out.float(), gather_sdpa(*inputs, scale).float(), atol=2e-2, rtol=2e-2
    )


def test_strided_query_of_a_fused_projection():
    """q may be a column slice of a fused QKV output: rows strided, heads contiguous."""
    q, k_cache, v_cache, tables, seq_lens = paged_inputs(9, 3, 64, torch.float32, 2)
    fused = torch.cat([q.flatten(1), torch.randn(q.shape[0], 2 * 3 * 64)], dim=1)
    strided = fused[:, : 9 * 64].view(-1, 9, 64)
    assert not strided.is_contiguous()
    torch.testing.assert_close(
        kernel(strided, k_cache, v_cache, tables, seq_lens, 0.125),
        kernel(q, k_cache, v_cache, tables, seq_lens, 0.125),
        atol=0,
        rtol=0,
    )


def test_rows_do_not_depend_on_the_batch():
    """A request's output is bitwise the same alone and among others (one task per request and
    head)."""
    q, k_cache, v_cache, tables, seq_lens = paged_inputs(9, 3, 64, torch.float32, 3)
    batched = kernel(q, k_cache, v_cache, tables, seq_lens, 0.125)
    for i in (0, 4, 7):
        alone = kernel(
            q[i : i + 1], k_cache, v_cache, tables[i : i + 1], seq_lens[i : i + 1], 0.125
        )
        assert torch.equal(alone[0], batched[i])


@pytest.mark.parametrize(
    "field,change",
    [
        ("block_tables", lambda t, s: (t.fill_(10_000), s)),
        ("seq_lens", lambda t, s: (t, s.fill_(0))),
        ("seq_lens", lambda t, s: (t, s.fill_(10_000))),
        ("block_tables/seq_lens", lambda t, s: (t.long(), s)),
    ],
)
def test_bad_tables_raise_value_error_naming_the_field(field, change):
    q, k_cache, v_cache, tables, seq_lens = paged_inputs(9, 3, 64, torch.float32, 4)
    tables, seq_lens = change(tables, seq_lens)
    with pytest.raises(ValueError, match=field):
        kernel(q, k_cache, v_cache, tables, seq_lens, 0.125)


def test_without_a_compiler_the_backend_gathers(tmp_path):
    """A fresh build directory and no C++ compiler: load() gives None and decode still matches;
    the fused layer ops, built by the same builder, leave CPU tensors to the torch path."""
    code = (
        "import torch; from workers.layers.backends import cpu_paged;"
        "from workers.layers.fused import fused_ops;"
        "assert fused_ops(torch.zeros(1), 'write_kv') is None;"
        "from workers.layers.backends.torch_ref import TorchBackend;"
        "from tests.workers.test_attention import run_batch;"
        "assert cpu_paged.load() is None; backend = TorchBackend(paged_kernel=True);"
        "assert backend.kernel is None; out, ref = run_batch(backend, 'cpu');"
        "torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)"
    )
    env = {
        **os.environ,
        "TORCH_EXTENSIONS_DIR": str(tmp_path),
        "CXX": str(tmp_path / "no-compiler"),
    }
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
