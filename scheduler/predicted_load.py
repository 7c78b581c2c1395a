"""A replica's predicted remaining work, for the fleet router's `load_signal: predicted_tokens`.

The sum over its waiting and running requests of the length predictor's median remaining output
(capped by what max_tokens still allows), and how many requests had an estimate: the router counts
the others as one per-request estimate each, and with no estimate at all (a cold predictor) it
keeps counting requests. Computed only when a replica reports (about once a second), never per
step: it asks the predictor once per request.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from scheduler.length_prediction import RemainingLength, safe_predict
from scheduler.request import Request


@dataclass(frozen=True, slots=True)
class PredictedLoad:
    """Predicted remaining output tokens of the requests that had an estimate, and their count."""

    tokens: int
    requests: int


def predicted_load(requests: Iterable[Request], model: RemainingLength | None) -> PredictedLoad:
    tokens = counted = 0
    for req in requests:
        estimate = safe_predict(model, req)
        if estimate is None:
            continue
        left = max(0, req.sampling_params.max_tokens - req.num_output_tokens)
        tokens += round(min(estimate.median, left))
        counted += 1
    return PredictedLoad(tokens, counted)
