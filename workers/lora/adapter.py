"""PEFT LoRA adapters read from disk and checked against the base model.

A PEFT adapter directory holds `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`, ...)
and `adapter_model.safetensors`, whose tensors are named like
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` ([r, in]) and `...lora_B.weight`
([out, r]). The update of a projection is `x @ A^T @ B^T * scaling`, with scaling `alpha / r`
(`alpha / sqrt(r)` under rsLoRA). Every problem raises a ValueError that names it: the engine
checks an adapter this way, from the bytes read once at load (workers/lora/files.py), before any
request can use it.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from workers.layers.mla import is_mla_config
from workers.lora.files import CONFIG_FILE, WEIGHTS_FILE, AdapterFiles, read_adapter_files

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# The projections an adapter may target: attention (fused as qkv in our models) and the dense MLP
# (fused as gate_up).
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
# Trained adapters use an alpha of a few times their rank; one of millions only scales the update
# past what the model's activations can hold (its answers turn to NaN).
MAX_LORA_ALPHA = 1e6
# Room in a weights file beyond its tensors' bytes: the safetensors header (names, shapes, JSON).
HEADER_BYTES = 1 << 20
_TENSOR_NAME = re.compile(
    r"(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)


def check_lora_model(config: PretrainedConfig) -> None:
    """LoRA adapts Llama-style q/k/v/o projections; a latent-attention (MLA) model has none (its
    queries and keys come from low-rank projections and a latent cache), so LoRA is refused by
    name at engine start rather than failing deep in the manager."""
    if is_mla_config(config):
        arch = ", ".join(getattr(config, "architectures", None) or [type(config).__name__])
        raise ValueError(
            f"max_loras: LoRA is not supported for {arch} (multi-head latent attention has no "
            "q/k/v projections to adapt); leave max_loras, lora_modules and lora_root unset"
        )


@dataclass(frozen=True, slots=True)
class ModelShapes:
    """What an adapter must fit: each target's full [out, in] and the number of layers."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]  # target -> (out_features, in_features), before TP

    @classmethod
    def from_hf_config(cls, config: PretrainedConfig) -> ModelShapes:
        check_lora_model(config)
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        hidden, inter = config.hidden_size, config.intermediate_size
        shapes = {
            "q_proj": (heads * head_dim, hidden),
            "k_proj": (kv_heads * head_dim, hidden),
            "v_proj": (kv_heads * head_dim, hidden),
            "o_proj": (hidden, heads * head_dim),
        }
        # Mixture-of-experts models have no dense MLP projections to adapt.
        if not any(getattr(config, k, None) for k in ("num_local_experts", "num_experts")):
            shapes |= {
                "gate_proj": (inter, hidden),
                "up_proj": (inter, hidden),
                "down_proj": (hidden, inter),
            }
        return cls(config.num_hidden_layers, shapes)

    def max_adapter_bytes(self, max_rank: int) -> int:
        """The largest weights file an adapter of at most max_rank can need: A and B of every
        target of every layer in float64, plus a header. A bigger file is refused unread."""
        per_layer = sum(max_rank * (out + inp) for out, inp in self.shapes.values())
        return self.num_layers * per_layer * 8 + HEADER_BYTES


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """One adapter's weights on the CPU: (layer, target) -> (A [r, in], B [out, r] * scaling),
    and the digest of the bytes they were read from."""

    name: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    digest: str = ""

    @property
    def identity(self) -> str:
        """name@digest: what the workers' adapters and the prefix cache's chains are keyed by, so
        other weights under the same name never meet the old ones' KV or slot."""
        return f"{self.name}@{self.digest[:32]}"

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def resolve_lora_path(path: str, root: str | None, allowed: set[str]) -> str:
    """The adapter directory `path` resolved (symlinks followed): it must lie under `root`, or,
    with no root, be one of `allowed` (the configured lora_modules). ValueError otherwise."""
    if not isinstance(path, str) or not path or "\x00" in path or len(path) > 4096:
        raise ValueError("lora_path: must be a non-empty path of at most 4096 characters")
    real = os.path.realpath(path)
    if root is None:
        if real not in {os.path.realpath(p) for p in allowed}:
            raise ValueError(
                "lora_path: not a configured lora_modules path (set lora_root to load adapters "
                "from a directory at run time)"
            )
        return real
    top = os.path.realpath(root)
    if os.path.commonpath([real, top]) != top:
        raise ValueError("lora_path: is outside lora_root")
    return real


