"""deploy.yaml's `disaggregation:` section of a model: prefill and decode replicas apart.

```yaml
args:
  model: default
  disaggregation:
    prefill_replicas: 1
    decode_replicas: 2
    kv_transport: auto          # or object_store, collective (docs/disaggregation.md)
    prefill: {max_num_batched_tokens: 2048}   # engine settings of one phase, over the model's
    decode: {max_num_seqs: 64}
```

Each phase's engine is the model's engine with that phase's keys over it (flat keys, as beside
`model`). The KV moves between them block by block, each decode rank taking its KV heads from the
prefill ranks that hold them (workers/kv_reshard.py): the phases must agree on what makes a block
(model, dtype, block size); their tensor-parallel sizes may differ.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from cluster.kv_transports import KV_TRANSPORTS
from engine.config import EngineConfig
from settings import build, check_settings, nest, setting, shown

PHASES = ("prefill", "decode")
# Engine settings that make a KV block what it is: equal in both phases.
BLOCK_LAYOUT = ("model", "dtype", "block_size")
MAX_TRANSFER_TIMEOUT_S = 600.0
# Replicas of one phase: each is a Serve deployment replica; the ingress knows every one of them.
MAX_PHASE_REPLICAS = 1024


@dataclass(slots=True)
class DisaggregationArgs:
    """Prefill replicas compute prompts and their first token, decode replicas the rest."""

    prefill_replicas: int = setting(1, "replicas that compute prompts", ge=1, le=MAX_PHASE_REPLICAS)
    decode_replicas: int = setting(
        1, "replicas that decode after a prefill", ge=1, le=MAX_PHASE_REPLICAS
    )
    transfer_timeout_s: float = setting(
        10.0,
        "longest a decode step waits for a prompt's KV before it recomputes the prompt instead",
        gt=0,
        le=MAX_TRANSFER_TIMEOUT_S,
    )
    kv_transport: str = setting(
        "auto",
        "how a prompt's KV moves: auto (the object store, or torch.distributed pairs for CUDA "
        "payloads on one machine), object_store, or collective (pairs, plus a store copy when "
        "the cluster spans machines)",
        choices=KV_TRANSPORTS,
    )
    prefill: dict[str, Any] | None = setting(
        None, "engine settings of the prefill replicas, over the model's (flat keys)"
    )
    decode: dict[str, Any] | None = setting(
        None, "engine settings of the decode replicas, over the model's (flat keys)"
    )

    def __post_init__(self) -> None:
        check_settings(self)

    def engine(self, base: EngineConfig, phase: str) -> EngineConfig:
        """The phase's engine: base with the phase's settings over it."""
        overrides = (self.prefill if phase == "prefill" else self.decode) or {}
        merged = _merge(asdict(base), nest(EngineConfig, overrides))
        return build(EngineConfig, merged, f"disaggregation.{phase}.")

    def check(self, base: EngineConfig) -> tuple[EngineConfig, EngineConfig]:
        """Both phases' engines, or ValueError naming what they cannot share."""
        prefill, decode = (self.engine(base, phase) for phase in PHASES)
        _check_same_layout(prefill, decode)
        for phase, engine in zip(PHASES, (prefill, decode), strict=True):
            _check_phase(phase, engine)
        return prefill, decode


def _check_same_layout(prefill: EngineConfig, decode: EngineConfig) -> None:
    for name in BLOCK_LAYOUT:
        a, b = getattr(prefill, name), getattr(decode, name)
        if a != b:
            raise ValueError(
                f"disaggregation.decode.{name}: {shown(b)} differs from the prefill "
                f"replicas' {shown(a)}; KV blocks move between the phases byte for byte "
                "(only their KV heads are re-split), so both must use the same"
            )


def _check_phase(phase: str, engine: EngineConfig) -> None:
    """What one phase's engine needs to send or receive KV blocks."""
    if engine.tensor_parallel_size > 1 and engine.step_transport == "compiled_graph":
        raise ValueError(
            f"disaggregation.{phase}.step_transport: each rank sends or receives its own "
            "KV shard between steps, which compiled_graph workers cannot do; use socket "
            "or actor_calls"
        )
    if engine.pipeline_parallel_size > 1:
        raise ValueError(
            f"disaggregation.{phase}.pipeline_parallel_size: KV moves rank to rank by "
            "tensor-parallel shard; a pipeline stage's layers are not placed yet; use 1"
        )
    if not engine.scheduler.enable_prefix_caching:
        raise ValueError(
            f"disaggregation.{phase}.enable_prefix_caching: the transfer finds blocks by "
            "their prefix hash; it must be on"
        )


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out
