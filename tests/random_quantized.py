"""Random quantized checkpoints in the published layouts (GPTQ, AWQ, compressed-tensors FP8).

`write_quantized_checkpoint` quantizes a random float checkpoint's linears (written by
tests/random_checkpoint.py) into one layout and saves beside it the float checkpoint of exactly
the de-quantized values: the reference a loader of that layout must reproduce.

The packing here is written from the formats' descriptions, element by element, independently of
the reader in workers/quant_weights.py (which unpacks with vectorised shifts), so that one
misreading of a layout does not cancel itself out.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a packed column holds output ORDER[i]


@dataclass(frozen=True, slots=True)
class Layout:
    method: str  # "gptq", "awq", "fp8"
    group_size: int = 128
    act_order: bool = False
    per_tensor: bool = False  # fp8: one scale per tensor instead of per output channel


def int4_codes(w: torch.Tensor, group_size: int, g_idx: torch.Tensor):
    """Asymmetric 4-bit quantization of w [n, k] by input groups g_idx: codes [n, k], zero points
    [n, groups] in 1..15, fp16-exact scales [n, groups]."""
    n, k = w.shape
    groups = k // group_size
    scales = torch.empty(n, groups)
    zeros = torch.empty(n, groups, dtype=torch.int64)
    codes = torch.empty(n, k, dtype=torch.int64)
    for g in range(groups):
        cols = (g_idx == g).nonzero().view(-1)
        part = w[:, cols]
        lo, hi = part.min(1).values.clamp(max=0), part.max(1).values.clamp(min=0)
        s = ((hi - lo) / 15).clamp(min=1e-4).half().float()
        z = (-lo / s).round().clamp(1, 15).long()
        scales[:, g], zeros[:, g] = s, z
        codes[:, cols] = ((part / s[:, None]).round().long() + z[:, None]).clamp(0, 15)
    return codes, zeros, scales


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (int64) as the int32 the checkpoints store."""
    return (words - ((words >> 31) << 32)).to(torch.int32)


