"""How often each fused elementwise Triton op (workers/layers/triton_ops.py) differs bit for bit
from the torch path it replaces, on one CUDA device, at Llama-3.2-1B's shapes.

An H200 run found bf16 greedy tokens leaving HF's with these ops on and matching with them off;
this names the op that rounds differently, and by how many units in the last place. The rotary
kernel is checked against workers.layers.rotary.rotary_torch (the model's torch path) at several
head sizes, GQA ratios and positions 0..8191, launched as the model launches it (FMA contraction
off) and, to show what moved it on that run, with Triton's default contraction on; each is also
compared with a float64 rotation of the same inputs, and the fused multiply-adds in each launch's
PTX are counted.

    python bench/triton_rounding.py [--dtype bfloat16] [--tokens 256]
    python bench/triton_rounding.py --interpret   # CPU, Triton's interpreter, float16, 8 tokens
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--interpret" in sys.argv:  # before triton is imported (tests/workers/triton_env.py says why)
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = "cpu" if "--interpret" in sys.argv else "cuda"

from workers.layers import triton_ops  # noqa: E402
from workers.layers.activation import SiluAndMul  # noqa: E402
from workers.layers.norm import RMSNorm  # noqa: E402
from workers.layers.rotary import RotaryEmbedding, rotary_torch  # noqa: E402

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


def report(name: str, fused: torch.Tensor, ref: torch.Tensor) -> int:
    """Print how many elements differ and by how many ulps; return the count."""
    diff = ulps(fused, ref)
    differing = int((diff > 0).sum())
    print(
        f"{name:28s} elements {diff.numel():>10,}  differing {differing:>8,} "
        f"({differing / diff.numel():.4%})  max ulp {int(diff.max())}"
    )
    return differing


def fma_count(handle) -> str:
    """Fused multiply-adds in a launch's PTX (`?` where Triton returned no compiled kernel)."""
    ptx = getattr(handle, "asm", {}).get("ptx") if handle is not None else None
    if ptx is None:
        return "?"
    return str(sum(ptx.count(op) for op in ("fma.rn", "mad.rn")))


def rotary_report(dtype: torch.dtype, t: int, randn, gen: torch.Generator) -> dict[bool, int]:
    """The rotary kernel against the torch path, with contraction off (as the model launches it)
    and on (Triton's default, the launch of the 2026-11-26 run); differing outputs of each."""
    differing = {False: 0, True: 0}
    shapes = [(HEAD_DIM, HEADS, KV_HEADS), (128, 32, 8), (128, 14, 2), (64, 8, 8)]
    for head_dim, hq, hk in shapes:
        rope = RotaryEmbedding(head_dim, 8192, ROPE).to(DEVICE)
        positions = torch.randint(0, 8192, (t,), device=DEVICE, generator=gen)
        positions[0] = 0
        qkv = randn(t, (hq + 2 * hk) * head_dim)  # q and k as views of qkv, as in the model
        q = qkv[:, : hq * head_dim].view(t, hq, head_dim)
        k = qkv[:, hq * head_dim : (hq + hk) * head_dim].view(t, hk, head_dim)
        ref_q, ref_k = rotary_torch(q, k, positions, rope.cos, rope.sin)
        exact_q = _rotate_f64(q, positions, rope, dtype)
        for fusion in (False, True):
            fq, fk = q.clone(), k.clone()
            handle = triton_ops.launch_rotary(fq, fk, positions, rope.cos, rope.sin, fusion)
            label = f"rotary{' FMA on' if fusion else ''} d{head_dim} {hq}/{hk}"
            differing[fusion] += report(f"{label} (q)", fq, ref_q)
            differing[fusion] += report(f"{label} (k)", fk, ref_k)
            err = (fq.double() - exact_q).abs().max().item()
            print(f"    PTX fused multiply-adds {fma_count(handle)}; max |q - float64| {err:.3e}")
        err = (ref_q.double() - exact_q).abs().max().item()
        print(f"    torch path: max |q - float64| {err:.3e}")
    return differing


def _rotate_f64(
    x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, dtype: torch.dtype
) -> torch.Tensor:
    """x rotated in float64 with the table cast to `dtype` (the inputs both paths see)."""
    cos = rope.cos[positions].unsqueeze(1).to(dtype).double()
    sin = rope.sin[positions].unsqueeze(1).to(dtype).double()
    x = x.double()
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--interpret", action="store_true", help="CPU interpreter, float16")
    args = parser.parse_args()
    if args.interpret:  # bfloat16 does not work in the interpreter
        args.dtype, args.tokens = "float16", min(args.tokens, 8)
    elif not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or --interpret)")
    dtype, t = getattr(torch, args.dtype), args.tokens
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=DEVICE, generator=gen) * scale).to(dtype)

    if DEVICE == "cuda":
        print(
            f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, {args.dtype}, {t} tokens"
        )
    norm = RMSNorm(HIDDEN, eps=1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + randn(HIDDEN, scale=0.1))
    x, residual = randn(t, HIDDEN), randn(t, HIDDEN, scale=4.0)
    with torch.no_grad():
        report("rms_norm", triton_ops.rms_norm(x, norm.weight, norm.eps), norm._norm(x))
        fused_out, fused_res = triton_ops.rms_norm(x, norm.weight, norm.eps, residual)
        ref_res = x + residual
        report("rms_norm + residual (sum)", fused_res, ref_res)
        report("rms_norm + residual (norm)", fused_out, norm._norm(ref_res))

        rotary = rotary_report(dtype, t, randn, gen)

        gate_up = randn(t, 2 * INTERMEDIATE, scale=2.0)
        report("silu_and_mul", triton_ops.silu_and_mul(gate_up), SiluAndMul()(gate_up))
        gate = gate_up[:, :INTERMEDIATE]
        exact = torch.nn.functional.silu(gate.float()).to(dtype)
        report("  silu alone (fp32 then cast)", torch.nn.functional.silu(gate), exact)
    print(
        f"rotary bit-exact with the torch path as launched (FMA contraction off): "
        f"{rotary[False] == 0} ({rotary[False]} differing); with contraction on: "
        f"{rotary[True]} differing"
    )


if __name__ == "__main__":
    main()
