"""K-quant super-blocks for tests and benchmarks: random blocks, our own round-to-nearest
quantizer from floats, and a tiny Llama written as a GGUF file of K-quant tensors.

gguf-py de-quantizes K-quants but cannot quantize them, so `quantize_k` does: per 32-element
sub-block (16 for Q6_K) a float scale (and min) from the sub-block's range, then the super-block's
fp16 d (and dmin) from the largest of those, the 6-bit (8-bit) sub-block scales against it, and
each element rounded to the nearest code. Plain rounding, no search: these files test
bit-exact reading and kernels, not quantization quality.

Layouts (256 elements per super-block; gguf-py's Q4_K / Q5_K / Q6_K dequantize_blocks read them):
- Q4_K, 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
  (sub-block 2i in the low nibbles of bytes 32i..32i+31, sub-block 2i+1 in the high ones);
  element = d * scale * q - dmin * min.
- Q5_K, 176 bytes: as Q4_K with 32 bytes of fifth bits (bit i of byte j for element j of
  sub-block i) between the scales and the nibbles.
- Q6_K, 210 bytes: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales (one per 16
  elements), fp16 d; element = d * scale * (q - 32).
"""

from __future__ import annotations

import numpy as np

K_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
# byte offsets of the fp16 d (and dmin) in a super-block
K_SCALE_AT = {"Q4_K": {"d": 0, "dmin": 2}, "Q5_K": {"d": 0, "dmin": 2}, "Q6_K": {"d": 208}}


