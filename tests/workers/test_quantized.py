"""GGUF blocks kept quantized: the kernels, the layout conversion, sharding, and the embedded model.

Tolerances: every path multiplies the exact de-quantised weights W. The float kernel and the
de-quantise + GEMM path differ from a float64 x @ W^T only by float32 summation:
|y - y64| <= 1e-5 * (|x| @ |W|^T) + 1e-6, a bound on reordered float32 sums of K <= 2048 terms.
The int8 kernel (VNNI builds) first rounds each 32-element block of x to its int8 grid (step
d_x = max|x_b| / 127), as llama.cpp does, and is otherwise exact (integer dot products): it adds
at most sum over blocks of (d_x / 2) * sum |w_b| to that bound.
De-quantisation itself is exact: the same bits as gguf-py's (and transformers' conversion).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from transformers import LlamaConfig

from workers.gguf import blocks_to_weight, hf_name, iterate_gguf
from workers.layers.backends import gguf_cpu
from workers.layers.linear import ColumnParallelLinear, RowParallelLinear, linear
from workers.layers.quantized import K_QTYPES, KERNEL_MAX_ROWS, GGUFWeight

_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
QTYPES = tuple(_BLOCK_BYTES)  # the 32-element types; the K-quants are tested in test_kquant.py


def raw_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random GGUF blocks (uint8 [rows, bytes per row]) with finite fp16 scales (and mins)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // 32, _BLOCK_BYTES[qtype]), dtype=np.uint8)
    raw[:, :, 0:2] = (rng.random((rows, cols // 32, 1)) * 0.05).astype(np.float16).view(np.uint8)
    if qtype == "Q4_1":
        raw[:, :, 2:4] = (
            (rng.standard_normal((rows, cols // 32, 1)) * 0.05).astype(np.float16).view(np.uint8)
        )
    return raw.reshape(rows, -1)


def weight(qtype: str, rows: int, cols: int, seed: int = 0) -> GGUFWeight:
    return blocks_to_weight(qtype, raw_blocks(qtype, rows, cols, seed), "w")


# The int8 kernel rounds activations as llama.cpp does, so its greedy tokens may part from the
# fp32 path's at wider near-ties, and its logprobs move more than float rounding moves them.
# Measured on the embedded model (bench/quantized_cpu.py --quality 32, 2026-11-26): first
# differences at top-2 gaps up to 0.35 nats, sampled logprobs up to 0.24 apart while the tokens
# agree; on the tiny K-quant Llama up to 0.1 apart.
INT8_NEAR_TIE = 0.5
INT8_LOGPROB_DIFF = 0.3


def greedy_tolerances() -> tuple[float, float, float]:
    """(near-tie, logprob difference, least share of identical tokens) that the GGUF path's
    greedy tokens keep against the fp32 path's, for the kernel this build runs."""
    from tests.workers.greedy import NEAR_TIE

    if gguf_cpu.int8_kernel():
        return INT8_NEAR_TIE, INT8_LOGPROB_DIFF, 0.6
    return NEAR_TIE, 1e-3, 0.9


def activation_half_steps(x: torch.Tensor) -> torch.Tensor:
    """Half the int8 grid step of each element's 32-element block of x [M, K]: the most the int8
    kernel's rounding moves it."""
    blocks = x.reshape(x.shape[0], -1, 32)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    return (step / 2).expand_as(blocks).reshape(x.shape)


