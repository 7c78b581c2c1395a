"""GGUF K-quants (Q4_K, Q5_K, Q6_K) kept as their 256-element super-blocks: de-quantisation bits,
the kernel, tensor-parallel shards, bad scales, and a tiny K-quant Llama decoded end to end.

Tolerances as test_quantized.py's: de-quantisation is exact (the same bits as gguf-py's and
transformers' readers, every operation rounded once in float32 in their order), so the kernel and
the de-quantise + GEMM path differ from a float64 product of those weights only by float32
summation: |y - y64| <= 1e-5 * (|x| @ |W|^T) + 1e-6 for K <= 2048.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from tests.random_kquant import K_SCALE_AT, quantize_k, random_k_blocks
from tests.workers.test_quantized import assert_product_close
from workers.gguf import blocks_to_weight
from workers.layers.backends import gguf_cpu
from workers.layers.linear import RowParallelLinear
from workers.layers.quantized import K_QTYPES, KERNEL_MAX_ROWS, GGUFWeight


def k_weight(qtype: str, rows: int, cols: int, seed: int = 0, name: str = "w") -> GGUFWeight:
    return blocks_to_weight(qtype, random_k_blocks(qtype, rows, cols, seed), name)


@pytest.mark.parametrize("qtype", K_QTYPES)
def test_super_blocks_de_quantise_to_gguf_py_and_transformers_bits(qtype):
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    raw = random_k_blocks(qtype, 12, 768, seed=5)
    expected = torch.from_numpy(
        gguf_dequantize(raw, GGMLQuantizationType[qtype]).reshape(12, 768).astype(np.float32)
    )
    hf = hf_dequantize(torch.from_numpy(raw.copy()).reshape(-1), GGMLQuantizationType[qtype])
    assert torch.equal(hf.reshape(12, 768), expected)
    w = blocks_to_weight(qtype, raw, "w")
    assert w.shape == (12, 768) and w.scales is None and w.nbytes() == raw.nbytes
    assert torch.equal(w.dequantize(), expected)  # the C++ kernel's de-quantisation
    assert torch.equal(gguf_cpu.dequantize_reference(qtype, w.codes, None, None), expected)


@pytest.mark.parametrize("qtype", K_QTYPES)
def test_quantize_k_round_trips_within_its_steps(qtype):
    """The test quantizer writes what gguf-py reads back near the floats (a check on the writer
    of the model file below, not on raylm)."""
    w = np.random.default_rng(1).standard_normal((8, 512)).astype(np.float32)
    back = gguf_dequantize(quantize_k(qtype, w), GGMLQuantizationType[qtype]).reshape(8, 512)
    bound = {"Q4_K": 0.25, "Q5_K": 0.12, "Q6_K": 0.06}[qtype]
    assert float(np.abs(back - w).max()) <= bound


@pytest.mark.parametrize("qtype", K_QTYPES)
@pytest.mark.parametrize("rows", [1, 8, 9, KERNEL_MAX_ROWS + 1])
@pytest.mark.parametrize("n, k", [(96, 512), (40, 1536), (7, 256)])
def test_k_quant_matmul_matches_the_float_reference(qtype, rows, n, k):
    w = k_weight(qtype, n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    y = w.matmul(x)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    assert_product_close(y, x, w.dequantize())


@pytest.mark.parametrize("qtype", K_QTYPES)
def test_shards_along_whole_super_blocks_multiply_like_the_whole(qtype):
    w = k_weight(qtype, 24, 768)
    x = torch.randn(4, 768)
    full = w.matmul(x)
    rows = torch.cat([w.narrow(0, 0, 10).matmul(x), w.narrow(0, 10, 14).matmul(x)], dim=1)
    torch.testing.assert_close(rows, full, atol=0, rtol=0)
    parts = [w.narrow(1, s, 256).matmul(x[:, s : s + 256]) for s in (0, 256, 512)]
    assert_product_close(sum(parts), x, w.dequantize())
    assert torch.equal(w.narrow(1, 256, 512).dequantize(), w.dequantize()[:, 256:])
    index = torch.tensor([5, 0, 23])
    assert torch.equal(w.index_rows(index).dequantize(), w.dequantize()[index])


@pytest.mark.parametrize("start, length", [(128, 256), (0, 384), (256, 32)])
def test_a_split_inside_a_super_block_is_refused_naming_the_tensor(start, length):
    w = k_weight("Q5_K", 4, 768, name="blk.3.ffn_down.weight")
    with pytest.raises(
        ValueError, match=r"blk\.3\.ffn_down\.weight's columns .* cut a Q5_K super-block of 256"
    ):
        w.narrow(1, start, length)


def test_a_row_parallel_layer_of_two_ranks_refuses_a_cut_super_block(monkeypatch):
    """Rank 1 of two over 768 inputs takes [384, 768), which cuts the middle super-block. (The
    layer reads only its rank and world size here: no process group is needed to build it.)"""
    from workers import parallel

    monkeypatch.setattr(parallel, "_state", parallel.ParallelState(rank=1, world_size=2))
    layer = RowParallelLinear(768, 16)
    w = k_weight("Q4_K", 16, 768, name="blk.0.attn_output.weight")
    with pytest.raises(ValueError, match=r"blk\.0\.attn_output\.weight.*super-block of 256"):
        layer.weight.weight_loader(layer.weight, w)


def test_layers_keep_super_blocks_and_use_them():
    layer = RowParallelLinear(512, 32)
    w = k_weight("Q6_K", 32, 512)
    layer.weight.weight_loader(layer.weight, w)
    assert layer.pack_weight() and layer.packed is layer.weight.gguf
    assert layer.packed.qtype == "Q6_K" and torch.equal(layer.packed.codes, w.codes)
    x = torch.randn(5, 512)
    assert_product_close(layer(x), x, w.dequantize())


@pytest.mark.parametrize("qtype", K_QTYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_d_or_dmin_is_refused_naming_the_tensor(qtype, bad):
    for label, at in K_SCALE_AT[qtype].items():
        raw = random_k_blocks(qtype, 4, 512)
        raw[3, 144 * 0 + at : at + 2] = np.array([bad], dtype=np.float16).view(np.uint8)
        raw = raw.reshape(4, 2, -1)
        raw[1, 1, at : at + 2] = np.array([bad], dtype=np.float16).view(np.uint8)
        raw = raw.reshape(4, -1)
        with pytest.raises(
            ValueError, match=rf"'blk\.1\.ffn_up\.weight' has non-finite {qtype} {label}$"
        ):
            blocks_to_weight(qtype, raw, "blk.1.ffn_up.weight")


def test_rows_that_are_not_whole_super_blocks_are_refused():
    with pytest.raises(ValueError, match="'w' is not rows of whole Q6_K super-blocks of 210"):
        blocks_to_weight("Q6_K", np.zeros((2, 200), dtype=np.uint8), "w")
    with pytest.raises(ValueError, match="w's share of 576 input columns cuts a Q4_K super"):
        GGUFWeight.zeros("Q4_K", 4, 576, "w")


# ---- a tiny K-quant Llama, end to end (slow: it converts the file and builds two engines)


@pytest.mark.slow
def test_a_tiny_k_quant_llama_decodes_like_its_de_quantised_floats(tmp_path, monkeypatch):
    """The file's K-quant linears, embedding and head are kept as super-blocks, each bit-equal
    (de-quantised) to transformers' conversion of the same file; greedy tokens of 8 prompts
    (prefills above the float kernel's row limit, decode steps below it) equal the fp32 path's,
    except after a near-tie (test_quantized.greedy_tolerances: wider with int8 activations)."""
    from engine.llm import LLM
    from scheduler import SamplingParams
    from tests.random_checkpoint import random_prompts
    from tests.random_kquant import write_tiny_kquant_gguf
    from tests.workers.test_quantized import greedy_tolerances
    from workers import loader

    monkeypatch.setattr(loader, "drop_packed_float_copies", lambda model: 0)
    path = str(tmp_path / "tiny-k.gguf")
    vocab = write_tiny_kquant_gguf(path)
    cache = str(tmp_path / "cache")
    kept = load_and_compare_with_transformers(path, cache)
    assert sorted(kept.values()) == sorted(
        ["Q4_K", "Q6_K"] + [t for layer in _layer_types() for t in layer]
    )

    prompts = random_prompts(8, vocab - 2, 4, 40, seed=3)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = {}
    for quantization in ("none", "gguf"):
        llm = LLM(
            model=path,
            device="cpu",
            quantization=quantization,
            cache_dir=cache,
            load_progress=False,
            kv_cache_memory_gb=0.05,
        )
        try:
            outs[quantization] = llm.generate(prompts, sp, use_tqdm=False)
        finally:
            llm.shutdown()
    near_tie, logprob_diff, _ = greedy_tolerances()
    for ref, got in zip(outs["none"], outs["gguf"], strict=True):
        for i, (a, b) in enumerate(zip(ref.token_ids, got.token_ids, strict=True)):
            if a != b:
                assert ref.logprobs[i][1][1] - ref.logprobs[i][2][1] <= near_tie
                break
            assert abs(ref.logprobs[i][0][1] - got.logprobs[i][0][1]) <= logprob_diff


@pytest.mark.slow
def test_block_types_without_a_kernel_load_as_transformers_floats(tmp_path, monkeypatch, caplog):
    """A file mixing kept types with Q5_0 and Q5_1 (as llama.cpp's K-quant "M" files do) loads
    under quantization: gguf: those tensors, and the fused matrix a Q5_0 v shares with Q4_K q and
    k, are transformers' float32 de-quantisation bit for bit, the rest stay blocks, and a warning
    names the types."""
    from tests.random_kquant import write_tiny_kquant_gguf
    from workers import loader

    monkeypatch.setattr(loader, "drop_packed_float_copies", lambda model: 0)
    path = str(tmp_path / "mixed.gguf")
    layers = (
        {"qkv": "Q4_K", "v": "Q5_0", "attn_output": "Q5_1", "gate_up": "Q4_K", "ffn_down": "Q6_K"},
    )
    write_tiny_kquant_gguf(path, layers=layers)
    with caplog.at_level("WARNING", logger="workers.gguf"):
        kept = load_and_compare_with_transformers(path, str(tmp_path / "cache"))
    assert kept == {
        "model.embed_tokens.weight": "Q4_K",
        "model.layers.0.mlp.gate_up_proj.weight": "Q4_K",
        "model.layers.0.mlp.down_proj.weight": "Q6_K",
        "lm_head.weight": "Q6_K",
    }
    assert "1 Q5_0, 1 Q5_1" in caplog.text


def load_and_compare_with_transformers(path: str, cache: str) -> dict[str, str]:
    """Load the GGUF file under quantization: gguf and check every weight (blocks de-quantised,
    floats as they are) bit-equal to transformers' conversion of it; {name: type} of those kept
    as blocks. Call with the loader's last step (dropping float copies) patched out."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from tests.workers.test_quantized import _fused_order
    from workers.loader import load_model
    from workers.model_files import resolve_model

    model_dir = resolve_model(path, cache)  # transformers de-quantises every tensor
    model = load_model(
        model_dir,
        AutoConfig.from_pretrained(model_dir),
        torch.float32,
        torch.device("cpu"),
        progress=False,
        gguf_file=path,
    )
    floats = load_file(f"{model_dir}/model.safetensors")
    fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}
    fused |= {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
    kept = {}
    for name, p in model.named_parameters():
        if name not in floats and not any(v in name for v in fused.values()):
            continue  # a buffer of ours (rotary tables and the like) or the tied head
        gguf = getattr(p, "gguf", None)
        if gguf is not None:
            kept[name] = gguf.qtype
        parts = [
            n
            for n in floats
            if any(v in name and n == name.replace(v, k) for k, v in fused.items())
        ]
        expected = torch.cat([floats[n] for n in sorted(parts, key=_fused_order)] or [floats[name]])
        got = p.data if gguf is None else gguf.dequantize()
        assert torch.equal(got, expected), name
    return kept


def _layer_types() -> list[list[str]]:
    """The K type of each kept weight of each layer: qkv, o, gate_up, down."""
    from tests.random_kquant import TINY_K_LAYERS

    return [[t["qkv"], t["attn_output"], t["gate_up"], t["ffn_down"]] for t in TINY_K_LAYERS]
