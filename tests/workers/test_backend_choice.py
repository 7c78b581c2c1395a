"""`attention_backend` picks the verified kernel: every case of the choice, without a GPU."""

from __future__ import annotations

import pytest
import torch

from workers.layers.attention import select_backend
from workers.layers.backend_choice import BackendInputs, choose_backend

BOTH = frozenset({"triton", "flash_attn"})


def inputs(device="cuda", importable=BOTH, dtype="bfloat16", head_dim=128, block_size=16):
    return BackendInputs(device, frozenset(importable), dtype, head_dim, block_size)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_auto_on_cuda_is_the_triton_kernel_even_with_flash_attn_installed(dtype):
    assert choose_backend("auto", inputs(dtype=dtype)).name == "triton"


@pytest.mark.parametrize("importable", [BOTH, frozenset(), frozenset({"triton"})])
def test_auto_on_cpu_is_torch_whatever_is_installed(importable):
    assert choose_backend("auto", inputs("cpu", importable)).name == "torch"


def test_auto_on_cuda_without_triton_falls_back_to_torch_never_flash_attn():
    choice = choose_backend("auto", inputs(importable={"flash_attn"}))
    assert choice.name == "torch"
    assert "triton package" in choice.why and "CUDA graphs off" in choice.why


def test_auto_on_cuda_with_a_block_size_the_kernel_cannot_take_falls_back_to_torch():
    choice = choose_backend("auto", inputs(block_size=12))
    assert choice.name == "torch"
    assert "power-of-two block_size, got 12" in choice.why


def test_flash_attn_runs_when_named_and_able():
    assert choose_backend("flash_attn", inputs()).name == "flash_attn"


@pytest.mark.parametrize(
    "case, message",
    [
        (dict(importable={"triton"}), "is not installed; it builds from source"),
        (dict(device="cpu"), "needs CUDA, this engine runs on cpu"),
        (dict(dtype="float32"), "needs float16 or bfloat16, got float32"),
        (dict(head_dim=320), "needs a head size that is a multiple of 8 up to 256, got 320"),
        (dict(head_dim=60), "needs a head size that is a multiple of 8 up to 256, got 60"),
    ],
)
def test_flash_attn_named_where_it_cannot_run_says_why(case, message):
    with pytest.raises(ValueError, match=f"attention_backend: flash_attn {message}"):
        choose_backend("flash_attn", inputs(**case))


@pytest.mark.parametrize(
    "case, message",
    [
        (dict(importable=set()), "needs the triton package"),
        (dict(device="cpu"), "needs CUDA, this engine runs on cpu"),
        (dict(block_size=24), "needs a power-of-two block_size, got 24"),
    ],
)
def test_triton_named_where_it_cannot_run_says_why(case, message):
    with pytest.raises(ValueError, match=f"attention_backend: triton {message}"):
        choose_backend("triton", inputs(**case))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_torch_runs_anywhere_by_name(device):
    assert choose_backend("torch", inputs(device, importable=set(), dtype="float32")).name == (
        "torch"
    )


def test_shape_checks_are_skipped_where_shapes_are_unknown():
    assert choose_backend("triton", inputs(block_size=None)).name == "triton"
    assert choose_backend("flash_attn", inputs(head_dim=None)).name == "flash_attn"


def test_an_unknown_name_is_rejected():
    with pytest.raises(ValueError, match="must be one of"):
        choose_backend("xformers", inputs())


def test_select_backend_on_cpu_gives_the_torch_backend_with_its_paged_kernel():
    backend = select_backend(torch.device("cpu"), "auto", torch.float32, head_dim=64, block_size=16)
    assert backend.name == "torch" and not backend.supports_cuda_graphs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_select_backend_on_cuda_gives_the_graph_capturable_triton_kernel(dtype):
    backend = select_backend(torch.device("cuda"), "auto", dtype, head_dim=64, block_size=16)
    assert backend.name == "triton" and backend.supports_cuda_graphs
