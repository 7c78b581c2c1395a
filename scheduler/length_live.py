"""The length predictor of a served replica: the hidden-state probe once warm, the feature groups
before and beside it.

The runner hands the scheduler each prompt's final hidden state at its last token, projected to
`dim` floats (workers/length_features.py, ModelRunnerOutput.length_features), in the step that
ends the prompt; the scheduler keeps it on the request (`take_feature`). From then on the request
is predicted by the probe (scheduler/length_probe.py, ridge on log length, learned online from
every finished request that carried a feature) as soon as the probe has seen `min_samples` of
them; until then, and for a request without a feature (still waiting for its prefill), by the
feature groups of scheduler/length_prediction.py, which learn from every finished request.

A feature that is not `dim` finite floats of modest size is dropped on arrival, and a probe that
fails or answers something not finite is logged and passed over for the groups: a broken probe
costs its accuracy, never a request. Deterministic: no randomness here (the projection's seed is
the runner's); the same features and lengths in the same order give the same answers. Memory:
the groups' bound plus the probe's O(dim^2 + window) floats.
"""

from __future__ import annotations

import logging
import math

from scheduler.config import SchedulerConfig
from scheduler.length_prediction import (
    LengthEstimate,
    LengthFeatures,
    LengthPredictor,
    PredictorConfig,
)
from scheduler.length_probe import HiddenStateProbe, ProbeConfig
from scheduler.request import Request, RequestStatus

logger = logging.getLogger(__name__)

# The runner sends unit-length states times a matrix of scale 1/sqrt(dim): entries of order one.
# Anything far larger did not come from it, and would only swamp the regression.
MAX_FEATURE_ABS = 1e3
_LEARNS_FROM = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


def valid_feature(vector: object, dim: int) -> list[float] | None:
    """vector as `dim` finite floats within MAX_FEATURE_ABS, else None."""
    if not isinstance(vector, list) or len(vector) != dim:
        return None
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in vector):
        return None
    values = [float(v) for v in vector]
    if not all(math.isfinite(v) and abs(v) <= MAX_FEATURE_ABS for v in values):
        return None
    return values


class LivePredictor:
    """A RemainingLength: the hidden-state probe for requests with a feature once it is warm, the
    feature groups otherwise. dim None: no probe (the groups alone, e.g. persisted)."""

    def __init__(
        self,
        dim: int | None,
        groups: PredictorConfig | None = None,
        probe: ProbeConfig | None = None,
    ) -> None:
        self.dim = dim
        self.groups = LengthPredictor(groups)
        self.probe = HiddenStateProbe(dim, probe, project=False) if dim else None
        self.num_observed = 0  # finished requests learned from (the groups')
        self.num_probe_answers = 0  # predictions the probe gave (the rest came from the groups)
        self.num_features_dropped = 0  # features refused on arrival
        self._warned = False

    def take_feature(self, request: Request, vector: object) -> None:
        """Keep a request's feature, the first that arrives (a recomputed preemption's prefill
        ends at an output, and the runner sends none for it); an invalid one is dropped."""
        if self.dim is None or request.length_feature is not None:
            return
        feature = valid_feature(vector, self.dim)
        if feature is None:
            self.num_features_dropped += 1
            return
        request.length_feature = feature

    def predict_request(self, request: Request) -> LengthEstimate | None:
        estimate = self._probe_estimate(request)
        if estimate is not None:
            self.num_probe_answers += 1
            return estimate
        return self.groups.predict_request(request)

    def _probe_estimate(self, request: Request) -> LengthEstimate | None:
        feature = request.length_feature
        if self.probe is None or feature is None:
            return None
        try:
            estimate = self.probe.predict(
                feature, request.sampling_params.max_tokens, request.num_output_tokens
            )
        except Exception:
            self._warn("length probe failed to predict; using the feature groups")
            return None
        if estimate is None or not (
            math.isfinite(estimate.median) and math.isfinite(estimate.upper)
        ):
            return None
        return estimate

    def observe_request(self, request: Request) -> None:
        """Learn from a finished request; an aborted or failed one (cut short) teaches nothing."""
        if request.status not in _LEARNS_FROM:
            return
        n = request.num_output_tokens
        self.groups.observe(LengthFeatures.of(request), n)
        self.num_observed += 1
        if self.probe is not None and request.length_feature is not None:
            try:
                self.probe.observe(request.length_feature, n)
            except Exception:
                self._warn("length probe failed to learn; it keeps what it had")

    @property
    def probe_warm(self) -> bool:
        p = self.probe
        return p is not None and p.num_observed >= p.config.min_samples

    def _warn(self, message: str) -> None:
        # Once per predictor: a probe that fails, fails on every request.
        if not self._warned:
            self._warned = True
            logger.exception(message)


def make_live_predictor(config: SchedulerConfig) -> LivePredictor | None:
    """The predictor for a SchedulerConfig: with the probe when uses_length_probe, the groups
    alone when only persisted; None (the defaults' own LengthPredictor) otherwise."""
    if config.uses_length_probe:
        return LivePredictor(config.length_feature_dim)
    if config.length_predictor_state_path is not None:
        return LivePredictor(None)
    return None
