"""How often each fused elementwise Triton op (workers/layers/triton_ops.py) differs bit for bit
from the torch path it replaces, on one CUDA device, at Llama-3.2-1B's shapes.

An H200 run found bf16 greedy tokens leaving HF's with these ops on and matching with them off;
this names the op that rounds differently, and by how many units in the last place.

    python bench/triton_rounding.py [--dtype bfloat16] [--tokens 256]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from workers.layers import triton_ops
from workers.layers.activation import SiluAndMul
from workers.layers.norm import RMSNorm
from workers.layers.rotary import RotaryEmbedding

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 2048, 32, 8, 64, 8192
ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units in the last place of a 16-bit float (0 where bit-identical)."""
    ia = a.contiguous().view(torch.int16).int()
    ib = b.contiguous().view(torch.int16).int()
    # Map the sign-magnitude bit patterns onto a monotone integer line.
    ia = torch.where(ia < 0, -32768 - ia, ia)
    ib = torch.where(ib < 0, -32768 - ib, ib)
    return (ia - ib).abs()


def report(name: str, fused: torch.Tensor, ref: torch.Tensor) -> None:
    diff = ulps(fused, ref)
    differing = int((diff > 0).sum())
    print(
        f"{name:28s} elements {diff.numel():>10,}  differing {differing:>8,} "
        f"({differing / diff.numel():.4%})  max ulp {int(diff.max())}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    dtype, t = getattr(torch, args.dtype), args.tokens
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dtype)

    norm = RMSNorm(HIDDEN, eps=1e-5).to("cuda", dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + randn(HIDDEN, scale=0.1))
    x, residual = randn(t, HIDDEN), randn(t, HIDDEN, scale=4.0)
    with torch.no_grad():
        report("rms_norm", triton_ops.rms_norm(x, norm.weight, norm.eps), norm._norm(x))
        fused_out, fused_res = triton_ops.rms_norm(x, norm.weight, norm.eps, residual)
        ref_res = x + residual
        report("rms_norm + residual (sum)", fused_res, ref_res)
        report("rms_norm + residual (norm)", fused_out, norm._norm(ref_res))

        rope = RotaryEmbedding(HEAD_DIM, 8192, ROPE).to("cuda")
        positions = torch.randint(0, 8192, (t,), device="cuda", generator=gen)
        q, k = randn(t, HEADS, HEAD_DIM), randn(t, KV_HEADS, HEAD_DIM)
        cos = rope.cos[positions].unsqueeze(1).to(dtype)
        sin = rope.sin[positions].unsqueeze(1).to(dtype)
        half = HEAD_DIM // 2
        ref_q = q * cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin
        ref_k = k * cos + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * sin
        fq, fk = triton_ops.rotary_(q.clone(), k.clone(), positions, rope.cos, rope.sin)
        report("rotary (q)", fq, ref_q)
        report("rotary (k)", fk, ref_k)

        gate_up = randn(t, 2 * INTERMEDIATE, scale=2.0)
        report("silu_and_mul", triton_ops.silu_and_mul(gate_up), SiluAndMul()(gate_up))
        gate = gate_up[:, :INTERMEDIATE]
        exact = torch.nn.functional.silu(gate.float()).to(dtype)
        report("  silu alone (fp32 then cast)", torch.nn.functional.silu(gate), exact)


if __name__ == "__main__":
    main()