def random_k_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random super-blocks (uint8 [rows, cols / 256 * bytes]): every byte random, then finite
    fp16 d (and dmin) of either sign."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // 256, K_BYTES[qtype]), dtype=np.uint8)
    for at in K_SCALE_AT[qtype].values():
        scale = (rng.standard_normal((rows, cols // 256, 1)) * 0.01).astype(np.float16)
        raw[:, :, at : at + 2] = scale.view(np.uint8)
    return raw.reshape(rows, -1)


def _pack_scales_mins(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins [n, 8] into Q4_K's 12 bytes [n, 12]."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    return out


def _fp16_scale(values: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """(fp16 super-block scale [n, 1], integer sub-block multipliers [n, m]) with
    scale * multiplier close to values [n, m] >= 0."""
    d = (values.max(axis=1, keepdims=True) / levels).astype(np.float16)
    df = d.astype(np.float32)
    safe = np.where(df > 0, df, 1)
    mult = np.clip(np.rint(values / safe), 0, levels).astype(np.int32)
    return d, np.where(df > 0, mult, 0)


def quantize_k(qtype: str, w: np.ndarray) -> np.ndarray:
    """float [rows, cols] (cols a multiple of 256) as super-blocks (uint8 [rows, bytes])."""
    rows = w.shape[0]
    x = w.astype(np.float32).reshape(-1, 256)
    n = x.shape[0]
    if qtype == "Q6_K":
        sub = x.reshape(n, 16, 16)
        amax = np.abs(sub).max(axis=2)  # scale = amax / 31 (q - 32 in [-32, 31])
        d, sc = _fp16_scale(amax / 31, 127)
        step = d.astype(np.float32) * sc  # [n, 16]
        q = np.rint(sub / np.where(step > 0, step, 1)[..., None]).clip(-32, 31).astype(np.int32)
        q = (q + 32).reshape(n, 256)
        low, high = q & 0xF, q >> 4
        out = np.zeros((n, 210), dtype=np.uint8)
        for h in range(2):  # each half of 128: quarters t at shift 4 (t // 2) / 2 t
            part = slice(128 * h, 128 * h + 128)
            lq, hq = low[:, part].reshape(n, 4, 32), high[:, part].reshape(n, 4, 32)
            out[:, 64 * h : 64 * h + 32] = lq[:, 0] | (lq[:, 2] << 4)
            out[:, 64 * h + 32 : 64 * h + 64] = lq[:, 1] | (lq[:, 3] << 4)
            out[:, 128 + 32 * h : 160 + 32 * h] = (
                hq[:, 0] | hq[:, 1] << 2 | hq[:, 2] << 4 | (hq[:, 3] << 6)
            )
        out[:, 192:208] = sc.astype(np.int8).view(np.uint8)
        out[:, 208:210] = d.view(np.uint8)
        return out.reshape(rows, -1)
    top = 15 if qtype == "Q4_K" else 31
    sub = x.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0)  # the min is subtracted: an offset of -lo >= 0
    span = sub.max(axis=2) - lo
    d, sc = _fp16_scale(span / top, 63)
    dmin, mn = _fp16_scale(-lo, 63)
    step = d.astype(np.float32) * sc
    offset = dmin.astype(np.float32) * mn
    q = np.rint((sub + offset[..., None]) / np.where(step > 0, step, 1)[..., None])
    q = q.clip(0, top).astype(np.int32)
    nib = q & 0xF
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).reshape(n, 128)  # sub-blocks 2i, 2i + 1
    head = np.concatenate(
        [d.view(np.uint8), dmin.view(np.uint8), _pack_scales_mins(sc, mn)], axis=1
    )
    if qtype == "Q4_K":
        return np.concatenate([head, packed.astype(np.uint8)], axis=1).reshape(rows, -1)
    fifth = ((q >> 4) << np.arange(8).reshape(1, 8, 1)).sum(axis=1)  # bit i: sub-block i
    parts = [head, fifth.astype(np.uint8), packed.astype(np.uint8)]
    return np.concatenate(parts, axis=1).reshape(rows, -1)


# A tiny Llama whose every linear is K-quant: each of hidden (256) and intermediate (512) is whole
# super-blocks. Per layer one K type for the fused q/k/v and gate/up (a fused weight keeps blocks
# only when its parts share a type), the others mixed as a Q4_K_M file mixes them.
TINY_K_LAYERS = (
    {"qkv": "Q4_K", "attn_output": "Q5_K", "gate_up": "Q4_K", "ffn_down": "Q6_K"},
    {"qkv": "Q5_K", "attn_output": "Q6_K", "gate_up": "Q5_K", "ffn_down": "Q4_K"},
)
TINY_K_SHAPE = dict(hidden=256, intermediate=512, heads=4, kv_heads=2, context=512)


def _byte_level_vocab() -> list[str]:
    """GPT-2's 256 byte characters, one merge's product, then <s> and </s> (ids 257, 258)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())
    return [*chars, "Ġt", "<s>", "</s>"]


def write_tiny_kquant_gguf(
    path: str, seed: int = 0, layers: tuple[dict[str, str], ...] = TINY_K_LAYERS
) -> int:
    """A tiny random Llama as a GGUF file of K-quant linears (F32 norms, a Q4_K token embedding,
    a Q6_K output head) with a byte-level tokenizer; returns its vocabulary size. `layers` gives
    each layer's types (TINY_K_LAYERS' keys, and "v" where attn_v differs from q and k); types
    other than K-quants are quantized by gguf-py."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    s = TINY_K_SHAPE
    vocab = _byte_level_vocab()
    rng = np.random.default_rng(seed)
    hidden, inter, head_dim = s["hidden"], s["intermediate"], s["hidden"] // s["heads"]
    writer = GGUFWriter(path, "llama")
    writer.add_context_length(s["context"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(len(layers))
    writer.add_feed_forward_length(inter)
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(len(vocab))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(vocab)
    writer.add_token_types([1] * (len(vocab) - 2) + [3, 3])
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(len(vocab) - 2)
    writer.add_eos_token_id(len(vocab) - 1)

    def put(name: str, qtype: str | None, shape: tuple[int, int], std: float) -> None:
        w = (rng.standard_normal(shape) * std).astype(np.float32)
        if qtype is None:
            writer.add_tensor(name, w)
        else:
            kind = GGMLQuantizationType[qtype]
            raw = quantize_k(qtype, w) if qtype in K_BYTES else quantize(w, kind)
            writer.add_tensor(name, raw, raw_dtype=kind)

    def norm(name: str, size: int) -> None:
        writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(size)).astype(np.float32))

    put("token_embd.weight", "Q4_K", (len(vocab), hidden), 1.0)
    for i, types in enumerate(layers):
        norm(f"blk.{i}.attn_norm.weight", hidden)
        for part, rows in (("q", hidden), ("k", s["kv_heads"] * head_dim)):
            put(f"blk.{i}.attn_{part}.weight", types["qkv"], (rows, hidden), 0.08)
        v_type = types.get("v", types["qkv"])
        put(f"blk.{i}.attn_v.weight", v_type, (s["kv_heads"] * head_dim, hidden), 0.08)
        put(f"blk.{i}.attn_output.weight", types["attn_output"], (hidden, hidden), 0.08)
        norm(f"blk.{i}.ffn_norm.weight", hidden)
        put(f"blk.{i}.ffn_gate.weight", types["gate_up"], (inter, hidden), 0.08)
        put(f"blk.{i}.ffn_up.weight", types["gate_up"], (inter, hidden), 0.08)
        put(f"blk.{i}.ffn_down.weight", types["ffn_down"], (hidden, inter), 0.06)
    norm("output_norm.weight", hidden)
    put("output.weight", "Q6_K", (len(vocab), hidden), 0.6)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return len(vocab)
