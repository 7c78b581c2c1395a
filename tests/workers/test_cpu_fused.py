"""The CPU fused layer ops (workers/layers/backends/cpu_fused.py) against the torch path the model
runs otherwise and against float64 references.

Bounds, float32 (ulp: 2^-24 relative, half a unit in the last place of a float32):
- rotary and the KV-cache write: bit for bit the torch path (rotary_torch, index_copy_), in
  bfloat16 too, for every rope type's table and a partial rotary table;
- RMSNorm: the residual sum bit for bit torch's `x + residual`; the norm within 8 ulp of a
  float64 reference (its sum of squares runs in float64, then five float32 roundings: the mean, +
  eps, sqrt, the reciprocal and two products; about 4 ulp in all) and within 1e-6 of the torch
  path, whose float32 sum adds its own error;
- SiLU-and-mul: within 8 ulp of a float64 reference for gates in [-80, 80] (its exp is within
  about 2 ulp, then the sum, the quotient and the product round once each).
In bfloat16 the norm and SiLU round their float32 value once more, so they may differ from the
torch path by one bfloat16 step (2^-8 relative) where the float32 values straddle a rounding
boundary.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from workers.layers import fused
from workers.layers.backends import cpu_fused
from workers.layers.norm import RMSNorm
from workers.layers.rotary import RotaryEmbedding, rotary_torch

pytestmark = pytest.mark.skipif(
    cpu_fused.load() is None, reason="the CPU fused ops cannot be built here"
)

ULP = 2.0**-24
DTYPES = [torch.float32, torch.bfloat16]
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
    },
}


def rand(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


def norm64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x, w = x.double(), w.double()
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def torch_norm(x, w, eps, residual=None):
    module = RMSNorm(x.shape[-1], eps).to(w.dtype)
    module.weight.data = w
    with fused.cpu_fused_off():
        return module(x, residual)


def within_ulps(out: torch.Tensor, ref: torch.Tensor, ulps: float) -> None:
    err = (out.double() - ref).abs()
    bound = ulps * ULP * ref.abs() + 1e-37
    worst = (err / bound).max().item() if err.numel() else 0.0
    assert worst <= 1.0, f"{worst * ulps:.2f} ulp, over the bound of {ulps}"


def one_bf16_step(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal, or one bfloat16 rounding step apart (relative 2^-8 of the larger)."""
    a, b = out.float(), ref.float()
    assert ((a - b).abs() <= 2.0**-8 * torch.maximum(a.abs(), b.abs())).all()


