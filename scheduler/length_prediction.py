"""Output-length prediction: how many tokens a request has left to generate, as a distribution.

The predictor learns online from finished requests. It keeps the last `window` output lengths of
each group of requests alike in cheap features (structured-output kind, chat or completion,
tenant, prompt length and max_tokens by powers of two) and answers with quantiles of the lengths
seen in the finest group that has enough of them, conditioned on what the request has generated
so far: given g tokens out, it looks only at the lengths above g and returns quantiles of their
remainders. Coarser groups back the finer ones up; with nothing observed at all it answers None,
and a queue policy treats None as "no information" (FCFS order).

Pure Python and deterministic: the same observations in the same order give the same answers (no
randomness, so no seed is needed). Memory is bounded by max_groups x window lengths.

A learned probe on the model's hidden state at the prompt's last token (issue 35) is in
scheduler/length_probe.py; scheduler/length_live.py puts it in front of these groups for a served
replica.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from scheduler.request import Request, RequestStatus
from settings import check_settings, setting

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LengthFeatures:
    """What is known of a request before it generates: the predictor's inputs."""

    prompt_len: int
    max_tokens: int
    tenant: str = "default"
    structured: str = ""  # the structured-output kind, "" for free text
    chat: bool = False  # a chat completion (the scheduler cannot tell: False there)

    @classmethod
    def of(cls, request: Request) -> LengthFeatures:
        params = request.sampling_params
        kind = params.structured.kind if params.structured is not None else ""
        return cls(request.num_prompt_tokens, params.max_tokens, request.tenant, kind)

    def groups(self) -> tuple[tuple[object, ...], ...]:
        """The feature groups this request belongs to, coarsest first."""
        kind = (self.structured, self.chat)
        tenant = (*kind, self.tenant)
        return (
            (),
            kind,
            tenant,
            (*tenant, _octave(self.prompt_len), _octave(self.max_tokens)),
        )


def _octave(n: int) -> int:
    """n by powers of two (0 for n < 1): lengths within 2x of each other share a group."""
    return max(0, int(n).bit_length())


@dataclass(frozen=True, slots=True)
class LengthEstimate:
    """Remaining output tokens: the median and the upper quantile."""

    median: float
    upper: float


class RemainingLength(Protocol):
    """What a queue policy asks of a predictor (the simulator's oracle answers it too)."""

    def predict_request(self, request: Request) -> LengthEstimate | None: ...

    def observe_request(self, request: Request) -> None: ...


@dataclass(slots=True)
class PredictorConfig:
    """Settings of the output-length predictor."""

    quantile: float = setting(
        0.9, "the upper quantile of remaining length it reports", gt=0.5, lt=1
    )
    window: int = setting(64, "finished lengths kept per feature group (the newest)", ge=1, le=4096)
    max_groups: int = setting(
        4096, "feature groups kept, least recently used dropped", ge=4, le=1 << 20
    )
    min_samples: int = setting(
        8, "lengths a group needs (above the tokens generated) before it is used", ge=1, le=4096
    )

    def __post_init__(self) -> None:
        check_settings(self)


