"""Per-request timings and the fleet figures derived from them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestRecord:
    """When one request arrived, got its first token, and finished."""

    request_id: str
    tenant: str
    arrival_s: float
    prompt_len: int
    output_len: int
    replica: str = ""
    first_token_s: float | None = None
    last_token_s: float | None = None
    finish_s: float | None = None
    num_output_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    itl_s: list[float] = field(default_factory=list)

    def on_tokens(self, now: float, n: int, cached: int) -> None:
        if n == 0:
            return
        if self.first_token_s is None:
            self.first_token_s = now
            self.cached_tokens = cached
        else:
            self.itl_s.append(now - self.last_token_s)
        self.last_token_s = now

    def on_token_run(self, times: list[float], cached: int) -> None:
        """One token at each of these times (a jumped stretch): on_tokens for each, in bulk."""
        if self.first_token_s is None:
            self.on_tokens(times[0], 1, cached)
            times = times[1:]
        if times:
            last = self.last_token_s
            self.itl_s.append(times[0] - last)
            self.itl_s.extend([b - a for a, b in zip(times, times[1:])])
            self.last_token_s = times[-1]

    def finish(self, now: float, num_output_tokens: int, reason: str | None) -> None:
        self.finish_s = now
        self.num_output_tokens = num_output_tokens
        self.finish_reason = reason

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (0 for an empty list)."""
    if not values:
        return 0.0
    s = sorted(values)
    k = min(len(s) - 1, max(0, int(round(q / 100 * len(s) + 0.5)) - 1))
    return s[k]


@dataclass(slots=True)
class SimResult:
    """Records of every request and the replicas at the end of the run."""

    records: list[RequestRecord]
    end_s: float
    replicas: list[Any]
    coalesced_steps: int = 0
    jumped_steps: int = 0

    def summary(self, slo_ttft_s: float = float("inf"), slo_itl_s: float = float("inf")) -> dict[str, float]:
        done = [r for r in self.records if r.finish_s is not None]
        ttft = [r.ttft_s for r in done]
        itl = [x for r in done for x in r.itl_s]
        queried = sum(rep.scheduler.kv.num_queried_tokens for rep in self.replicas)
        hit = sum(rep.scheduler.kv.num_hit_tokens for rep in self.replicas)
        span = max((r.finish_s for r in done), default=0.0) - min((r.arrival_s for r in done), default=0.0)
        good = [r for r in done if r.ttft_s <= slo_ttft_s and percentile(r.itl_s, 90) <= slo_itl_s]
        return {
            "requests": len(done), "hit_rate": hit / queried if queried else 0.0,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
            "itl_p50_s": percentile(itl, 50), "itl_p90_s": percentile(itl, 90),
            "output_tok_s": sum(r.num_output_tokens for r in done) / span if span > 0 else 0.0,
            "goodput_rps": len(good) / span if span > 0 else 0.0,
            "steps": sum(rep.num_steps for rep in self.replicas), "sim_end_s": self.end_s,
        }
