"""FP8 and INT4 (GPTQ, AWQ) weights: the published layouts read back exactly, the kernels against a
float reference, tensor-parallel shards, bad checkpoints refused at load, and tiny Llamas loaded
from each layout.

Tolerances:
- INT4: the codes, zero points and scales read back bit-equal to what the writer packed, so the
  de-quantised weight is exact. The CPU kernel computes (q - 8) s + (8 - z) s in float32, a
  rounding of (q - z) s: |y - y64| <= 1e-5 * (|x| @ |W|^T) + 1e-5 for the K <= 384 here.
- FP8 (W8A8): x and W each round to E4M3 (3 mantissa bits, relative error <= 2^-4), so
  |y - x W^T| <= (2^-4 + 2^-4 + 2^-8) * (|x| @ |W|^T) + 1e-6 against the float product, and the
  kernel equals the product of the de-quantised operands to float32 rounding.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig

from tests.random_quantized import Layout, quant_config, quantize_linear
from workers.layers.fp8 import FP8Weight, quantize_rows, quantize_weight
from workers.layers.int4 import GROUP_SIZES, KERNEL_MAX_ROWS, Int4Weight, pack_nibbles
from workers.layers.linear import ColumnParallelLinear, RowParallelLinear
from workers.quant_config import QuantConfig, quant_config_of
from workers.quant_weights import attach_quantized, awq_weight, fp8_weight, gptq_weight

INT4_LAYOUTS = [Layout("gptq", 32), Layout("gptq", 64, act_order=True), Layout("awq", 128)]
SHAPES = [(32, 128), (48, 256), (64, 384)]
FP8_BOUND = 2**-4 + 2**-4 + 2**-8


def _act_order(k: int, group_size: int, seed: int = 0) -> torch.Tensor:
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g = torch.empty(k, dtype=torch.int64)
    g[perm] = torch.arange(k) // group_size
    return g


def read(layout: Layout, parts: dict) -> Int4Weight | FP8Weight:
    if layout.method == "gptq":
        return gptq_weight("w", parts, QuantConfig("gptq", layout.group_size, 1, layout.act_order))
    if layout.method == "awq":
        return awq_weight("w", parts, QuantConfig("awq", layout.group_size))
    return fp8_weight("w", parts)


def written(layout: Layout, n: int, k: int, seed: int = 0):
    """(checkpoint parts, de-quantised float32 weight) of a random [n, k] linear in layout."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1
    g_idx = _act_order(k, layout.group_size, seed) if layout.act_order else None
    return quantize_linear(w, layout, g_idx)


def assert_int4_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    exact = (x.double() @ w.double().t()).float()
    bound = 1e-5 * (x.abs() @ w.abs().t()) + 1e-5
    assert bool(((y - exact).abs() <= bound).all()), float((y - exact).abs().max())


@pytest.mark.parametrize("layout", INT4_LAYOUTS, ids=str)
@pytest.mark.parametrize("n, k", SHAPES)
def test_int4_layouts_read_back_exactly_and_the_kernel_matches_the_reference(layout, n, k):
    if k % layout.group_size:
        pytest.skip("not whole groups")
    parts, deq = written(layout, n, k)
    w = read(layout, parts)
    assert torch.equal(w.dequantize(), deq)
    w.prepare(torch.float32)
    assert w.kernel is not None
    for rows in (1, 7, KERNEL_MAX_ROWS + 1):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        assert_int4_close(w.matmul(x), x, deq)


@pytest.mark.parametrize("layout", INT4_LAYOUTS, ids=str)
def test_int4_shards_on_group_boundaries_multiply_like_the_whole(layout):
    n, k, gs = 64, 256, layout.group_size
    parts, deq = written(layout, n, k, seed=3)
    w = read(layout, parts)
    x = torch.randn(5, k)
    halves = [w.narrow(0, 0, 32), w.narrow(0, 32, 32)]  # column parallel: output rows
    y = torch.cat([h.matmul(x) for h in halves], dim=1)
    assert_int4_close(y, x, deq)
    ranks = k // gs if k // gs <= 4 else 2  # row parallel: input columns, whole groups
    size = k // ranks
    shards = [w.narrow(1, r * size, size) for r in range(ranks)]
    for s in shards:
        s.prepare(torch.float32)
    y = sum(s.matmul(x[:, r * size : (r + 1) * size]) for r, s in enumerate(shards))
    assert_int4_close(y, x, deq)


