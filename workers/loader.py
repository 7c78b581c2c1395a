"""Load a model's weights per rank from an HF directory (workers.model_files finds and converts
models)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm
from transformers import PretrainedConfig

from workers.hub import ensure_weights
from workers.layers.linear import drop_packed_float_copies, pack_cpu_weights
from workers.layers.quantized import drop_float_copies
from workers.models import model_class
from workers.models.llama import LlamaForCausalLM
from workers.pipeline import check_stage_built, current_stage, stage_weights
from workers.quant_config import quant_config_of
from workers.quant_weights import attach_quantized, quantize_model_fp8, quantized_tensors

logger = logging.getLogger(__name__)


def safetensors_files(model_dir: str) -> list[Path]:
    """The checkpoint shards of an HF directory (from the index when there is one); a hub snapshot
    fetches its weights first, once per node."""
    ensure_weights(model_dir)
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [d / n for n in names]
    else:
        files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {model_dir!r}")
    return files


# safetensors' dtype names; a tensor of any other is read through the safetensors library.
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
}


def mapped_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in a safetensors file, each a view of the file mapped into
    memory (copy-on-write: nothing writes the file).

    A rank's loader narrows a view to its shard and copies that into its parameter: the one copy
    of the weight, read from the page cache as it is touched (no read into a buffer first, no
    pages of other ranks' shards). A tensor the view cannot type (an unknown dtype, an offset not
    aligned to its element size) is read by the safetensors library instead.
    """
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    size = path.stat().st_size
    data = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
    assert isinstance(data, torch.UntypedStorage)  # typed as any storage; it is this one
    raw = torch.empty(0, dtype=torch.uint8).set_(data)
    base = 8 + header_len
    fallback = None
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(entry["dtype"])
        start, end = entry["data_offsets"]
        if dtype is None or (base + start) % dtype.itemsize:
            fallback = fallback or safe_open(str(path), framework="pt")
            yield name, fallback.get_tensor(name)
            continue
        yield name, raw[base + start : base + end].view(dtype).view(entry["shape"])


def iterate_weights(model_dir: str, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of every checkpoint tensor, with a progress bar over tensors; each a
    view of its memory-mapped file (mapped_tensors)."""
    files = safetensors_files(model_dir)
    total = 0
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            total += len(h.keys())
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for f in files:
            for name, tensor in mapped_tensors(f):
                yield name, tensor
                bar.update(1)


def load_model(
    model_dir: str,
    config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int | None = None,
    progress: bool = True,
    gguf_file: str | None = None,
    quantization: str = "none",
) -> LlamaForCausalLM:
    """Build the model for config on device in dtype and load this rank's weight shards.

    With gguf_file (CPU only) the weights come from that GGUF file, its Q4_0/Q4_1/Q8_0 and
    Q4_K/Q5_K/Q6_K tensors kept as blocks (workers.layers.quantized); the float storage those
    parameters were built with, never written, is freed."""
    if gguf_file is not None and device.type != "cpu":
        raise ValueError(
            f"quantization: GGUF blocks are kept quantized on CPU only, not on {device.type}; "
            "use quantization: none"
        )
    qc = None if gguf_file is not None else quant_config_of(config, quantization)
    cls = model_class(config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(config, max_model_len=max_model_len)
    finally:
        torch.set_default_dtype(previous)
    # A pipeline stage reads only the tensors of the layers it holds.
    stage, tied = current_stage(), model.args.tie_word_embeddings
    check_stage_built(model, stage)
    if gguf_file is not None:
        from workers.gguf import iterate_gguf

        loaded = model.load_weights(stage_weights(iterate_gguf(gguf_file, config), stage, tied))
    else:
        weights = stage_weights(iterate_weights(model_dir, progress), stage, tied)
        loaded = model.load_weights(quantized_tensors(weights, qc))
    model.check_loaded(loaded)
    if qc is not None and qc.method == "fp8":
        quantize_model_fp8(model, qc.per_tensor)
    if qc is not None:
        logger.info("%d linears kept as %s", attach_quantized(model, dtype), qc.method)
    if gguf_file is not None:
        logger.info("%d weights kept as GGUF blocks", drop_float_copies(model))
    if device.type == "cpu":
        finish_cpu_weights(model)
    return model.requires_grad_(False).eval()


def finish_cpu_weights(model: nn.Module) -> None:
    """Pack a CPU model's linears, now that they hold their values, and free the float copies the
    packed ones replace (at load, and after a weight update: workers/weight_update.py)."""
    pack_cpu_weights(model)
    freed = drop_packed_float_copies(model)
    logger.info("%d weights freed beside their packed copies", freed)
    if freed:
        return_freed_heap()
    from workers.layers.backends.cpu_driver import build_for  # imports the model families

    build_for(model)


def return_freed_heap() -> None:
    """Hand the freed weights' pages back to the OS. The weights (1-4 MB each) were allocated
    from glibc's heap, which keeps freed chunks for reuse: without a trim the replica's RSS stays
    where it was (measured: 1,398 MiB before, 993 MiB after, on the de-quantized SmolLM2)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc: nothing to trim
        return
    trim(0)