class LengthPredictor:
    """Quantiles of finished requests' output lengths, by feature group with backoff."""

    def __init__(self, config: PredictorConfig | None = None) -> None:
        self.config = config or PredictorConfig()
        self._groups: OrderedDict[tuple[object, ...], deque[int]] = OrderedDict()
        self.num_observed = 0

    def observe(self, features: LengthFeatures, output_len: int) -> None:
        """A request with these features finished after output_len tokens."""
        if output_len < 1:
            return
        cfg = self.config
        for key in features.groups():
            lengths = self._groups.get(key)
            if lengths is None:
                lengths = self._groups[key] = deque(maxlen=cfg.window)
            else:
                self._groups.move_to_end(key)
            lengths.append(int(output_len))
        while len(self._groups) > cfg.max_groups:
            self._groups.popitem(last=False)
        self.num_observed += 1

    def predict(self, features: LengthFeatures, generated: int = 0) -> LengthEstimate | None:
        """Remaining output tokens of a request with these features that has generated so many;
        None before anything was observed."""
        if not self.num_observed:
            return None
        cfg = self.config
        left = max(1, features.max_tokens - generated)
        # The finest group with enough lengths above generated; the coarsest if none has.
        found: list[int] = []
        for key in features.groups():
            lengths = self._groups.get(key)
            if lengths is None:
                continue
            longer = [n - generated for n in lengths if n > generated]
            if not found or len(longer) >= cfg.min_samples:
                found = longer
        if not found:
            # Past every length seen: expect as many again as it has made (a heavy tail's rule).
            guess = float(max(generated, 1))
            return LengthEstimate(min(guess, left), min(2 * guess, left))
        found.sort()
        return LengthEstimate(
            min(_quantile(found, 0.5), left), min(_quantile(found, cfg.quantile), left)
        )

    def predict_request(self, request: Request) -> LengthEstimate | None:
        return self.predict(LengthFeatures.of(request), request.num_output_tokens)

    def observe_request(self, request: Request) -> None:
        """Learn from a finished request; an aborted or failed one (cut short) teaches nothing."""
        if request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED):
            self.observe(LengthFeatures.of(request), request.num_output_tokens)

    def state(self) -> dict[str, object]:
        """What it has learned, as plain lists (scheduler/length_state.py saves it)."""
        groups = [[list(key), list(lengths)] for key, lengths in self._groups.items()]
        return {"groups": groups, "num_observed": self.num_observed}

    def load_state(self, state: dict[str, object]) -> None:
        """Take over a state(), trimmed to this config's window and max_groups; ValueError
        (nothing changed) when it is malformed."""
        items, num = state.get("groups"), state.get("num_observed")
        if not (isinstance(items, list) and isinstance(num, int) and num >= 0):
            raise ValueError("length predictor state: groups or num_observed malformed")
        cfg = self.config
        groups: OrderedDict[tuple[object, ...], deque[int]] = OrderedDict()
        for item in items[-cfg.max_groups :]:
            key, lengths = item if isinstance(item, list) and len(item) == 2 else (None, None)
            if not (isinstance(key, list) and len(key) <= 5 and isinstance(lengths, list)):
                raise ValueError("length predictor state: a group is malformed")
            if not all(isinstance(k, str | int) for k in key):
                raise ValueError("length predictor state: a group key is malformed")
            if not all(type(n) is int and n >= 1 for n in lengths):
                raise ValueError("length predictor state: lengths must be integers >= 1")
            groups[tuple(key)] = deque(lengths[-cfg.window :], maxlen=cfg.window)
        self._groups, self.num_observed = groups, num

    def num_lengths(self) -> int:
        """Lengths held in all: at most max_groups x window."""
        return sum(len(q) for q in self._groups.values())


def _quantile(ordered: Sequence[float], q: float) -> float:
    """The q-quantile of sorted values, by the nearest rank (always one of the values)."""
    return float(ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))])


def safe_predict(model: RemainingLength | None, request: Request) -> LengthEstimate | None:
    """The model's estimate, or None if it has none or fails: a broken predictor costs its
    ordering, never the request."""
    if model is None:
        return None
    try:
        estimate = model.predict_request(request)
    except Exception:
        logger.exception("length prediction failed for %s; ordering it FCFS", request.request_id)
        return None
    if estimate is None or not (math.isfinite(estimate.median) and estimate.median >= 0):
        return None
    return estimate


def safe_observe(model: RemainingLength | None, request: Request) -> None:
    """Teach the model a finished request; a failure is logged, never raised."""
    if model is None:
        return
    try:
        model.observe_request(request)
    except Exception:
        logger.exception("length predictor failed to learn from %s", request.request_id)