@settings(max_examples=20)  # each example converts and multiplies up to 4 shards
@given(
    group_size=st.sampled_from(GROUP_SIZES),
    groups_per_rank=st.integers(1, 3),
    ranks=st.integers(1, 4),
    rows=st.sampled_from([16, 24, 48]),
    act_order=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_any_split_into_whole_groups_multiplies_like_the_whole(
    group_size, groups_per_rank, ranks, rows, act_order, seed
):
    """Row-parallel shards (whole groups of inputs) summed, and column-parallel shards (output
    rows) joined, equal the whole weight's product; act-order shards keep every group's scales."""
    gen = torch.Generator().manual_seed(seed)
    size = group_size * groups_per_rank
    k, groups = size * ranks, groups_per_rank * ranks
    w = Int4Weight(
        pack_nibbles(torch.randint(0, 16, (rows, k), generator=gen)),
        torch.rand(rows, groups, generator=gen) * 0.01,
        torch.randint(0, 16, (rows, groups), generator=gen).to(torch.uint8),
        group_size,
        _act_order(k, group_size, seed).to(torch.int32) if act_order else None,
    )
    deq = w.dequantize()
    x = torch.randn(3, k, generator=gen)
    shards = [w.narrow(1, r * size, size) for r in range(ranks)]
    for shard in shards:
        shard.prepare(torch.float32)
    assert_int4_close(
        sum(s.matmul(x[:, r * size : (r + 1) * size]) for r, s in enumerate(shards)), x, deq
    )
    half = rows // 2
    parts = [w.narrow(0, 0, half), w.narrow(0, half, rows - half)]
    assert_int4_close(torch.cat([p.matmul(x) for p in parts], dim=1), x, deq)


@pytest.mark.parametrize("start, length", [(16, 64), (0, 48), (64, 80)])
def test_an_input_split_inside_a_group_is_refused_naming_the_group_size(start, length):
    parts, _ = written(Layout("gptq", 64), 16, 256)
    with pytest.raises(ValueError, match=r"cut an INT4 group of 64 \(group_size\)"):
        read(Layout("gptq", 64), parts).narrow(1, start, length)


def test_layers_keep_int4_weights_and_fused_parts_share_act_order():
    layout = Layout("gptq", 32, act_order=True)
    g_idx = _act_order(64, 32)
    a_parts, a = quantize_linear(torch.randn(32, 64) * 0.1, layout, g_idx)
    b_parts, b = quantize_linear(torch.randn(32, 64) * 0.1, layout, g_idx)
    from workers.layers.linear import MergedColumnParallelLinear

    layer = MergedColumnParallelLinear(64, [32, 32])
    layer.weight.weight_loader(layer.weight, read(layout, a_parts), 0)
    layer.weight.weight_loader(layer.weight, read(layout, b_parts), 1)
    assert attach_quantized(layer, torch.bfloat16) == 1 and layer.weight.numel() == 0
    assert layer.packed.codes.numel() == 0  # bf16 on CPU: one copy, the kernel's
    x = torch.randn(3, 64)
    y = layer(x.bfloat16()).float()
    w = torch.cat([a, b])
    assert bool(((y - x @ w.t()).abs() <= 2**-7 * (x.abs() @ w.abs().t()) + 1e-3).all())
    other = Layout("gptq", 32, act_order=True)
    c_parts, _ = quantize_linear(torch.randn(32, 64), other, _act_order(64, 32, seed=9))
    layer = MergedColumnParallelLinear(64, [32, 32])
    layer.weight.weight_loader(layer.weight, read(layout, a_parts), 0)
    with pytest.raises(ValueError, match="different act-order g_idx"):
        layer.weight.weight_loader(layer.weight, read(other, c_parts), 1)


@pytest.mark.parametrize("per_tensor", [False, True])
@pytest.mark.parametrize("n, k", SHAPES)
def test_fp8_matmul_is_w8a8_within_e4m3_rounding(per_tensor, n, k):
    parts, deq = written(Layout("fp8", per_tensor=per_tensor), n, k)
    w = read(Layout("fp8"), parts)
    assert torch.equal(w.dequantize(), deq)
    x = torch.randn(6, k)
    y = w.matmul(x)
    xq, xs = quantize_rows(x)
    torch.testing.assert_close(y, (xq.float() * xs) @ deq.t(), atol=1e-5, rtol=1e-5)
    exact = x @ w.dequantize().t()
    assert bool(((y - exact).abs() <= FP8_BOUND * (x.abs() @ deq.abs().t()) + 1e-6).all())


@pytest.mark.parametrize("per_tensor", [False, True])
def test_fp8_on_the_fly_rounds_each_weight_within_e4m3_precision(per_tensor):
    w = torch.randn(48, 96) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different size
    q = quantize_weight(w, per_tensor)
    scale_of_row = w.abs().amax() if per_tensor else w.abs().amax(1, keepdim=True)
    # an element rounds to 2^-4 of itself, or to E4M3's subnormal step (2^-9 of 448 / max)
    err = (q.dequantize() - w).abs()
    assert bool((err <= 2**-4 * w.abs() + 2**-9 * scale_of_row / 448 + 1e-12).all())
    if not per_tensor:
        assert torch.equal(q.codes.float().abs().amax(1), torch.full((48,), 448.0))


def test_fp8_shards_keep_their_scales():
    parts, deq = written(Layout("fp8"), 32, 128, seed=5)
    w = read(Layout("fp8"), parts)
    x = torch.randn(4, 128)
    full = w.matmul(x)
    rows = torch.cat([w.narrow(0, 0, 16).matmul(x), w.narrow(0, 16, 16).matmul(x)], dim=1)
    torch.testing.assert_close(rows, full, atol=0, rtol=0)
    # row parallel: each rank quantizes its own activations, still W8A8 of the whole
    y = w.narrow(1, 0, 64).matmul(x[:, :64]) + w.narrow(1, 64, 64).matmul(x[:, 64:])
    assert bool(((y - x @ deq.t()).abs() <= FP8_BOUND * (x.abs() @ deq.abs().t()) + 1e-6).all())


def test_column_and_row_layers_multiply_fp8_weights():
    parts, deq = written(Layout("fp8"), 48, 64)
    for layer in (ColumnParallelLinear(64, 48), RowParallelLinear(64, 48)):
        layer.weight.weight_loader(layer.weight, read(Layout("fp8"), parts))
        attach_quantized(layer, torch.float32)
        assert isinstance(layer.packed, FP8Weight) and layer.pack_weight()
        x = torch.randn(2, 64)
        assert bool(((layer(x) - x @ deq.t()).abs() <= FP8_BOUND * (x.abs() @ deq.abs().t())).all())


# ---- bad input: a ValueError at load, naming what is wrong


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("layout", [Layout("gptq", 32), Layout("awq", 32)], ids=str)
def test_non_finite_int4_scales_are_refused(layout, bad):
    parts, _ = written(layout, 16, 64)
    parts["scales"][1, 3] = bad
    with pytest.raises(ValueError, match=r"w\.scales has NaN or infinite"):
        read(layout, parts)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_fp8_scales_and_nan_codes_are_refused(bad):
    parts, _ = written(Layout("fp8"), 16, 64)
    parts["weight_scale"][2] = bad
    with pytest.raises(ValueError, match=r"w\.weight_scale has NaN"):
        read(Layout("fp8"), parts)
    parts, _ = written(Layout("fp8"), 16, 64)
    parts["weight"].view(torch.uint8)[0, 0] = 0x7F
    with pytest.raises(ValueError, match=r"w\.weight has NaN"):
        read(Layout("fp8"), parts)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_group_size_the_tensors_do_not_have_is_refused(method):
    parts, _ = written(Layout(method, 32), 16, 128)
    with pytest.raises(ValueError, match=r"scales has shape \(4, 16\), expected \(2, 16\).*64"):
        read(Layout(method, 64), parts)


def test_g_idx_outside_the_groups_is_refused():
    parts, _ = written(Layout("gptq", 32, act_order=True), 16, 64)
    parts["g_idx"][5] = 2
    with pytest.raises(ValueError, match=r"g_idx has group indices outside \[0, 2\)"):
        read(Layout("gptq", 32, act_order=True), parts)


@pytest.mark.parametrize(
    "stored, match",
    [
        ({"quant_method": "bitsandbytes"}, "quant_method: 'bitsandbytes' is not supported"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits: only 4-bit"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 48}, "group_size: must be one of"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 2**64}, "group_size: must be one of"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version"),
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
            "checkpoint_format",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}},
            },
            r"config_groups\.g\.weights: only 8-bit float",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {
                    "g": {"weights": {"num_bits": 8, "type": "float", "strategy": "block"}}
                },
            },
            r"strategy: symmetric 'channel' or 'tensor'",
        ),
    ],
)
def test_unsupported_quantization_configs_are_refused_naming_the_field(stored, match):
    with pytest.raises(ValueError, match=match):
        quant_config_of(LlamaConfig(quantization_config=stored))


