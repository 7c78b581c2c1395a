"""The decoder-layer driver on CPU: a decode step's whole layer loop in one C++ call.

On the int8 GGUF path a Llama decode step is ~13 calls into C++ per layer (norms, the packed int8
linears, rotary, the cache write, paged attention, SiLU-and-mul), each crossing from Python and
back: on SmolLM2-135M's 30 layers about 400 crossings, ~4 ms of a ~14 ms step on this machine's
cores (bench/verify_step.py). cpu_driver.cpp runs the same loop in C++: a `Plan` holds each
layer's packed weights, norms and cache tensors, and `decode` calls the very kernels the Python
layers call (through torch's dispatcher), in their order, on the same tensors. Same arithmetic,
so the hidden states are bit for bit the Python loop's (tests/workers/test_cpu_driver.py).

Where it applies is decided here and nowhere else (`decode_driver`, called by LlamaModel.forward):
a CPU step whose every row is a decode row (plain decodes and verify rows, which attend as
decode rows), on a model whose layers are all plain Llama layers (no q/k norm, biases, sliding
window, sinks or soft-cap; a dense SiLU MLP) with every linear held as int8 tiles only (their
blocks freed, so the tiles cannot change under the plan), no LoRA, one rank and one pipeline
stage, a float32 cache and the fused CPU ops and paged kernel on. Prefill chunks, LoRA, other
families and backends keep the Python layers. RAYLM_CPU_DRIVER=0 turns it off (A/B timing);
`driver_off()` does so inside a block.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from workers.layers import fused
from workers.layers.activation import SiluAndMul
from workers.layers.attention import Attention, AttentionMetadata
from workers.layers.backends import cpu_fused, cpu_paged, gguf_cpu
from workers.layers.backends.cpu_build import build_ops
from workers.layers.backends.torch_ref import TorchBackend
from workers.layers.quantized import GGUFWeight
from workers.parallel import get_tp_world_size
from workers.pipeline import current_stage

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_driver.cpp")
_off = os.environ.get("RAYLM_CPU_DRIVER", "") == "0"


@functools.cache
def load() -> Any | None:
    """torch.ops.raylm_driver (`decode`; the class torch.classes.raylm_driver.Plan), or None
    where the kernels it calls or its own build are missing."""
    if not gguf_cpu.int8_kernel() or cpu_fused.load() is None or cpu_paged.load() is None:
        return None
    return build_ops(
        "cpu_driver",
        [_SOURCE],
        "raylm_driver",
        probe="decode",
        what="CPU decoder-layer driver",
        fallback="decode steps run layer by layer",
    )


@contextmanager
def driver_off() -> Iterator[None]:
    """Decode steps run layer by layer inside the block (same-process A/B timing and tests)."""
    global _off
    saved, _off = _off, True
    try:
        yield
    finally:
        _off = saved


@dataclass(slots=True)
class LayerDriver:
    """A model's plan (its weights), built at the first call; the caches are passed each call."""

    model: Any = field(repr=False)  # a LlamaModel (its submodules read by name)
    attention: list[Attention] = field(repr=False)
    plan: Any = field(default=None, repr=False)

    def __call__(
        self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The final norm's output for hidden states x [T, H] (the embedding's)."""
        if self.plan is None:
            self.plan = _plan(self.model)
        # Read each step, never held: an unbound pool (sleep, a weight update) is freed at once.
        caches = [c for a in self.attention for c in (a.k_cache, a.v_cache)]
        return torch.ops.raylm_driver.decode(
            self.plan, caches, x, positions, meta.slot_mapping, meta.block_tables, meta.seq_lens
        )


def decode_driver(model: Any, meta: AttentionMetadata) -> LayerDriver | None:
    """The driver for this step of `model` (a LlamaModel), or None: the layers run in Python.
    Whether the model qualifies is decided at its first decode-only step (after loading, when the
    weights are packed and the backend bound) and kept."""
    if _off or meta.num_decodes != meta.num_reqs or meta.slot_mapping.device.type != "cpu":
        return None
    driver = model.__dict__.get("_cpu_driver", False)
    if driver is False:
        reason = _refusal(model)
        driver = None
        if reason is None:
            driver = LayerDriver(model, [layer.self_attn.attn for layer in model.layers])
        logger.info("CPU decoder-layer driver: %s", reason or "on")
        model.__dict__["_cpu_driver"] = driver
    return driver


def build_for(model: nn.Module) -> None:
    """Build (or load) the library at load time for a model whose layers it would run (`model` a
    causal LM, its decoder at `.model`): its first decode step then waits for no compiler."""
    from workers.models.llama import LlamaModel

    inner = getattr(model, "model", None)
    if not _off and isinstance(inner, LlamaModel) and _model_refusal(inner, bound=False) is None:
        load()


def _refusal(model: Any) -> str | None:
    """Why the driver cannot run `model`'s layers, or None when it can. The model is judged
    before the library is loaded: a model it refuses never builds it."""
    reason = _model_refusal(model)
    if reason is None and (fused._cpu_ops() is None or load() is None):
        return "off (a kernel library is not built here, or RAYLM_CPU_FUSED=0)"
    return reason


def _model_refusal(model: Any, bound: bool = True) -> str | None:
    """The model's refusal; `bound=False` before its attention backend and caches are bound
    (at load), when only the weights and layer types are judged."""
    if get_tp_world_size() != 1 or current_stage().size != 1:
        return "off (tensor or pipeline parallel)"
    if model.embed_tokens.weight.dtype != torch.float32:
        return "off (not float32)"
    for i, layer in enumerate(model.layers):
        reason = _layer_refusal(layer, bound)
        if reason:
            return f"off (layer {i}: {reason})"
    return None


def _layer_refusal(layer: nn.Module, bound: bool) -> str | None:
    from workers.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP

    if type(layer) is not LlamaDecoderLayer or type(layer.mlp) is not LlamaMLP:
        return f"{type(layer).__name__} is not a plain Llama layer"
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not LlamaAttention or type(mlp.act) is not SiluAndMul:
        return "not a plain Llama attention and SiLU MLP"
    a = attn.attn
    if attn.q_norm is not None or attn.sinks is not None or a.sliding_window or a.logit_softcap:
        return "q/k norm, sinks, sliding window or soft-cap"
    if bound and (a.kv_scale is not None or not cpu_paged.supports(torch.float32, a.head_dim)):
        return "an FP8 cache or a head size the paged kernel lacks"
    if bound and (not isinstance(a.backend, TorchBackend) or a.backend.kernel is None):
        return "not the torch backend with its paged kernel"
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if any(not _tiles_only(lin) for lin in linears):
        return "a linear that is not int8 tiles only (or has a bias or LoRA)"
    return None


def _tiles_only(linear: nn.Module) -> bool:
    w = linear.packed
    return (
        isinstance(w, GGUFWeight)
        and w.freed_shape is not None
        and w.packed is not None
        and linear.bias is None
        and linear.lora is None
    )


def _plan(model: Any) -> Any:
    """torch.classes.raylm_driver.Plan over the model's layers (cpu_driver.cpp's layout)."""
    tensors: list[torch.Tensor] = []
    ints: list[int] = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        tensors += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            tensors += lin.packed.packed
            ints += [lin.packed.shape[0], gguf_cpu.QTYPE_IDS[lin.packed.qtype]]
    first = model.layers[0].self_attn
    tensors += [model.norm.weight, first.rotary.cos, first.rotary.sin]
    ints += [first.attn.num_heads, first.attn.num_kv_heads, first.head_dim]
    floats = [float(model.norm.eps), float(first.attn.scale)]
    return torch.classes.raylm_driver.Plan(tensors, ints, floats)