def pack_gptq(codes, zeros, scales, g_idx) -> dict[str, torch.Tensor]:
    n, k = codes.shape
    qweight = torch.zeros(k // 8, n, dtype=torch.int64)
    for i in range(k):  # input i in nibble i % 8 of row i // 8
        qweight[i // 8] |= codes[:, i] << (4 * (i % 8))
    stored = zeros - 1  # AutoGPTQ's v1 format
    qzeros = torch.zeros(stored.shape[1], n // 8, dtype=torch.int64)
    for j in range(n):  # output j in nibble j % 8 of column j // 8
        qzeros[:, j // 8] |= stored[j] << (4 * (j % 8))
    return {
        "qweight": _to_int32(qweight),
        "qzeros": _to_int32(qzeros),
        "scales": scales.t().contiguous().half(),
        "g_idx": g_idx.to(torch.int32),
    }


def _pack_awq_columns(values: torch.Tensor) -> torch.Tensor:
    """[rows, n] nibbles -> int32 [rows, n / 8] in AWQ's order."""
    rows, n = values.shape
    out = torch.zeros(rows, n // 8, dtype=torch.int64)
    for c in range(n // 8):
        for i, col in enumerate(AWQ_PACK_ORDER):
            out[:, c] |= values[:, 8 * c + col] << (4 * i)
    return _to_int32(out)


def pack_awq(codes, zeros, scales) -> dict[str, torch.Tensor]:
    return {
        "qweight": _pack_awq_columns(codes.t().contiguous()),
        "qzeros": _pack_awq_columns(zeros.t().contiguous()),
        "scales": scales.t().contiguous().half(),
    }


def quantize_linear(
    w: torch.Tensor, layout: Layout, g_idx: torch.Tensor | None = None
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(the checkpoint tensors of one linear, keyed by suffix; its de-quantized float32 weight)."""
    n, k = w.shape
    if layout.method == "fp8":
        amax = w.abs().amax() if layout.per_tensor else w.abs().amax(1, keepdim=True)
        scale = (amax / 448.0).float().clamp(min=1e-12)
        q = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        stored = scale.reshape(1) if layout.per_tensor else scale.reshape(n, 1)
        return {"weight": q, "weight_scale": stored}, q.float() * scale
    if g_idx is None:
        g_idx = torch.arange(k) // layout.group_size
    codes, zeros, scales = int4_codes(w.float(), layout.group_size, g_idx)
    deq = (codes - zeros[:, g_idx]).float() * scales[:, g_idx]
    if layout.method == "gptq":
        return pack_gptq(codes, zeros, scales, g_idx), deq
    return pack_awq(codes, zeros, scales), deq


def quant_config(layout: Layout) -> dict:
    if layout.method == "gptq":
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": layout.group_size,
            "desc_act": layout.act_order,
            "sym": False,
            "checkpoint_format": "gptq",
        }
    if layout.method == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": layout.group_size,
            "zero_point": True,
            "version": "gemm",
        }
    strategy = "tensor" if layout.per_tensor else "channel"
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": strategy,
                    "symmetric": True,
                },
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "token",
                    "dynamic": True,
                },
            }
        },
        "ignore": ["lm_head"],
    }


def write_quantized_checkpoint(float_dir: str, out_dir: str, ref_dir: str, layout: Layout) -> None:
    """Quantize float_dir's linears into out_dir in `layout`; write the de-quantized float
    checkpoint to ref_dir. Act-order draws one input order per layer input (q/k/v share one,
    gate/up share one), as GPTQ's act-order gives parts that read the same input."""
    src = Path(float_dir)
    tensors = load_file(str(src / "model.safetensors"))
    quantized, reference = {}, {}
    gen = torch.Generator().manual_seed(7)
    orders: dict[tuple[str, str], torch.Tensor] = {}
    for name, t in tensors.items():
        prefix, _, part = name.rpartition(".")
        linear = prefix.rpartition(".")[2]
        if part != "weight" or linear not in LINEARS:
            quantized[name] = reference[name] = t
            continue
        g_idx = None
        if layout.act_order:
            key = (prefix.rpartition(".")[0], "qkv" if linear in LINEARS[:3] else linear)
            key = (key[0], "gate_up" if linear in ("gate_proj", "up_proj") else key[1])
            if key not in orders:
                perm = torch.randperm(t.shape[1], generator=gen)
                g = torch.empty(t.shape[1], dtype=torch.int64)
                g[perm] = torch.arange(t.shape[1]) // layout.group_size
                orders[key] = g
            g_idx = orders[key]
        parts, deq = quantize_linear(t.float(), layout, g_idx)
        quantized |= {f"{prefix}.{k}": v.contiguous() for k, v in parts.items()}
        reference[name] = deq.to(t.dtype)
    for directory, state, quant in ((out_dir, quantized, True), (ref_dir, reference, False)):
        shutil.copytree(src, directory, ignore=shutil.ignore_patterns("*.safetensors*"))
        save_file(state, str(Path(directory) / "model.safetensors"), metadata={"format": "pt"})
        if quant:
            config_path = Path(directory) / "config.json"
            config = json.loads(config_path.read_text())
            config["quantization_config"] = quant_config(layout)
            config_path.write_text(json.dumps(config, indent=2))


def write_gptq_fast(
    float_dir: str, out_dir: str, group_size: int = 128, device: str = "cpu"
) -> None:
    """Round-to-nearest GPTQ (v1, no act-order) of float_dir's linears into out_dir, vectorised on
    `device`: the benchmark's writer for published shapes, where the element-by-element packers
    above would take minutes. Only the INT4 bytes matter there, not the quality of the rounding."""
    from workers.loader import iterate_weights

    out: dict[str, torch.Tensor] = {}
    shifts = torch.arange(0, 32, 4, device=device, dtype=torch.int64)
    for name, t in iterate_weights(float_dir, progress=False):
        prefix, _, part = name.rpartition(".")
        if part != "weight" or prefix.rpartition(".")[2] not in LINEARS:
            out[name] = t.clone()
            continue
        w = t.to(device, torch.float32)
        n, k = w.shape
        g = w.view(n, k // group_size, group_size)
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        s = ((hi - lo) / 15).clamp(min=1e-4).half().float()
        z = (-lo / s).round().clamp(1, 15)
        codes = ((g / s[..., None]).round() + z[..., None]).clamp(0, 15).long().view(n, k)
        qweight = (codes.t().reshape(k // 8, 8, n) << shifts[None, :, None]).sum(1)
        qzeros = ((z.long() - 1).t().reshape(k // group_size, n // 8, 8) << shifts).sum(-1)
        out[f"{prefix}.qweight"] = _to_int32(qweight).cpu()
        out[f"{prefix}.qzeros"] = _to_int32(qzeros).cpu()
        out[f"{prefix}.scales"] = s.t().contiguous().half().cpu()
    src = Path(float_dir)
    shutil.copytree(src, out_dir, ignore=shutil.ignore_patterns("*.safetensors*"))
    save_file(out, str(Path(out_dir) / "model.safetensors"), metadata={"format": "pt"})
    config_path = Path(out_dir) / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = quant_config(Layout("gptq", group_size))
    config_path.write_text(json.dumps(config, indent=2))
