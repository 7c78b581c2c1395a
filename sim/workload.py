"""Workloads: synthetic (Poisson/gamma arrivals, tenants with shared system prompts) and JSONL
traces."""

from __future__ import annotations

import functools
import itertools
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from settings import check_settings, setting

# Token ids of a prefix group's shared system prompt start here; unique suffixes live below it.
_PREFIX_BASE = 1 << 40
MAX_LEN = 1 << 20  # the longest prompt part or output a workload's range may draw, in tokens
MAX_REQUESTS = 1 << 24  # a workload is held in memory, a request object each
MAX_RATE = 1e6  # requests per second, and the gamma shape of the gaps: past any fleet's
MAX_TENANTS = 1 << 20


def check_len_ranges(cfg: object, *names: str) -> None:
    """Each named field of cfg, a (low, high) range of token counts drawn uniformly and inclusive,
    must be integers with 1 <= low <= high <= 2^20; else a ValueError naming the field."""
    for name in names:
        lo, hi = getattr(cfg, name)
        if not (type(lo) is int and type(hi) is int and 1 <= lo <= hi <= MAX_LEN):
            raise ValueError(f"{name}: need integers 1 <= low <= high <= 2^20, got {(lo, hi)}")


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of a workload; prefix_group requests share their first prefix_len tokens."""

    request_id: str
    arrival_s: float
    prompt_len: int
    output_len: int
    prefix_group: str = ""
    prefix_len: int = 0
    tenant: str = "default"
    priority: int = 0
    lora_name: str = ""  # its LoRA adapter ("": the base model); see sim/adapters.py
    # The group's first context_len tokens are those of context_group, which several groups share
    # (an agent's context, forked: sim/agents.py); "": the group's own tokens throughout.
    context_group: str = ""
    context_len: int = 0
    session: str = ""  # the conversation it belongs to ("": none), routed by router/sessions.py

    def prompt_token_ids(self, index: int) -> list[int]:
        """Deterministic token ids: a group's prefix is identical across requests, the rest
        unique."""
        shared = min(self.prefix_len, self.prompt_len) if self.prefix_group else 0
        suffix_base = (index + 1) << 16
        return [
            *self.shared_token_ids(shared),
            *range(suffix_base, suffix_base + self.prompt_len - shared),
        ]

    @property
    def shared_context_len(self) -> int:
        """Leading tokens taken from context_group (0: none)."""
        if not (self.prefix_group and self.context_group):
            return 0
        return max(0, min(self.context_len, self.prefix_len, self.prompt_len))

    def shared_token_ids(self, shared: int) -> tuple[int, ...]:
        """The group's first `shared` tokens: the context's, then the group's own."""
        group = _PREFIX_BASE + ((hash_group(self.prefix_group) % (1 << 20)) << 20)
        context = min(self.shared_context_len, shared)
        if not context:
            return _shared_prefix(group, shared)
        base = _PREFIX_BASE + ((hash_group(self.context_group) % (1 << 20)) << 20)
        return _shared_prefix(base, context) + _shared_prefix(group, shared)[context:]


@functools.lru_cache(maxsize=8192)
def _shared_prefix(base: int, length: int) -> tuple[int, ...]:
    # One set of int objects per group: a long run retains ~1,000 finished requests per replica,
    # and their token lists would otherwise each hold their own copies (~9 KB per prompt).
    return tuple(range(base, base + length))


def hash_group(name: str) -> int:
    """Stable across processes (str hash is salted)."""
    h = 1469598103934665603
    for byte in name.encode():
        h = ((h ^ byte) * 1099511628211) % (1 << 64)
    return h