def assert_product_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y is x @ w^T within the bound of the kernel that computed it (the module docstring)."""
    exact = x.double() @ w.double().t()
    bound = 1e-5 * (x.abs() @ w.abs().t()).double() + 1e-6
    if gguf_cpu.int8_kernel():
        bound += activation_half_steps(x).double() @ w.abs().double().t()
    err = (y.double() - exact).abs()
    assert bool((err <= bound).all()), float((err / bound).max())


@pytest.mark.parametrize("qtype", QTYPES)
def test_blocks_de_quantise_to_gguf_py_bits(qtype):
    raw = raw_blocks(qtype, 24, 96)
    expected = gguf_dequantize(raw, GGMLQuantizationType[qtype]).reshape(24, 96)
    w = blocks_to_weight(qtype, raw, "w")
    assert torch.equal(w.dequantize(), torch.from_numpy(expected.astype(np.float32)))
    assert torch.equal(
        gguf_cpu.dequantize_reference(qtype, w.codes, w.scales, w.mins), w.dequantize()
    )


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1, 70])
@pytest.mark.parametrize("n, k", [(96, 576), (40, 1536), (7, 32)])
def test_quantized_matmul_matches_the_float_reference(qtype, rows, n, k):
    w = weight(qtype, n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    y = linear(x, torch.empty(0), None, w)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    assert_product_close(y, x, w.dequantize())


def test_quantized_matmul_keeps_leading_dims_dtype_and_bias():
    w = weight("Q4_1", 16, 64)
    g = torch.Generator().manual_seed(7)  # certain inputs: the bound is bf16 rounding of these
    x = torch.randn(2, 3, 64, generator=g).bfloat16()
    bias = torch.randn(16, generator=g).bfloat16()
    y = linear(x, torch.empty(0), bias, w)
    assert y.shape == (2, 3, 16) and y.dtype == torch.bfloat16
    expected = x.float().reshape(6, 64) @ w.dequantize().t() + bias.float()
    torch.testing.assert_close(y.float().reshape(6, 16), expected, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("qtype", QTYPES)
def test_shards_along_whole_blocks_multiply_like_the_whole(qtype):
    w = weight(qtype, 32, 128)
    x = torch.randn(4, 128)
    full = w.matmul(x)
    rows = torch.cat([w.narrow(0, 0, 20).matmul(x), w.narrow(0, 20, 12).matmul(x)], dim=1)
    torch.testing.assert_close(rows, full, atol=0, rtol=0)
    cols = w.narrow(1, 0, 64).matmul(x[:, :64]) + w.narrow(1, 64, 64).matmul(x[:, 64:])
    torch.testing.assert_close(cols, full, atol=1e-5, rtol=1e-5)


def on_int8_grid(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """Activations the int8 kernel represents exactly: each 32-element block is a power-of-two
    step times integers in [-127, 127], 127 included (so the block's step is that power)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (rows, k // 32, 32), generator=g).float()
    q[:, :, 0] = 127
    step = 2.0 ** torch.randint(-12, -4, (rows, k // 32, 1), generator=g).float()
    return (q * step).reshape(rows, k)


ALL_QTYPES = (*QTYPES, "Q4_K", "Q5_K", "Q6_K")


@pytest.mark.parametrize("qtype", ALL_QTYPES)
def test_on_the_int8_grid_the_kernel_is_exact_up_to_float_rounding(qtype):
    """Activations already on their int8 grid lose nothing to quantization: the integer dot
    products are exact, and y differs from x @ W^T by float32 rounding alone."""
    from tests.workers.test_kquant import k_weight

    w = k_weight(qtype, 40, 256, seed=2) if qtype in K_QTYPES else weight(qtype, 40, 256, seed=2)
    x = on_int8_grid(9, 256)
    exact = x.double() @ w.dequantize().double().t()
    bound = 1e-5 * (x.abs() @ w.dequantize().abs().t()).double() + 1e-6
    assert bool(((w.matmul(x).double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("qtype", ALL_QTYPES)
def test_a_non_finite_activation_makes_its_row_nan_and_leaves_the_others(qtype):
    """As in a float product: a NaN in a row of x makes every output of that row NaN, and an
    infinity makes every one non-finite (the int8 kernel would otherwise round both to finite
    codes); the other rows are unchanged."""
    from tests.workers.test_kquant import k_weight

    w = k_weight(qtype, 40, 256, seed=5) if qtype in K_QTYPES else weight(qtype, 40, 256, seed=5)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(6))
    clean = w.matmul(x)
    x[1, 3], x[3, 200] = float("nan"), float("inf")
    y = w.matmul(x)
    assert bool(y[1].isnan().all()) and not bool(y[3].isfinite().any())
    assert torch.equal(y[[0, 2, 4]], clean[[0, 2, 4]])


@pytest.mark.parametrize("qtype", ALL_QTYPES)
def test_the_float_kernel_keeps_float_activations(qtype):
    """The float block kernel (CPUs without VNNI; here called directly, since this build may
    route matmul to the int8 kernel) differs from x @ W^T by float32 summation alone."""
    from tests.workers.test_kquant import k_weight

    w = k_weight(qtype, 40, 512, seed=4) if qtype in K_QTYPES else weight(qtype, 40, 512, seed=4)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(3))
    y = gguf_cpu.load().linear(x, *w._kernel_args())
    exact = x.double() @ w.dequantize().double().t()
    bound = 1e-5 * (x.abs() @ w.dequantize().abs().t()).double() + 1e-6
    assert bool(((y.double() - exact).abs() <= bound).all())


def test_changed_blocks_drop_the_packed_tiles():
    w, other = weight("Q4_1", 20, 64), weight("Q4_1", 20, 64, seed=9)
    x = torch.randn(3, 64)
    w.matmul(x)  # packs, where the int8 kernel is built
    w.copy_(other)
    assert torch.equal(w.matmul(x), other.matmul(x))


def test_the_kernel_build_names_its_instruction_set():
    """A VNNI build exactly where this CPU has VNNI (the variant is in the library's name)."""
    assert (gguf_cpu.load().isa() == "avx512_vnni") == (gguf_cpu.variant() == "avx512_vnni")
    assert gguf_cpu.int8_kernel() == (gguf_cpu.variant() == "avx512_vnni")


@pytest.mark.parametrize("start, length", [(16, 32), (0, 48), (32, 40)])
def test_a_split_inside_a_block_is_refused(start, length):
    with pytest.raises(ValueError, match="cut a Q4_1 block of 32"):
        weight("Q4_1", 4, 128).narrow(1, start, length)


def test_layers_keep_gguf_blocks_and_use_them():
    layer = ColumnParallelLinear(64, 48)
    w = weight("Q8_0", 48, 64)
    layer.weight.weight_loader(layer.weight, w)
    assert layer.pack_weight() and layer.packed is layer.weight.gguf
    x = torch.randn(5, 64)
    assert_product_close(layer(x), x, w.dequantize())
    row = RowParallelLinear(64, 48)
    row.weight.weight_loader(row.weight, w)
    row.pack_weight()
    assert_product_close(row(x), x, w.dequantize())


def test_mixed_block_types_in_one_fused_weight_fall_back_to_float():
    from workers.layers.linear import MergedColumnParallelLinear

    layer = MergedColumnParallelLinear(64, [16, 16])
    a, b = weight("Q4_1", 16, 64), weight("Q8_0", 16, 64, seed=3)
    layer.weight.weight_loader(layer.weight, a, 0)
    layer.weight.weight_loader(layer.weight, b, 1)
    assert getattr(layer.weight, "gguf", None) is None
    expected = torch.cat([a.dequantize(), b.dequantize()])
    assert torch.equal(layer.weight.data, expected)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_scales_are_refused_naming_the_tensor(bad):
    raw = raw_blocks("Q4_0", 4, 64)
    raw[2, 0:2] = np.array([bad], dtype=np.float16).view(np.uint8)
    with pytest.raises(ValueError, match="'blk.0.attn_q.weight' has non-finite Q4_0 scales"):
        blocks_to_weight("Q4_0", raw, "blk.0.attn_q.weight")


def test_gguf_names_map_to_hugging_face_names():
    assert hf_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="'blk.0.ssm_conv1d.weight' has no counterpart"):
        hf_name("blk.0.ssm_conv1d.weight")


def _one_tensor_gguf(path, qtype: str, raw: np.ndarray) -> str:
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_block_types_nobody_reads_and_non_finite_fallback_values_are_refused_at_load(tmp_path):
    """Types without a raylm kernel load as gguf-py's floats (test_kquant.py); one gguf-py cannot
    read either is refused naming it, and so is a de-quantised tensor that is not finite."""
    config = LlamaConfig(num_attention_heads=4, num_key_value_heads=4)
    unread = _one_tensor_gguf(tmp_path / "q81.gguf", "Q8_1", np.zeros((2, 40), dtype=np.uint8))
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_up\.weight' is Q8_1, which neither"):
        list(iterate_gguf(unread, config))
    q50 = np.zeros((2, 22), dtype=np.uint8)  # one Q5_0 block per row: fp16 d, 4 + 16 code bytes
    q50[0, 0:2] = np.array([np.nan], dtype=np.float16).view(np.uint8)
    nan = _one_tensor_gguf(tmp_path / "nan.gguf", "Q5_0", q50)
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_up\.weight' has non-finite values"):
        list(iterate_gguf(nan, config))


@pytest.mark.slow
def test_the_embedded_model_loads_as_blocks_bit_equal_to_the_float_conversion(
    smollm2_dir, monkeypatch
):
    """The blocks as loaded (before the loader's last step frees what packed copies serve) equal
    the float conversion; then that step leaves each linear's packed tiles as its only copy and
    the tied embedding its blocks."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from workers import loader
    from workers.layers.linear import drop_packed_float_copies
    from workers.loader import load_model
    from workers.model_files import default_model_path

    monkeypatch.setattr(loader, "drop_packed_float_copies", lambda model: 0)
    config = AutoConfig.from_pretrained(smollm2_dir)
    model = load_model(
        smollm2_dir,
        config,
        torch.float32,
        torch.device("cpu"),
        progress=False,
        gguf_file=str(default_model_path()),
    )
    floats = load_file(f"{smollm2_dir}/model.safetensors")
    fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}
    fused |= {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
    params = dict(model.named_parameters())
    blocks = 0
    for name, p in params.items():
        gguf = getattr(p, "gguf", None)
        blocks += gguf is not None
        value = gguf.dequantize() if gguf is not None else p.data
        parts = [
            n
            for n in floats
            if any(v in name and n == name.replace(v, k) for k, v in fused.items())
        ]
        expected = torch.cat([floats[n] for n in sorted(parts, key=_fused_order)] or [floats[name]])
        assert torch.equal(value, expected), name
        if gguf is not None:
            assert p.numel() == 0  # no float copy beside the blocks
    assert blocks == 30 * 4 + 1  # qkv, o, gate_up, down per layer, and the tied embedding
    if not gguf_cpu.int8_kernel():
        return
    down = model.model.layers[7].mlp.down_proj.weight.gguf
    x = torch.randn(3, down.shape[1])
    before, tiles = down.matmul(x), down.packed
    assert drop_packed_float_copies(model) == 30 * 4
    assert down.codes.numel() == 0 and down.shape == (576, 1536) and down.packed is tiles
    assert torch.equal(down.matmul(x), before)
    with pytest.raises(RuntimeError, match="blocks were freed"):
        down.dequantize()
    embedding = model.model.embed_tokens.weight.gguf
    assert embedding.freed_shape is None and embedding.codes.numel() > 0


def _fused_order(name: str) -> int:
    order = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    return next(i for i, part in enumerate(order) if part in name)


@pytest.mark.slow
def test_quantized_greedy_tokens_equal_the_float_path_except_at_near_ties(
    smollm2_llm, smollm2_gguf_llm
):
    """32 chat prompts, 8 greedy tokens each (bench/quantized_cpu.py --quality runs 32 tokens):
    the first difference of each prompt (if any) must sit on a near-tie of the float path (top-2
    logprobs within 1e-3; with the int8 kernel INT8_NEAR_TIE), and the sampled token's logprob
    agrees within 1e-3 (INT8_LOGPROB_DIFF) up to there."""

    from scheduler import SamplingParams
    from tests.prompts import random_chats

    near_tie, logprob_diff, share = greedy_tolerances()
    chats = random_chats(32, seed=31, max_words=20)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    # Both are the session's SmolLM2 engines: no second load of either.
    assert smollm2_llm.engine.config.quantized_gguf() is None
    ref = smollm2_llm.chat(chats, sp, use_tqdm=False)
    assert smollm2_gguf_llm.engine.config.quantized_gguf() is not None
    got = smollm2_gguf_llm.chat(chats, sp, use_tqdm=False)
    same = 0
    for r, g in zip(ref, got, strict=True):
        for i, (a, b) in enumerate(zip(r.token_ids, g.token_ids, strict=True)):
            if a != b:
                assert r.logprobs[i][1][1] - r.logprobs[i][2][1] <= near_tie, (r.request_id, i)
                break
            same += 1
            assert abs(r.logprobs[i][0][1] - g.logprobs[i][0][1]) <= logprob_diff
    assert same >= share * 32 * 8, same


def test_quantization_setting_picks_the_gguf_file_on_cpu_only(tmp_path):
    from engine.config import EngineConfig
    from workers.model_files import default_model_path

    gguf = str(default_model_path())
    assert EngineConfig(device="cpu", quantization="auto").quantized_gguf() == gguf
    assert EngineConfig(device="cpu", quantization="gguf").quantized_gguf() == gguf
    assert EngineConfig(device="cpu", quantization="none").quantized_gguf() is None
    assert EngineConfig(device="cuda", quantization="auto").quantized_gguf() is None
    assert (
        EngineConfig(model=str(tmp_path), device="cpu", quantization="gguf").quantized_gguf()
        is None
    )
    with pytest.raises(ValueError, match="quantization: 'gguf' runs on CPU only"):
        EngineConfig(device="cuda", quantization="gguf").quantized_gguf()
