"""Roofline step-time model: FLOPs against measured throughput, bytes against measured bandwidth."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

PROFILE_DIR = Path(__file__).parent / "profiles"


@dataclass(frozen=True, slots=True)
class CostModel:
    """Step time = overheads + per-sequence costs + prefill attention + max(compute time, memory
    time).

    compute: 2 * num_params FLOPs per token at flops_per_s; memory: the weights and the KV read
    (context plus the step's own tokens) at bytes_per_s. A step with prefill tokens also pays
    prefill_step_overhead_s and prefill_step_per_seq_s per sequence (on a GPU it runs eagerly,
    decode steps replay CUDA graphs), a cost per prefilling sequence, and its attention: one unit
    per (prefill query token, key) pair, which grows with the square of a prompt and with a
    chunk's prior context.
    """

    name: str
    num_params: float  # model parameters (FLOPs per token ~ 2 * num_params)
    weight_bytes: float  # read once per step
    kv_bytes_per_token: (
        float  # K and V of all layers for one token (a fit gives the effective figure)
    )
    flops_per_s: float  # measured matmul throughput
    bytes_per_s: float  # measured memory bandwidth
    step_overhead_s: float = 0.0  # fixed cost of a step (launch, sampling, Python)
    per_seq_overhead_s: float = 0.0  # per scheduled sequence (sampling, bookkeeping)
    prefill_step_overhead_s: float = 0.0  # extra fixed cost of a step that has prefill tokens
    prefill_step_per_seq_s: float = (
        0.0  # extra per sequence (decodes too) of a step that has prefill tokens
    )
    per_prefill_seq_overhead_s: float = 0.0  # extra per sequence with prefill tokens
    prefill_pair_s: float = 0.0  # prefill attention, per (query token, key) pair
    source: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not 0 <= value < math.inf:
                raise ValueError(f"{f.name}: must be a finite number >= 0, got {value!r}")
        if self.flops_per_s <= 0 or self.bytes_per_s <= 0:
            raise ValueError("flops_per_s/bytes_per_s: must be > 0")

    def step_time(
        self,
        prefill_tokens: int,
        decode_tokens: int,
        kv_read_tokens: int,
        num_seqs: int,
        prefill_pairs: int = 0,
    ) -> float:
        """Seconds for one step computing these tokens while attending over kv_read_tokens.

        num_seqs counts every scheduled sequence; decode_tokens of them decode (one token each), the
        rest prefill; prefill_pairs is the prefill attention's (query token, key) pairs.
        """
        tokens = prefill_tokens + decode_tokens
        if tokens == 0:
            return 0.0
        compute = 2.0 * self.num_params * tokens / self.flops_per_s
        memory = (
            self.weight_bytes + self.kv_bytes_per_token * (kv_read_tokens + tokens)
        ) / self.bytes_per_s
        t = self.step_overhead_s + self.per_seq_overhead_s * num_seqs + max(compute, memory)
        if prefill_tokens:
            t += self._prefill_overhead(num_seqs, num_seqs - decode_tokens, prefill_pairs)
        return t

    def _prefill_overhead(self, num_seqs: int, prefilling: int, prefill_pairs: int) -> float:
        """What a step that prefills costs beyond the same step decoding: per step, per
        scheduled and per prefilling sequence, and per attention pair."""
        return (
            self.prefill_step_overhead_s
            + self.prefill_step_per_seq_s * num_seqs
            + self.per_prefill_seq_overhead_s * prefilling
            + self.prefill_pair_s * prefill_pairs
        )

    def decode_steps(
        self,
        num_seqs: int,
        kv_read_tokens: int,
        start_s: float,
        max_steps: int,
        horizon_s: float,
        ends: list[float],
        durations: list[float],
    ) -> None:
        """Append the end times and durations of up to max_steps pure-decode steps of num_seqs
        sequences from start_s, each as step_time gives it (to the bit), through the first to end
        past horizon_s. Each step reads the KV its predecessor wrote."""
        if max_steps <= 0:
            return
        # step_time(0, n, kv, n)'s terms, grouped as it groups them, so the floats are the same.
        base = self.step_overhead_s + self.per_seq_overhead_s * num_seqs
        compute = 2.0 * self.num_params * num_seqs / self.flops_per_s
        weight, kv_bytes, bandwidth = self.weight_bytes, self.kv_bytes_per_token, self.bytes_per_s
        kv = kv_read_tokens
        t = start_s
        for _ in range(max_steps):
            memory = (weight + kv_bytes * (kv + num_seqs)) / bandwidth
            d = base + (compute if compute > memory else memory)
            t += d
            ends.append(t)
            durations.append(d)
            if t > horizon_s:
                return
            kv += num_seqs


def load_profile(name_or_path: str) -> CostModel:
    """A profile by name (sim/profiles/<name>.json) or path; unknown keys raise ValueError naming
    them."""
    data = _read_profile(name_or_path)
    known = {f.name for f in fields(CostModel)}
    for key in data:
        if key not in known:
            raise ValueError(f"profile field {key!r}: unknown; known: {sorted(known)}")
    for key, value in data.items():
        if key not in ("name", "source") and (
            isinstance(value, bool) or not isinstance(value, (int, float))
        ):
            raise ValueError(f"profile field {key!r}: expected a number, got {value!r}")
    # A JSON object's values, checked above: numbers become floats, name and source pass as read.
    values: dict[str, Any] = {
        k: (float(v) if k not in ("name", "source") else v) for k, v in data.items()
    }
    return CostModel(**values)


def _read_profile(name_or_path: str) -> dict[str, Any]:
    """The JSON object of a profile by name (sim/profiles/<name>.json) or path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILE_DIR / f"{name_or_path}.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"profile {str(path)!r}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"profile {str(path)!r}: expected a JSON object")
    return data