def test_the_setting_and_the_checkpoint_decide_the_format():
    assert quant_config_of(LlamaConfig()) is None
    assert quant_config_of(LlamaConfig(), "fp8") == QuantConfig("fp8")
    gptq = LlamaConfig(quantization_config=quant_config(Layout("gptq", 64, act_order=True)))
    assert quant_config_of(gptq, "none") == QuantConfig("gptq", 64, 1, True)
    with pytest.raises(ValueError, match="quantization: 'fp8' quantizes a float checkpoint"):
        quant_config_of(gptq, "fp8")
    fp8 = LlamaConfig(quantization_config=json.loads(json.dumps(quant_config(Layout("fp8")))))
    assert quant_config_of(fp8, "auto") == QuantConfig("compressed-tensors")


# ---- tiny Llamas from each layout (slow: they build engines)


@pytest.fixture(scope="module")
def tiny_float_llama(tmp_path_factory):
    from tests.random_checkpoint import TINY_FAMILIES, write_random_checkpoint

    path = str(tmp_path_factory.mktemp("quant-float"))
    return write_random_checkpoint(TINY_FAMILIES["llama"], path)


def _greedy(model_dir: str, prompts, **kwargs):
    from engine.llm import LLM
    from scheduler import SamplingParams

    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(model=model_dir, device="cpu", load_progress=False, kv_cache_memory_gb=0.05, **kwargs)
    try:
        return [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [Layout("gptq", 32, act_order=True), Layout("awq", 64), Layout("fp8")],
    ids=str,
)
def test_a_tiny_llama_from_each_layout_decodes_like_its_de_quantized_floats(
    layout, tiny_float_llama, tmp_path
):
    """INT4: greedy tokens equal Hugging Face's on the de-quantised float checkpoint (up to a
    near-tie). FP8: the de-quantised floats quantized again on the fly are the same codes and
    scales (each row's largest code is 448 exactly), so the tokens are identical."""
    from transformers import AutoModelForCausalLM

    from tests.random_checkpoint import random_prompts
    from tests.random_quantized import write_quantized_checkpoint
    from tests.workers.greedy import assert_greedy_match, hf_greedy

    quant, ref = str(tmp_path / "quant"), str(tmp_path / "ref")
    write_quantized_checkpoint(tiny_float_llama.path, quant, ref, layout)
    prompts = random_prompts(4, tiny_float_llama.vocab_size, 4, 20, seed=3)
    got = _greedy(quant, prompts)
    if layout.method == "fp8":
        assert got == _greedy(ref, prompts, quantization="fp8")
        return
    hf = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    for p, tokens in zip(prompts, got, strict=True):
        assert_greedy_match(tokens, hf_greedy(hf, p, 8), str(layout))


