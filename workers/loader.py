"""Load a model's weights per rank from an HF directory (workers.model_files finds and converts
models)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm
from transformers import PretrainedConfig

from workers.layers.linear import pack_cpu_weights
from workers.layers.quantized import drop_float_copies
from workers.models import model_class

logger = logging.getLogger(__name__)


def safetensors_files(model_dir: str) -> list[Path]:
    """The checkpoint shards of an HF directory (from the index when there is one)."""
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


class CheckpointTensor:
    """One safetensors tensor read on demand: narrow() reads only the rows or columns a rank
    keeps."""

    def __init__(self, handle, name: str) -> None:
        self._slice = handle.get_slice(name)
        self.shape = torch.Size(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]


def iterate_weights(
    model_dir: str, progress: bool = True, lazy: bool = False
) -> Iterator[tuple[str, torch.Tensor | CheckpointTensor]]:
    """(name, tensor) pairs of every checkpoint tensor, with a progress bar over tensors.

    lazy=True yields CheckpointTensors, so each tensor-parallel rank reads only its own slices.
    """
    files = safetensors_files(model_dir)
    handles = [safe_open(str(f), framework="pt") for f in files]
    total = sum(len(h.keys()) for h in handles)
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for h in handles:
            for name in h.keys():  # noqa: SIM118 - a safetensors handle is no dict
                yield name, CheckpointTensor(h, name) if lazy else h.get_tensor(name)
                bar.update(1)


def load_model(
    model_dir: str,
    config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int | None = None,
    progress: bool = True,
    gguf_file: str | None = None,
) -> torch.nn.Module:
    """Build the model for config on device in dtype and load this rank's weight shards.

    With gguf_file (CPU only) the weights come from that GGUF file, its Q4_0/Q4_1/Q8_0 tensors
    kept as blocks (workers.layers.quantized); the float storage those parameters were built
    with, never written, is freed."""
    if gguf_file is not None and device.type != "cpu":
        raise ValueError(
            f"quantization: GGUF blocks are kept quantized on CPU only, not on {device.type}; "
            "use quantization: none"
        )
    cls = model_class(config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(config, max_model_len=max_model_len)
    finally:
        torch.set_default_dtype(previous)
    if gguf_file is not None:
        from workers.gguf import iterate_gguf

        loaded = model.load_weights(iterate_gguf(gguf_file, config))
    else:
        loaded = model.load_weights(iterate_weights(model_dir, progress, lazy=True))
    model.check_loaded(loaded)
    if gguf_file is not None:
        logger.info("%d weights kept as GGUF blocks", drop_float_copies(model))
    if device.type == "cpu":
        pack_cpu_weights(model)  # once, on this rank's shards, now that they hold their values
    return model.requires_grad_(False).eval()
