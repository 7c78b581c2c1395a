"""New weights and sleep on one rank, between steps (engine/weights.py drives every rank).

An update is staged, then committed: `stage_path` / `stage_group` read every tensor and check it
against the checkpoint the model was loaded from (names, shapes, dtypes; then every value finite)
before anything is replaced, so a bad checkpoint leaves the old weights serving; `commit` copies
the staged tensors in through the model's own `load_weights` (each rank narrows its shard), then
re-packs the CPU linears. A quantized layer (GGUF blocks, FP8, INT4) is refused by name: its
kernels keep no float weight to copy into.

Sleep frees this rank's KV cache (and the tiers' memory) at level 1; level 2 also moves the
weights to host memory (CUDA), or drops them (`discard`) when an update will bring new ones.
"""

from __future__ import annotations

import gc
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from workers.layers.linear import CpuPackedWeight
from workers.layers.param_attrs import set_param_attr
from workers.loader import finish_cpu_weights, mapped_tensors, safetensors_files
from workers.weight_transfer import (
    DTYPE_NAMES,
    Manifest,
    WeightGroup,
    WeightGroupSpec,
    open_group,
    receive_weights,
)

if TYPE_CHECKING:
    from workers.models.llama import LlamaForCausalLM
    from workers.runner import ModelRunner

logger = logging.getLogger(__name__)

# safetensors' names of the float dtypes a checkpoint may store.
_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_PATH_MAX = 4096


@dataclass(slots=True)
class RankWeights:
    """One rank's update and sleep state (ModelRunner.weights)."""

    expected: dict[str, tuple[str, tuple[int, ...]]] | None = None  # name -> (dtype, shape)
    group: WeightGroup | None = None
    staged: list[tuple[str, torch.Tensor]] | None = None
    offloaded: list[tuple[nn.Parameter, torch.Tensor]] = field(default_factory=list)
    discarded: bool = False
    kv_blocks: tuple[int, int] | None = None  # (device, CPU) blocks while asleep