@given(
    rows=st.integers(0, 9),
    heads=st.sampled_from([None, 1, 3]),
    n=st.integers(1, 300),
    scale=st.sampled_from([1e-3, 1.0, 300.0]),
    eps=st.sampled_from([1e-6, 1e-5]),
    with_residual=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_rms_norm_float32_within_ulps_of_float64(rows, heads, n, scale, eps, with_residual, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = (rows, n) if heads is None else (rows, heads, n)
    # A strided view, as q/k of a fused qkv projection reach a per-head norm.
    x = rand(gen, rows, 2 * n * (heads or 1), scale=scale)[:, : n * (heads or 1)].view(shape)
    w = rand(gen, n)
    if with_residual:
        res = rand(gen, *shape, scale=scale)
        out, summed = cpu_fused.rms_norm(x, w, eps, res)
        ref_out, ref_summed = torch_norm(x, w, eps, res)
        assert torch.equal(summed, ref_summed)
        x = summed
    else:
        out, ref_out = cpu_fused.rms_norm(x, w, eps), torch_norm(x, w, eps)
    within_ulps(out, norm64(x, w, eps), 8)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6 * scale)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_bfloat16_is_the_torch_path_but_one_step(weight_dtype):
    gen = torch.Generator().manual_seed(3)
    x, res = rand(gen, 7, 4, 96).bfloat16(), rand(gen, 7, 4, 96).bfloat16()
    w = rand(gen, 96).to(weight_dtype)
    out, summed = cpu_fused.rms_norm(x, w, 1e-6, res)
    ref, ref_summed = torch_norm(x, w, 1e-6, res)
    assert out.dtype == ref.dtype == torch.promote_types(weight_dtype, torch.bfloat16)
    assert torch.equal(summed, ref_summed)
    one_bf16_step(out, ref)


def test_rms_norm_many_rows_split_over_threads():
    """Enough rows that the kernel splits them over torch's threads."""
    gen = torch.Generator().manual_seed(4)
    x, w = rand(gen, 64, 4096), rand(gen, 4096)
    within_ulps(cpu_fused.rms_norm(x, w, 1e-5), norm64(x, w, 1e-5), 8)


@given(
    rows=st.integers(0, 9),
    n=st.integers(1, 600),
    scale=st.sampled_from([0.1, 1.0, 8.0]),
    seed=st.integers(0, 2**31),
)
def test_silu_and_mul_float32_within_ulps_of_float64(rows, n, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    x = rand(gen, rows, 2 * n, scale=scale).clamp(-80, 80)
    gate, up = x[:, :n].double(), x[:, n:].double()
    within_ulps(cpu_fused.silu_and_mul(x), gate * torch.sigmoid(gate) * up, 8)


def test_silu_and_mul_bfloat16_and_extremes():
    gen = torch.Generator().manual_seed(5)
    x = rand(gen, 5, 2 * 1536, scale=4.0).bfloat16()
    ref = torch.nn.functional.silu(x[:, :1536]) * x[:, 1536:]
    one_bf16_step(cpu_fused.silu_and_mul(x), ref)
    # Saturated gates: silu(-inf-ish) is -0 (torch's 0 * tiny), silu(large) the gate; NaN stays.
    gate = torch.tensor([[-1e4, -100.0, 0.0, 100.0, 1e4, float("nan")]])
    out = cpu_fused.silu_and_mul(torch.cat([gate, torch.ones_like(gate)], dim=1))
    ref = torch.nn.functional.silu(gate)
    torch.testing.assert_close(out, ref, atol=1e-30, rtol=1e-6, equal_nan=True)
    # Leading dimensions beyond rows, as the torch path accepts.
    x3 = rand(gen, 2, 3, 8)
    torch.testing.assert_close(
        cpu_fused.silu_and_mul(x3), torch.nn.functional.silu(x3[..., :4]) * x3[..., 4:]
    )


@given(
    tokens=st.integers(0, 6),
    hq=st.integers(1, 5),
    group=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([8, 32, 64]),
    rope=st.sampled_from(sorted(ROPES)),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31),
)
def test_rotary_is_the_torch_path_bit_for_bit(tokens, hq, group, head_dim, rope, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    hk = max(hq // group, 1)
    table = RotaryEmbedding(head_dim, 512, ROPES[rope])
    qkv = rand(gen, tokens, (hq + 2 * hk) * head_dim, scale=3.0).to(dtype)
    q = qkv[:, : hq * head_dim].view(tokens, hq, head_dim)
    k = qkv[:, hq * head_dim : (hq + hk) * head_dim].view(tokens, hk, head_dim)
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    ref_q, ref_k = rotary_torch(q, k, positions, table.cos, table.sin)
    v_before = qkv[:, (hq + hk) * head_dim :].clone()
    out_q, out_k = cpu_fused.rotary_(q, k, positions, table.cos, table.sin)
    assert out_q is q and out_k is k  # in place, in the projection's buffer
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert torch.equal(qkv[:, (hq + hk) * head_dim :], v_before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_partial_table_rotates_its_width_only(dtype):
    """A table narrower than the head (partial_rotary_factor < 1) rotates its width, neox-style
    within it, and leaves the rest of each head as it was."""
    gen = torch.Generator().manual_seed(6)
    head_dim, width = 64, 16
    table = RotaryEmbedding(width, 100, ROPES["default"])
    q, k = rand(gen, 3, 4, head_dim).to(dtype), rand(gen, 3, 2, head_dim).to(dtype)
    positions = torch.tensor([0, 7, 99], dtype=torch.int32)
    ref_q, ref_k = rotary_torch(q[..., :width], k[..., :width], positions, table.cos, table.sin)
    tail_q, tail_k = q[..., width:].clone(), k[..., width:].clone()
    cpu_fused.rotary_(q, k, positions, table.cos, table.sin)
    assert torch.equal(q[..., :width], ref_q) and torch.equal(k[..., :width], ref_k)
    assert torch.equal(q[..., width:], tail_q) and torch.equal(k[..., width:], tail_k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_is_index_copy(dtype):
    gen = torch.Generator().manual_seed(7)
    kv = rand(gen, 5, 2 * 3 * 16).to(dtype)
    k, v = kv[:, :48].view(5, 3, 16), kv[:, 48:].view(5, 3, 16)
    caches = [rand(gen, 4, 8, 3, 16).to(dtype) for _ in range(2)]
    caches += [c.clone() for c in caches]
    slots = torch.tensor([31, 0, 9, 8, 17])
    cpu_fused.write_kv(k, v, caches[0], caches[1], slots)
    caches[2].view(-1, 3, 16).index_copy_(0, slots, k)
    caches[3].view(-1, 3, 16).index_copy_(0, slots, v)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_fused_ops_picks_the_cpu_module_and_the_switch_turns_it_off(monkeypatch):
    x = torch.zeros(2, 4)
    assert fused.fused_ops(x, "rms_norm") is cpu_fused
    assert fused.fused_ops(x, "gelu_and_mul") is None  # not a fused op
    with fused.cpu_fused_off():
        assert fused.fused_ops(x, "write_kv") is None
    assert fused.fused_ops(x, "write_kv") is cpu_fused
    monkeypatch.setenv("RAYLM_CPU_FUSED", "0")
    monkeypatch.setattr(fused, "_cpu_checked", False)  # both restored after the test
    monkeypatch.setattr(fused, "_cpu_module", cpu_fused)
    assert fused.fused_ops(x, "rotary") is None


def _table(width: int = 16, rows: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(rows, width), torch.zeros(rows, width)


def _qk(dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(2, 2, 16, dtype=dtype), torch.zeros(2, 1, 16, dtype=dtype)


BAD_CALLS = [
    ("x", lambda: cpu_fused.rms_norm(torch.zeros(2, 8, dtype=torch.float16), torch.ones(8), 1e-6)),
    ("x", lambda: cpu_fused.rms_norm(torch.zeros(2, 8, dtype=torch.int64), torch.ones(8), 1e-6)),
    ("x", lambda: cpu_fused.rms_norm(torch.zeros(2, 2, 2, 8), torch.ones(8), 1e-6)),
    ("x", lambda: cpu_fused.rms_norm(torch.zeros(8, 2).t(), torch.ones(8), 1e-6)),
    ("x", lambda: cpu_fused.rms_norm(torch.zeros(2, 8, device="meta"), torch.ones(8), 1e-6)),
    ("weight", lambda: cpu_fused.rms_norm(torch.zeros(2, 8), torch.ones(7), 1e-6)),
    ("weight", lambda: cpu_fused.rms_norm(torch.zeros(2, 8), torch.ones(8).double(), 1e-6)),
    ("eps", lambda: cpu_fused.rms_norm(torch.zeros(2, 8), torch.ones(8), float("nan"))),
    ("eps", lambda: cpu_fused.rms_norm(torch.zeros(2, 8), torch.ones(8), -1.0)),
    (
        "residual",
        lambda: cpu_fused.rms_norm(torch.zeros(2, 8), torch.ones(8), 1e-6, torch.zeros(3, 8)),
    ),
    (
        "residual",
        lambda: cpu_fused.rms_norm(
            torch.zeros(2, 8), torch.ones(8), 1e-6, torch.zeros(2, 8).bfloat16()
        ),
    ),
    ("x", lambda: cpu_fused.silu_and_mul(torch.zeros(2, 7))),
    ("x", lambda: cpu_fused.silu_and_mul(torch.zeros(2, 8, dtype=torch.float16))),
    (
        "x",
        lambda: cpu_fused.silu_and_mul(torch.zeros(())),
    ),
    ("positions", lambda: cpu_fused.rotary_(*_qk(), torch.tensor([0, 10]), *_table())),
    ("positions", lambda: cpu_fused.rotary_(*_qk(), torch.tensor([-1, 0]), *_table())),
    ("positions", lambda: cpu_fused.rotary_(*_qk(), torch.tensor([2**62, 0]), *_table())),
    ("positions", lambda: cpu_fused.rotary_(*_qk(), torch.tensor([0.0, 1.0]), *_table())),
    ("positions", lambda: cpu_fused.rotary_(*_qk(), torch.tensor([0]), *_table())),
    ("cos", lambda: cpu_fused.rotary_(*_qk(), torch.tensor([0, 1]), *_table(width=32))),
    ("cos", lambda: cpu_fused.rotary_(*_qk(), torch.tensor([0, 1]), *_table(width=7))),
    (
        "cos",
        lambda: cpu_fused.rotary_(
            *_qk(), torch.tensor([0, 1]), torch.zeros(10, 16).double(), torch.zeros(10, 16)
        ),
    ),
    (
        "sin",
        lambda: cpu_fused.rotary_(
            *_qk(), torch.tensor([0, 1]), torch.zeros(10, 16), torch.zeros(9, 16)
        ),
    ),
    (
        "k",
        lambda: cpu_fused.rotary_(
            torch.zeros(2, 2, 16), torch.zeros(2, 1, 16).bfloat16(), torch.tensor([0, 1]), *_table()
        ),
    ),
    (
        "q",
        lambda: cpu_fused.rotary_(
            torch.zeros(2, 32), torch.zeros(2, 1, 16), torch.tensor([0, 1]), *_table()
        ),
    ),
    (
        "slot_mapping",
        lambda: cpu_fused.write_kv(
            *_qk()[1:] * 2, *[torch.zeros(2, 4, 1, 16)] * 2, torch.tensor([0, 8])
        ),
    ),
    (
        "slot_mapping",
        lambda: cpu_fused.write_kv(
            *_qk()[1:] * 2, *[torch.zeros(2, 4, 1, 16)] * 2, torch.tensor([0, 1], dtype=torch.int32)
        ),
    ),
    (
        "k_cache",
        lambda: cpu_fused.write_kv(
            *_qk()[1:] * 2,
            torch.zeros(2, 4, 1, 16).bfloat16(),
            torch.zeros(2, 4, 1, 16),
            torch.tensor([0, 1]),
        ),
    ),
    (
        "v_cache",
        lambda: cpu_fused.write_kv(
            *_qk()[1:] * 2,
            torch.zeros(2, 4, 1, 16),
            torch.zeros(4, 2, 1, 16).transpose(0, 1),
            torch.tensor([0, 1]),
        ),
    ),
    (
        "v",
        lambda: cpu_fused.write_kv(
            torch.zeros(2, 1, 16),
            torch.zeros(2, 2, 16),
            *[torch.zeros(2, 4, 1, 16)] * 2,
            torch.tensor([0, 1]),
        ),
    ),
]


@pytest.mark.parametrize("field,call", BAD_CALLS)
def test_bad_input_is_a_value_error_naming_the_field(field, call):
    with pytest.raises(ValueError, match=field):
        call()
