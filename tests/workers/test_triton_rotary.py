"""The fused rotary kernel equals the torch path the model runs (workers.layers.rotary.rotary_torch)
bit for bit: same table rows cast to the activation dtype, each product and the sum rounded to
it.

Without a GPU this runs in Triton's CPU interpreter in float16 and float32 (bfloat16 does not work
there, tests/workers/triton_env.py); on a CUDA machine the compiled kernel runs, in bfloat16 too.
The interpreter checks the kernel's indexing and its order of roundings; only a GPU run shows what
the compiler does to them (bench/triton_rounding.py: it contracted a product and the sum into one
fused multiply-add until the launch turned that off).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

# First, before triton or a kernel module is imported (see triton_env's docstring).
from tests.workers.triton_env import DEVICE, HALF

# isort: split
from workers.layers import triton_ops
from workers.layers.rotary import RotaryEmbedding, rotary_torch

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
YARN = {  # cos and sin scaled by 0.1 ln(4) + 1
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 2048,
}


def longrope(dim: int) -> dict:
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 512,
        "short_factor": [1.0 + i / dim for i in range(dim // 2)],
        "long_factor": [2.0 + 3 * i / dim for i in range(dim // 2)],
    }


def check(
    head_dim: int,
    hq: int,
    hk: int,
    dtype: torch.dtype,
    rope: dict,
    positions: list[int],
    max_position: int,
    fused_qkv: bool = True,
    scale: float = 1.0,
) -> None:
    emb = RotaryEmbedding(head_dim, max_position, rope).to(DEVICE)
    rows = torch.tensor(positions) + emb.long_offset * (torch.tensor(positions) >= 512)
    rows = rows.to(DEVICE)
    gen = torch.Generator().manual_seed(head_dim * 31 + hq * 7 + hk)
    t = len(positions)
    if fused_qkv:  # q and k as the attention layer has them: views of one qkv row per token
        qkv = (torch.randn(t, (hq + 2 * hk) * head_dim, generator=gen) * scale).to(DEVICE, dtype)
        q = qkv[:, : hq * head_dim].view(t, hq, head_dim)
        k = qkv[:, hq * head_dim : (hq + hk) * head_dim].view(t, hk, head_dim)
    else:
        q = (torch.randn(t, hq, head_dim, generator=gen) * scale).to(DEVICE, dtype)
        k = (torch.randn(t, hk, head_dim, generator=gen) * scale).to(DEVICE, dtype)
    ref_q, ref_k = rotary_torch(q, k, rows, emb.cos, emb.sin)
    out_q, out_k = triton_ops.rotary_(q, k, rows, emb.cos, emb.sin)
    for name, out, ref in (("q", out_q, ref_q), ("k", out_k, ref_k)):
        differing = (out != ref).sum().item()
        assert differing == 0, (
            f"{name}: {differing} of {out.numel()} differ, max |diff| "
            f"{(out.double() - ref.double()).abs().max().item()}"
        )


# Head sizes of Llama/Qwen (64, 128), Phi-3 (96: half not a power of two), Gemma (256) and tiny.
@pytest.mark.parametrize("dtype", [HALF, torch.float32])
@pytest.mark.parametrize(
    "head_dim, hq, hk",
    [(64, 32, 8), (128, 14, 2), (96, 4, 4), (256, 8, 1), (32, 4, 2)],
)
def test_rotary_kernel_is_bit_exact_with_the_torch_path(head_dim, hq, hk, dtype):
    """GQA ratios 4, 7, 1 and 8; positions from 0 to the table's last row."""
    positions = [0, 1, 2, 17, 255, 1000, 4095, 8191, 32767]
    check(head_dim, hq, hk, dtype, LLAMA3, positions, max_position=32768)


@pytest.mark.parametrize("dtype", [HALF, torch.float32])
@pytest.mark.parametrize(
    "rope", [{"rope_type": "default", "rope_theta": 10000.0}, YARN], ids=["default", "yarn"]
)
def test_rotary_kernel_is_bit_exact_for_each_rope_table(rope, dtype):
    """The table's rope type changes only its values (yarn also scales them), not the rounding."""
    check(64, 8, 2, dtype, rope, [0, 3, 64, 511, 2047, 4095], max_position=4096)


def test_rotary_kernel_is_bit_exact_on_the_long_factor_rows():
    """LongRoPE: positions past the original length read the table's second half."""
    check(64, 4, 2, HALF, longrope(64), [0, 5, 511, 512, 900, 1023], max_position=1024)


def test_rotary_kernel_is_bit_exact_on_separate_tensors_and_large_values():
    """Contiguous q and k (not views of one qkv row), values up to ~100: the products' rounding
    decides the last bits of every output."""
    check(128, 8, 8, HALF, LLAMA3, list(range(0, 8192, 819)), 8192, fused_qkv=False, scale=30.0)


_COMPILE = """
import inspect, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from workers.layers import triton_ops

fusion_of_the_launch = inspect.signature(triton_ops.launch_rotary).parameters["fp_fusion"].default
ints = ["stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_c"]
ints += ["num_q_heads", "num_k_heads"]
out = {}
for dt in ("bf16", "fp16"):
    sig = {"q_ptr": "*" + dt, "k_ptr": "*" + dt, "cos_ptr": "*fp32", "sin_ptr": "*fp32",
           "pos_ptr": "*i64", **{name: "i32" for name in ints},
           "HALF": "constexpr", "BLOCK_H": "constexpr", "BLOCK_HALF": "constexpr"}
    for name, fusion in (("launch", fusion_of_the_launch), ("fusion_on", True)):
        src = ASTSource(fn=triton_ops._rotary_kernel, signature=sig,
                        constexprs={"HALF": 32, "BLOCK_H": 32, "BLOCK_HALF": 32})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                             options={"enable_fp_fusion": fusion}).asm["ptx"]
        out[dt + " " + name] = {op: len(re.findall(op, ptx)) for op in ("fma.rn", "mul.rn")}
print(json.dumps(out))
"""


def test_the_rotary_launch_compiles_to_separately_rounded_products_and_sums():
    """Compiled for an H100/H200 (sm_90: PTX needs no GPU), as launch_rotary launches it: every
    product and sum its own rounded instruction, no fused multiply-add. With Triton's default
    contraction the same kernel compiles to fma.rn.bf16, the cause of the H200's mismatch."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run(
        [sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600
    )
    if run.returncode != 0 and "GPUTarget" in run.stderr and "ImportError" in run.stderr:
        pytest.skip("this triton cannot compile for a named target")
    assert run.returncode == 0, run.stderr[-3000:]
    counts = json.loads(run.stdout.strip().splitlines()[-1])
    for dt in ("bf16", "fp16"):
        assert counts[f"{dt} launch"]["fma.rn"] == 0, counts
        assert counts[f"{dt} launch"]["mul.rn"] > 0, counts
        assert counts[f"{dt} fusion_on"]["fma.rn"] > 0, counts  # the check would see a regression