@dataclass(slots=True)
class WorkloadConfig:
    """A synthetic workload: rate, arrival burstiness, lengths, tenants and their shares."""

    num_requests: int = setting(1000, "requests in the workload", ge=0, le=MAX_REQUESTS)
    rate: float = setting(1.0, "requests per second", gt=0, le=MAX_RATE)
    burstiness: float = setting(
        1.0, "gamma shape of the gaps: 1 is Poisson, < 1 burstier", gt=0, le=MAX_RATE
    )
    tenants: int = setting(12, "tenants, each with its system prompt", ge=1, le=MAX_TENANTS)
    system_prompt_len: int = setting(256, "tokens of each system prompt", ge=0, le=MAX_LEN)
    question_len: tuple[int, int] = (16, 16)  # uniform inclusive range
    output_len: tuple[int, int] = (16, 16)
    tenant_weights: list[float] = field(default_factory=list)  # empty: equal shares
    tenant_priorities: list[int] = field(default_factory=list)
    seed: int = setting(0, "seed of the draws", ge=0, lt=2**63)

    def __post_init__(self) -> None:
        check_settings(self)
        check_len_ranges(self, "question_len", "output_len")
        if self.tenant_weights and (
            len(self.tenant_weights) != self.tenants
            or any(not w >= 0 for w in self.tenant_weights)
            or sum(self.tenant_weights) <= 0
        ):
            raise ValueError("tenant_weights: need one weight >= 0 per tenant, not all zero")
        if self.tenant_priorities and len(self.tenant_priorities) != self.tenants:
            raise ValueError("tenant_priorities: need one priority per tenant")


def synthetic_workload(cfg: WorkloadConfig) -> list[SimRequest]:
    """Requests with gamma inter-arrival times (mean 1/rate) and tenant system prompts."""
    rng = random.Random(cfg.seed)
    # Summed once: choices() would sum the weights of every tenant again for each request.
    cum_weights = list(itertools.accumulate(cfg.tenant_weights or [1.0] * cfg.tenants))
    tenants = range(cfg.tenants)
    shape = cfg.burstiness
    scale = 1.0 / (cfg.rate * shape)
    t = 0.0
    out: list[SimRequest] = []
    for i in range(cfg.num_requests):
        t += rng.gammavariate(shape, scale)
        k = rng.choices(tenants, cum_weights=cum_weights)[0]
        question = rng.randint(*cfg.question_len)
        out.append(
            SimRequest(
                request_id=f"r{i}",
                arrival_s=t,
                prompt_len=cfg.system_prompt_len + question,
                output_len=rng.randint(*cfg.output_len),
                prefix_group=f"t{k}" if cfg.system_prompt_len else "",
                prefix_len=cfg.system_prompt_len,
                tenant=f"t{k}",
                priority=cfg.tenant_priorities[k] if cfg.tenant_priorities else 0,
            )
        )
    return out


_TRACE_FIELDS = {
    "arrival_s": float,
    "prompt_len": int,
    "output_len": int,
    "prefix_group": str,
    "prefix_len": int,
    "tenant": str,
    "priority": int,
    "lora_name": str,
}
_REQUIRED = ("arrival_s", "prompt_len", "output_len")


def load_trace(path: str | Path) -> list[SimRequest]:
    """Requests from a JSONL trace, one object per line; errors name the line and the field."""
    out: list[SimRequest] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                out.append(_parse_trace_line(line, lineno, len(out)))
    out.sort(key=lambda r: r.arrival_s)
    return out


def _parse_trace_line(line: str, lineno: int, index: int) -> SimRequest:
    where = f"trace line {lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: invalid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object")
    values: dict = {}
    for key, value in obj.items():
        kind = _TRACE_FIELDS.get(key)
        if kind is None:
            raise ValueError(f"{where}, field {key!r}: unknown; known: {sorted(_TRACE_FIELDS)}")
        ok = (
            isinstance(value, str)
            if kind is str
            else (
                not isinstance(value, bool)
                and isinstance(value, (int, float) if kind is float else int)
            )
        )
        if not ok:
            raise ValueError(f"{where}, field {key!r}: expected {kind.__name__}, got {value!r}")
        values[key] = value
    for key in _REQUIRED:
        if key not in values:
            raise ValueError(f"{where}, field {key!r}: missing")
    if not (math.isfinite(values["arrival_s"]) and values["arrival_s"] >= 0):
        raise ValueError(f"{where}, field 'arrival_s': must be finite and >= 0")
    for key in ("prompt_len", "output_len"):
        if not 1 <= values[key] <= 1 << 24:
            raise ValueError(f"{where}, field {key!r}: must be in [1, 2^24], got {values[key]}")
    if not 0 <= values.get("prefix_len", 0) <= values["prompt_len"]:
        raise ValueError(f"{where}, field 'prefix_len': must be in [0, prompt_len]")
    return SimRequest(request_id=f"r{index}", arrival_s=float(values.pop("arrival_s")), **values)
