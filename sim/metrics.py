"""Per-request timings and the fleet figures derived from them."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from itertools import repeat
from operator import mul

from sim.replica import SimReplica

# Inter-token gaps are tallied in 10-microsecond bins for the fleet percentiles: few enough
# distinct keys that the tally stays small and cache-resident over millions of requests.
_BINS_PER_S = 1e5


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
    itl_s: list[float] = field(
        default_factory=list
    )  # emptied at the finish unless the run keeps them
    itl_p90_s: float = 0.0  # this request's ITL p90, set at its finish

    def on_tokens(self, now: float, n: int, cached: int) -> float | None:
        """Tokens sampled at now; returns the inter-token gap this adds, if any."""
        if n == 0:
            return None
        gap = None
        last = self.last_token_s  # set with first_token_s, so None until the first token
        if last is None:
            self.first_token_s = now
            self.cached_tokens = cached
        else:
            gap = now - last
            self.itl_s.append(gap)
        self.last_token_s = now
        return gap

    def on_token_run(self, times: list[float], gaps: list[float], cached: int) -> float | None:
        """One token at each of these times (a jumped stretch): on_tokens for each, in bulk.

        gaps[i] is times[i + 1] - times[i], computed once for every request of the stretch. Returns
        the gap before the stretch's first token (None if that token is the request's first).
        """
        lead = self.on_tokens(times[0], 1, cached)
        self.itl_s.extend(gaps)
        self.last_token_s = times[-1]
        return lead

    def finish(
        self, now: float, num_output_tokens: int, reason: str | None, keep_itl: bool = True
    ) -> None:
        """Record the finish and this request's ITL p90; drop its gaps unless keep_itl."""
        self.finish_s = now
        self.num_output_tokens = num_output_tokens
        self.finish_reason = reason
        self.itl_p90_s = percentile(self.itl_s, 90)
        if not keep_itl:
            self.itl_s = []

    @property
    def ttft_s(self) -> float:
        if self.first_token_s is None:
            raise ValueError(f"request {self.request_id!r}: no first token yet, so no TTFT")
        return self.first_token_s - self.arrival_s


def nearest_rank(n: int, q: float) -> int:
    """0-based index of the q-th percentile among n sorted values (nearest rank); n > 0."""
    return min(n - 1, max(0, round(q / 100 * n + 0.5) - 1))


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (0 for an empty list)."""
    if not values:
        return 0.0
    return sorted(values)[nearest_rank(len(values), q)]


class GapTally(Counter):
    """The fleet's inter-token gaps in 10-microsecond bins -> count, for its ITL percentiles.

    Gaps are counted as they happen, and a jumped stretch's gaps, which every request of the
    stretch shares, once for all of them: counting each request's gaps at its finish read every
    gap again from wherever it lay in memory. The gaps of requests a run leaves unfinished are
    taken back at its end (`discount`), so the tally holds finished requests' gaps only.
    """

    def add(self, gap: float) -> None:
        self[int(gap * _BINS_PER_S)] += 1

    def add_shared(self, gaps: list[float], requests: int) -> None:
        """gaps, once for each of `requests` requests."""
        # A stretch's step times grow by more than a bin per step, so its gaps mostly fall in
        # distinct bins: counting them first would only add a Counter per jump.
        for value in map(int, map(mul, gaps, repeat(_BINS_PER_S))):
            self[value] += requests

    def discount(self, unfinished: list[RequestRecord]) -> None:
        """Take back the gaps of requests still in flight (their records keep them until they
        finish)."""
        for record in unfinished:
            self.subtract(map(int, map(mul, record.itl_s, repeat(_BINS_PER_S))))
        for value in [v for v, count in self.items() if count <= 0]:
            del self[value]


def tally_percentile(tally: Counter[int], q: float) -> float:
    """percentile() of the gaps a tally counts, in seconds, to the bin's lower edge (0 for an empty
    tally)."""
    total = sum(tally.values())
    if not total:
        return 0.0
    k = nearest_rank(total, q)
    seen = 0
    for value in sorted(tally):
        seen += tally[value]
        if seen > k:
            return value / _BINS_PER_S
    raise AssertionError("unreachable: k < total")


@dataclass(slots=True)
class SimResult:
    """Records of every request and the replicas at the end of the run."""

    records: list[RequestRecord]
    end_s: float
    replicas: list[SimReplica]
    coalesced_steps: int = 0
    jumped_steps: int = 0
    itl_tally: Counter[int] = field(
        default_factory=Counter
    )  # finished requests' gaps (10 us bins) -> count

    def summary(
        self, slo_ttft_s: float = float("inf"), slo_itl_s: float = float("inf")
    ) -> dict[str, float]:
        done = [r for r in self.records if r.finish_s is not None]
        ttft = [r.ttft_s for r in done]
        queried = sum(rep.scheduler.kv.num_queried_tokens for rep in self.replicas)
        hit = sum(rep.scheduler.kv.num_hit_tokens for rep in self.replicas)
        finishes = [r.finish_s for r in done if r.finish_s is not None]
        span = max(finishes, default=0.0) - min((r.arrival_s for r in done), default=0.0)
        good = [r for r in done if r.ttft_s <= slo_ttft_s and r.itl_p90_s <= slo_itl_s]
        return {
            "requests": len(done),
            "hit_rate": hit / queried if queried else 0.0,
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_p90_s": percentile(ttft, 90),
            "itl_p50_s": tally_percentile(self.itl_tally, 50),
            "itl_p90_s": tally_percentile(self.itl_tally, 90),
            "output_tok_s": sum(r.num_output_tokens for r in done) / span if span > 0 else 0.0,
            "goodput_rps": len(good) / span if span > 0 else 0.0,
            "steps": sum(rep.num_steps for rep in self.replicas),
            "sim_end_s": self.end_s,
        }