# ---- what the model was loaded from --------------------------------------------------------------
def expected_tensors(model_dir: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor in the model's checkpoint (headers only)."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path in safetensors_files(model_dir):
        for name, entry in _header(path).items():
            if name != "__metadata__":
                dtype = _ST_DTYPES.get(entry["dtype"], entry["dtype"])
                out[name] = (dtype, tuple(entry["shape"]))
    return out


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n <= 100 << 20:
            raise ValueError(f"{path.name}: not a safetensors file (header of {n} bytes)")
        return json.loads(f.read(n))


def _module(runner: ModelRunner) -> nn.Module:
    model = runner.model
    assert isinstance(model, nn.Module)  # every family is one; the runner sees it as CausalLM
    return model


def _expected(runner: ModelRunner) -> dict[str, tuple[str, tuple[int, ...]]]:
    state = runner.weights
    if state.expected is None:
        state.expected = expected_tensors(runner.config.model_dir)
    return state.expected


def check_names(runner: ModelRunner, listed: list[tuple[str, str, tuple[int, ...]]]) -> list[str]:
    """Raise ValueError naming the first tensor whose name, shape or dtype the model's checkpoint
    does not have, or the first it has that is missing; the names the model reads."""
    expected = _expected(runner)
    engine_dtype = runner.config.dtype
    tied = "lm_head.weight" not in expected
    used = []
    for name, dtype, shape in listed:
        if name not in expected:
            if (tied and name == "lm_head.weight") or "rotary_emb.inv_freq" in name:
                continue  # what the model's loader skips: a tied head, a rotary buffer
            raise ValueError(f"{name}: the model has no tensor of that name")
        want_dtype, want_shape = expected[name]
        if tuple(shape) != want_shape:
            raise ValueError(f"{name}: shape {tuple(shape)}, the model's is {want_shape}")
        if dtype not in {want_dtype, engine_dtype}:
            raise ValueError(
                f"{name}: dtype {dtype}, the model takes {sorted({want_dtype, engine_dtype})}"
            )
        used.append(name)
    missing = sorted(set(expected) - set(used))
    if missing:
        raise ValueError(f"{missing[0]}: missing from the update ({len(missing)} tensors missing)")
    return used


def check_finite(tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Raise naming the first tensor that holds a NaN or an inf. A finite sum proves every value
    finite (a NaN or an inf makes any sum NaN or inf) at a third of an element-wise check's cost;
    only a sum that overflowed is checked element by element."""
    for name, t in tensors:
        if not bool(torch.isfinite(t.sum())) and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name}: holds NaN or inf values")


def refuse_quantized(model: nn.Module) -> None:
    """Raise naming the first layer whose weight is kept quantized (GGUF blocks, FP8, INT4)."""
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and (
            getattr(weight, "gguf", None) is not None or getattr(weight, "quant", None) is not None
        ):
            raise ValueError(
                f"{name}: its weight is kept quantized (GGUF blocks, FP8 or INT4) and cannot take "
                "new float values; load the model with quantization: none to update its weights"
            )


# ---- staging ------------------------------------------------------------------------------------
def weight_files(path: str) -> list[Path]:
    """The safetensors files of an update: a directory's (its index, or every *.safetensors) or
    one file."""
    if not isinstance(path, str) or not 0 < len(path) <= _PATH_MAX or "\x00" in path:
        raise ValueError(f"path: must be a file or directory path of 1-{_PATH_MAX} characters")
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".safetensors":
        return [p]
    if p.is_dir():
        return safetensors_files(str(p))
    raise ValueError(
        f"path: {path!r} is neither a directory of safetensors nor a .safetensors file"
    )


def _path_tensors(files: list[Path]) -> list[tuple[str, torch.Tensor]]:
    return [(name, t) for f in files for name, t in mapped_tensors(f)]


def stage_path(runner: ModelRunner, path: str) -> int:
    """Check every tensor of the checkpoint at path (memory-mapped: commit copies from the same
    mapping); returns how many the model reads."""
    refuse_quantized(_module(runner))
    files = weight_files(path)
    tensors = _path_tensors(files)
    for name, t in tensors:
        if t.dtype not in DTYPE_NAMES.values():
            raise ValueError(f"{name}: dtype {t.dtype} is not a float the model takes")
    used = set(check_names(runner, [(n, _dtype_name(t), tuple(t.shape)) for n, t in tensors]))
    staged = [(n, t) for n, t in tensors if n in used]
    check_finite(staged)
    runner.weights.staged = staged  # views of the mapped files: read once, copied in by commit
    return len(used)


def _dtype_name(t: torch.Tensor) -> str:
    return next((k for k, v in DTYPE_NAMES.items() if v == t.dtype), str(t.dtype))


def join_group(runner: ModelRunner, spec: WeightGroupSpec) -> None:
    """Join a trainer's weight group as spec.rank + this rank's tensor-parallel rank."""
    from workers.parallel import get_tp_rank

    state = runner.weights
    if state.group is not None:
        raise ValueError("weight group: this engine already belongs to one; leave it first")
    state.group = open_group(spec.member(get_tp_rank()), runner.device)


def leave_group(runner: ModelRunner) -> None:
    runner.weights.group = None  # the process group is released with its last reference


def stage_group(runner: ModelRunner) -> int:
    """Receive the trainer's next update over the weight group (workers/weight_transfer.py),
    checked as a path's is; returns how many tensors the model reads."""
    state = runner.weights
    if state.group is None:
        raise ValueError("weight group: join one first (init_weight_group)")
    refuse_quantized(_module(runner))
    used: list[str] = []

    def names(manifest: Manifest) -> None:
        used.extend(check_names(runner, [(t.name, t.dtype, t.shape) for t in manifest.tensors]))

    received = receive_weights(state.group, runner.device, names, check_finite)
    keep = set(used)
    state.staged = [(n, t) for n, t in received if n in keep]
    return len(keep)


def drop_staged(runner: ModelRunner) -> None:
    runner.weights.staged = None


# ---- commit -------------------------------------------------------------------------------------
@torch.inference_mode()
def commit(runner: ModelRunner) -> int:
    """Copy the staged tensors into the model (each rank its shard); returns how many."""
    state, model = runner.weights, _module(runner)
    staged, state.staged = state.staged, None
    if staged is None:
        raise ValueError("update_weights: nothing staged on this rank")
    _writable(model, runner.device)
    loaded = cast("LlamaForCausalLM", model).load_weights(iter(staged))  # every family's
    if runner.device.type == "cpu":
        finish_cpu_weights(model)
    state.discarded = False
    return len(loaded)


def _writable(model: nn.Module, device: torch.device) -> None:
    """Give every parameter whose values were dropped (a packed CPU linear's float copy, weights
    discarded by sleep) storage of its own again, to copy new values into."""
    for p in model.parameters():
        if p.numel() > 1 and 0 in p.data.stride():
            p.data = torch.empty(p.shape, dtype=p.dtype, device=device)
            if getattr(p, "packed_only", False):
                set_param_attr(p, "packed_only", False)


# ---- sleep --------------------------------------------------------------------------------------
def sleep(runner: ModelRunner, level: int, discard: bool) -> None:
    """Free the KV cache (level 1), and (level 2) offload or drop the weights."""
    state = runner.weights
    if state.kv_blocks is not None:
        raise ValueError("sleep: this engine is already asleep")
    if level == 2:
        refuse_quantized(_module(runner))
    cache = runner.kv_cache
    if cache is None:
        raise RuntimeError("sleep: the KV cache was never allocated")
    pad = 1 if runner.use_graphs else 0
    state.kv_blocks = (cache.num_gpu_blocks - pad, cache.num_cpu_blocks)
    _free_kv(runner)
    if level == 2:
        if discard:
            _discard(_module(runner))
            state.discarded = True
        elif runner.device.type == "cuda":
            state.offloaded = _offload(_module(runner))
    _release_memory(runner.device)


def _free_kv(runner: ModelRunner) -> None:
    from workers.features.kv_loads import KVLoadsFeature

    runner.kv_cache, runner.graphs = None, None
    for layer in runner.layers:
        layer.k_cache = layer.v_cache = torch.empty(0)
    loads = runner.feature(KVLoadsFeature)
    if loads is not None:
        loads.cache, loads.tiers = None, None


def _placeholder(p: torch.Tensor) -> torch.Tensor:
    """A view with p's shape, dtype and device over one element: shape-only readers still work."""
    return p.data.new_zeros(()).expand(p.shape)


def _offload(model: nn.Module) -> list[tuple[nn.Parameter, torch.Tensor]]:
    moved = []
    for p in model.parameters():
        moved.append((p, p.data.to("cpu", copy=True).pin_memory()))
        p.data = _placeholder(p)
    return moved


def _discard(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, CpuPackedWeight):
            module.packed = None
    for p in model.parameters():
        p.data = _placeholder(p)


def _release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        from workers.loader import return_freed_heap

        return_freed_heap()


def wake_up(runner: ModelRunner) -> None:
    """Bring the weights back (if offloaded) and allocate the KV cache as it was."""
    state = runner.weights
    if state.kv_blocks is None:
        raise ValueError("wake_up: this engine is not asleep")
    for p, saved in state.offloaded:
        p.data = saved.to(runner.device)
    state.offloaded = []
    blocks, state.kv_blocks = state.kv_blocks, None
    runner.init_kv_cache(*blocks)


def is_asleep(runner: ModelRunner) -> bool:
    return runner.weights.kv_blocks is not None