@pytest.mark.slow
def test_two_ranks_of_quantized_llamas_match_one(tiny_float_llama, tmp_path, gloo_ranks):
    """GPTQ act-order (q/k/v and gate/up split by output rows, o and down by whole groups of 32
    inputs, every group's scales kept) and compressed-tensors FP8 over two gloo ranks give the
    single-rank logits (FP8: each rank scales its own activations, so within FP8's own error)."""
    from tests.random_quantized import write_quantized_checkpoint
    from tests.workers.test_tensor_parallel import forward_logits, tp_logits
    from workers.parallel import reset_tensor_parallel

    dirs = []
    for name, layout in (("gptq", Layout("gptq", 32, act_order=True)), ("fp8", Layout("fp8"))):
        dirs.append(str(tmp_path / name))
        write_quantized_checkpoint(
            tiny_float_llama.path, dirs[-1], str(tmp_path / f"r{name}"), layout
        )
    reset_tensor_parallel()
    expected = [forward_logits(d) for d in dirs]
    gptq, fp8 = gloo_ranks(2).run(tp_logits, dirs)
    torch.testing.assert_close(gptq, expected[0], atol=1e-4, rtol=1e-4)
    # Row-parallel ranks round their halves of each token separately: a second FP8 rounding of
    # the same product, no further from the one-rank logits than FP8 is from the float weights.
    floats = forward_logits(str(tmp_path / "rfp8"))
    fp8_error = float((expected[1] - floats).abs().max())
    assert float((fp8 - expected[1]).abs().max()) <= 2 * fp8_error


def test_the_fp8_setting_reaches_the_runner_and_leaves_gguf_files_to_conversion():
    from engine.config import EngineConfig

    config = EngineConfig(device="cpu", quantization="fp8")
    assert config.quantized_gguf() is None  # the default GGUF model loads as floats, then FP8
    assert config.runner_config("/m", max_model_len=64).quantization == "fp8"
