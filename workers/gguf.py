"""Read a GGUF file's tensors under Hugging Face names, quantized blocks kept as stored.

Q4_0, Q4_1 and Q8_0 tensors become GGUFWeights (codes copied bit for bit, fp16 scales widened
exactly to float32); Q4_K, Q5_K and Q6_K tensors become GGUFWeights holding the file's
super-blocks unchanged; F32, F16 and BF16 tensors become float32 tensors. Other block types
(Q5_0 and Q5_1, which llama.cpp's K-quant "M" files mix in, Q2_K, Q3_K, ...) are de-quantised to
float32 by gguf-py, the values transformers gives them, and their layers run in float: the file
loads as `quantization: none` would load those tensors, and a warning names the types. A type
gguf-py cannot read is refused, naming it and the tensor, and so are non-finite fp16 scales (d,
Q4_1's m, the K-quants' d and dmin) and non-finite de-quantised values.
llama.cpp stores Llama-architecture q and k rows interleaved for its rotary layout; they are put
back in Hugging Face order by permuting whole rows, which moves blocks without touching them.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType
from transformers import PretrainedConfig

from workers.gguf_file import GGUFTensor, read_gguf
from workers.layers.backends.gguf_cpu import K_BYTES
from workers.layers.quantized import BLOCK, GGUFWeight

logger = logging.getLogger(__name__)

# GGUF name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_TOP = re.compile(r"^(\w+)\.(weight|bias)$")
# Architectures whose converter interleaved the q and k rows (llama.cpp's convert_hf_to_gguf).
_PERMUTED_ARCHS = ("llama",)
_FLOAT_TYPES = ("F32", "F16", "BF16")
# type -> (bytes per block, offset of the codes, has a min)
_BLOCKS = {"Q4_0": (18, 2, False), "Q4_1": (20, 4, True), "Q8_0": (34, 2, False)}
# K-quant type -> byte offsets of its fp16 scales in a super-block (d, and dmin where it has one)
_K_SCALES = {"Q4_K": {"d": 0, "dmin": 2}, "Q5_K": {"d": 0, "dmin": 2}, "Q6_K": {"d": 208}}


def hf_name(name: str) -> str:
    """The Hugging Face name of a GGUF tensor name; ValueError for names we do not map."""
    if m := _LAYER.match(name):
        part = _LAYER_NAMES.get(m.group(2))
        if part is not None:
            return f"model.layers.{m.group(1)}.{part}.{m.group(3)}"
    elif (m := _TOP.match(name)) and m.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    raise ValueError(f"model: GGUF tensor {name!r} has no counterpart in the Llama family")


def blocks_to_weight(qtype: str, raw: np.ndarray, name: str) -> GGUFWeight:
    """GGUF blocks (uint8 [rows, bytes per row]) as a GGUFWeight; NaN or infinite scales raise."""
    if qtype in _K_SCALES:
        return _super_blocks_to_weight(qtype, raw, name)
    size, start, has_min = _BLOCKS[qtype]
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, size)
    scales = torch.from_numpy(blocks[:, :, 0:2].copy().view(np.float16)[..., 0]).float()
    mins = (
        torch.from_numpy(blocks[:, :, 2:4].copy().view(np.float16)[..., 0]).float()
        if has_min
        else None
    )
    for label, t in (("scales", scales), ("mins", mins)):
        if t is not None and not bool(torch.isfinite(t).all()):
            raise ValueError(f"model: GGUF tensor {name!r} has non-finite {qtype} {label}")
    codes = torch.from_numpy(np.ascontiguousarray(blocks[:, :, start:]).reshape(rows, -1))
    return GGUFWeight(qtype, codes, scales, mins, name)


def _super_blocks_to_weight(qtype: str, raw: np.ndarray, name: str) -> GGUFWeight:
    """K-quant super-blocks, kept as stored; their fp16 d (and dmin) must be finite."""
    size = K_BYTES[qtype]
    if raw.ndim != 2 or raw.shape[1] % size:
        raise ValueError(
            f"model: GGUF tensor {name!r} is not rows of whole {qtype} super-blocks of {size} bytes"
        )
    blocks = raw.reshape(raw.shape[0], -1, size)
    for label, at in _K_SCALES[qtype].items():
        scale = blocks[:, :, at : at + 2].copy().view(np.float16)
        if not bool(np.isfinite(scale).all()):
            raise ValueError(f"model: GGUF tensor {name!r} has non-finite {qtype} {label}")
    codes = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True))  # not the read-only map
    return GGUFWeight(qtype, codes, None, None, name)


def _tensor(t: GGUFTensor, name: str) -> torch.Tensor | GGUFWeight:
    qtype = t.tensor_type.name
    if qtype in _BLOCKS or qtype in _K_SCALES:
        return blocks_to_weight(qtype, np.asarray(t.data), name)
    data = np.asarray(t.data)
    if qtype == "BF16":  # numpy has no bfloat16: gguf-py hands over the raw 16-bit words
        out = torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16).float()
    elif qtype in _FLOAT_TYPES:
        out = torch.from_numpy(data.astype(np.float32))
    else:
        out = torch.from_numpy(_dequantized(data, t.tensor_type, name))
    if not bool(torch.isfinite(out).all()):
        raise ValueError(f"model: GGUF tensor {name!r} has non-finite values")
    return out.reshape(tuple(int(d) for d in reversed(t.shape)))


def _dequantized(data: np.ndarray, tensor_type: GGMLQuantizationType, name: str) -> np.ndarray:
    """A block type raylm's kernels do not read, as float32 through gguf-py (transformers' own
    de-quantisation of GGUF files)."""
    from gguf.quants import dequantize

    try:
        return np.ascontiguousarray(dequantize(data, tensor_type), dtype=np.float32)
    except NotImplementedError as exc:
        raise ValueError(
            f"model: GGUF tensor {name!r} is {tensor_type.name}, which neither raylm's kernels "
            "nor gguf-py can read"
        ) from exc


def _unpermute_rows(w: torch.Tensor | GGUFWeight, heads: int) -> torch.Tensor | GGUFWeight:
    """Undo llama.cpp's per-head interleave of rotary halves (a permutation of rows)."""
    rows = w.shape[0]
    index = torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)
    return w.index_rows(index) if isinstance(w, GGUFWeight) else w.index_select(0, index)


def iterate_gguf(
    path: str, config: PretrainedConfig
) -> Iterator[tuple[str, torch.Tensor | GGUFWeight]]:
    """(Hugging Face name, tensor or GGUF blocks) of every tensor in the file."""
    file = read_gguf(path)
    arch = file.architecture
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    as_float: Counter[str] = Counter()
    for t in file.tensors:
        name = hf_name(t.name)
        w = _tensor(t, t.name)
        qtype = t.tensor_type.name
        if qtype not in _BLOCKS and qtype not in _K_SCALES and qtype not in _FLOAT_TYPES:
            as_float[qtype] += 1
        if arch in _PERMUTED_ARCHS and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = _unpermute_rows(w, heads if ".q_proj." in name else kv_heads)
        yield name, w
    if as_float:
        kept = ", ".join((*_BLOCKS, *_K_SCALES))
        logger.warning(
            "%s: tensors de-quantised to float32, their layers run in float (raylm keeps %s): %s",
            path,
            kept,
            ", ".join(f"{n} {qtype}" for qtype, n in sorted(as_float.items())),
        )


__all__ = ["BLOCK", "blocks_to_weight", "hf_name", "iterate_gguf"]