def read_adapter(
    name: str, path: str, model: ModelShapes, max_rank: int, dtype: torch.dtype = torch.float32
) -> LoraAdapter:
    """Read (workers/lora/files.py) and check the PEFT LoRA adapter directory `path`."""
    files = read_adapter_files(path, model.max_adapter_bytes(max_rank))
    return parse_adapter(name, files, model, max_rank, dtype)


def parse_adapter(
    name: str, files: AdapterFiles, model: ModelShapes, max_rank: int, dtype: torch.dtype
) -> LoraAdapter:
    """The adapter in `files`, checked against the model; ValueError naming what is wrong."""
    rank, alpha, scaling = _parse_config(files.config, max_rank)
    pairs = _pairs(name, _parse_tensors(files.weights), model)
    weights = {}
    for (layer, target), ab in pairs.items():
        where = f"lora adapter {name!r}: layers.{layer}.{target}"
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: needs both lora_A and lora_B")
        a, b = ab["A"], ab["B"]
        out_features, in_features = model.shapes[target]
        if a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise ValueError(
                f"{where}: shapes {tuple(a.shape)} and {tuple(b.shape)} do not fit the model "
                f"(rank {rank}: expected {(rank, in_features)} and {(out_features, rank)})"
            )
        # Checked as the forward will use them: B scaled, both in the model's dtype.
        a, b = a.to(dtype), (b.double() * scaling).to(dtype)
        if not torch.isfinite(a).all():
            raise ValueError(f"{where}: lora_A weights must be finite")
        if not torch.isfinite(b).all():
            raise ValueError(
                f"{where}: lora_B weights times the scaling of lora_alpha={alpha!r} are not "
                f"finite in {dtype}"
            )
        weights[(layer, target)] = (a, b)
    return LoraAdapter(name, rank, weights, files.digest)


def _pairs(
    name: str, tensors: dict[str, torch.Tensor], model: ModelShapes
) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """The tensors grouped as (layer, target) -> {"A": ..., "B": ...}, every name checked."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR_NAME.fullmatch(key)
        if match is None:
            raise ValueError(
                f"lora adapter {name!r}: tensor {key!r} is not a supported LoRA weight"
            )
        layer, target, which = int(match[1]), match[2], match[3]
        if target not in model.shapes:
            raise ValueError(
                f"lora adapter {name!r}: target module {target!r} is not in the base model "
                f"(supported: {sorted(model.shapes)})"
            )
        if layer >= model.num_layers:
            raise ValueError(
                f"lora adapter {name!r}: layer {layer} is past the base model's {model.num_layers}"
            )
        pairs.setdefault((layer, target), {})[which] = tensor
    if not pairs:
        raise ValueError(f"lora adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    return pairs


def _parse_config(data: bytes, max_rank: int) -> tuple[int, float, float]:
    """(rank, lora_alpha, scaling) from adapter_config.json's bytes, refusing what this engine
    cannot run."""
    try:
        config = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"lora adapter config: {CONFIG_FILE} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"lora adapter config: {CONFIG_FILE} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"lora adapter config: peft_type {config.get('peft_type')!r} is not LORA")
    for key in ("use_dora", "fan_in_fan_out"):
        if config.get(key):
            raise ValueError(f"lora adapter config: {key} is not supported")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(key):
            raise ValueError(f"lora adapter config: {key} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError("lora adapter config: bias must be 'none'")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise ValueError(f"lora adapter config: rank r={rank!r} must be in [1, {max_rank}]")
    if (
        isinstance(alpha, bool)
        or not isinstance(alpha, (int, float))
        or not 0 < alpha <= MAX_LORA_ALPHA  # NaN fails too
    ):
        raise ValueError(
            f"lora adapter config: lora_alpha={alpha!r} must be a positive number of at most "
            f"{MAX_LORA_ALPHA:g}"
        )
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, alpha, scaling


def _parse_tensors(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(data)
    except (SafetensorError, RuntimeError, ValueError, OverflowError) as exc:
        raise ValueError(f"lora adapter weights: cannot read {WEIGHTS_FILE}: {exc}") from None
