"""Speculative decoding in the simulator: the production Scheduler with its SpecDecoding feature
(the token budget, KV accounting and SpecPolicy rules) with a stand-in proposer and verifier, and
the step cost of k + 1 query tokens per verifying request.

The stand-in proposes `num_tokens` tokens after every token a request samples. How many of them
the target would accept is drawn when the proposal is made, from `AcceptanceConfig.probs` (the
probability of each accepted length 0..k, an input measured on real runs), and written into the
proposal: that many copies of the token the stand-in target always samples, then a token it never
samples. Verification is then exact, as greedy verification is: a verify step accepts the
proposal's matching prefix (of the drafts the scheduler let run) plus one token of its own. A
request that does not speculate (SpecPolicy: a large batch, a low acceptance rate) keeps its
proposal as a shadow, which the scheduler checks against what it then decodes, so its acceptance
estimate keeps moving as in production.

The cost: a verify row is a decode with k more query tokens. On a GPU the engine replays CUDA
graphs for pure-decode steps only (workers/runner.py), so a step that verifies runs eagerly and
pays the profile's eager-step costs, as a prefill step does (`verify_graphs=False`, the engine
as it is); `verify_graphs=True` prices a verify-only step as a decode step of that many tokens
(what capturing verify graphs would buy).
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass, field

from scheduler import ModelRunnerOutput, RequestOutput, SchedulerConfig, SchedulerOutput
from scheduler.features import StepFeature
from scheduler.features_spec import SpecDecoding
from scheduler.speculative import SpeculativeConfig
from sim.cost import CostModel
from sim.replica import EOS, TOKEN, Cruise, SimReplica, StepPlan, step_shape

MISS = 2  # a proposed token the stand-in target never samples: the end of an accepted run


@dataclass(frozen=True, slots=True)
class AcceptanceConfig:
    """probs[a]: the probability that a proposal's first a tokens are accepted and its next is not
    (the last entry: all of them). Normalised; a proposal of k tokens with a longer distribution
    keeps its first k + 1 entries, the rest folded into the last."""

    probs: tuple[float, ...] = (0.2, 0.2, 0.2, 0.2, 0.2)
    seed: int = 0

    def __post_init__(self) -> None:
        p = self.probs
        if not 2 <= len(p) <= 65 or any(
            isinstance(x, bool) or not (isinstance(x, (int, float)) and 0 <= x < math.inf)
            for x in p
        ):
            raise ValueError(
                f"probs: need 2 to 65 finite probabilities >= 0 (accepted lengths 0..k), got {p!r}"
            )
        if not sum(p) > 0:
            raise ValueError(f"probs: must not all be 0, got {p!r}")

    @classmethod
    def per_token(cls, rate: float, num_tokens: int, seed: int = 0) -> AcceptanceConfig:
        """Each proposed token accepted with probability `rate` until the first rejection."""
        if not 0 <= rate <= 1:
            raise ValueError(f"rate: must be in [0, 1], got {rate!r}")
        probs = [rate**a * (1 - rate) for a in range(num_tokens)] + [rate**num_tokens]
        return cls(tuple(probs), seed)

    def mean_accepted(self, num_tokens: int) -> float:
        cum = self._cum(num_tokens)
        return sum(a * (cum[a] - (cum[a - 1] if a else 0.0)) for a in range(len(cum))) / cum[-1]

    def _cum(self, num_tokens: int) -> list[float]:
        probs = list(self.probs[: num_tokens + 1])
        probs[-1] += sum(self.probs[num_tokens + 1 :])
        out, total = [], 0.0
        for x in probs:
            total += x
            out.append(total)
        return out


@dataclass(slots=True)
class SpecSimConfig:
    """Speculation on every replica: the engine's setting, the acceptance, and the verify cost."""

    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    acceptance: AcceptanceConfig = field(default_factory=AcceptanceConfig)
    verify_graphs: bool = False


class SpecSimReplica(SimReplica):
    """A replica whose scheduler speculates, with the stand-in proposer and verifier above."""

    def __init__(
        self,
        name: str,
        config: SchedulerConfig,
        cost: CostModel,
        max_tokens: int,
        spec: SpecSimConfig,
    ):
        self.spec = spec  # read by step_features, which __init__ calls
        super().__init__(name, config, cost, max_tokens)
        self._k = spec.speculative.num_tokens
        self._cum = spec.acceptance._cum(self._k)
        self._rng = random.Random(f"{spec.acceptance.seed}:{name}")

    def step_features(self) -> list[StepFeature]:
        return [SpecDecoding(self.spec.speculative)]

    def plan_cruise(self, now: float, horizon_s: float, min_steps: int = 2) -> Cruise | None:
        return None  # a jump decodes one token a step; speculation is stepped singly

    def propose(self) -> list[int]:
        """k proposed tokens, the first `accepted` of which the stand-in target will sample."""
        u = self._rng.random() * self._cum[-1]
        accepted = bisect.bisect_right(self._cum, u)
        accepted = min(accepted, self._k)
        return [TOKEN] * accepted + [MISS] * (self._k - accepted)

    def step_seconds(self, out: SchedulerOutput) -> float:
        spec = out.scheduled_spec_tokens
        if not spec:
            return super().step_seconds(out)
        prefill, decode, kv_read, pairs = step_shape(out, self.scheduler.requests)
        drafts = sum(len(d) for d in spec.values())
        rows = len(spec)
        seqs = len(out.num_scheduled_tokens)
        prompt = prefill - drafts - rows  # prompt tokens beside the verify rows
        if self.spec.verify_graphs and not prompt:
            return self.cost.step_time(0, prefill + decode, kv_read, seqs)
        # Eager: the verify rows' extra tokens count as prefill tokens, the rows as decodes (they
        # pay no per-prefilling-sequence cost), their attention pairs as prefill attention.
        return self.cost.step_time(prefill - rows, decode + rows, kv_read, seqs, pairs)

    def finish_step(self) -> list[RequestOutput]:
        plan, self.in_flight = self.in_flight, None
        assert isinstance(plan, StepPlan)
        out = plan.output
        requests, spec = self.scheduler.requests, out.scheduled_spec_tokens
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        proposals: list[list[int]] = []
        for rid in out.num_scheduled_tokens:
            req = requests.get(rid)
            req_ids.append(rid)
            if req is None or req.num_computed_tokens < req.num_tokens:
                sampled.append([])  # partial prefill: nothing sampled, nothing proposed
                proposals.append([])
                continue
            drafts = spec.get(rid, ())
            accepted = next((i for i, t in enumerate(drafts) if t != TOKEN), len(drafts))
            left = self.output_len[rid] - req.num_output_tokens
            n = min(accepted + 1, left)
            sampled.append([TOKEN] * (n - 1) + [EOS if n == left else TOKEN])
            proposals.append(self.propose())
        outputs = self.scheduler.update_from_output(
            out, ModelRunnerOutput(req_ids, sampled, spec_token_ids=proposals)
        )
        self._forget_finished(outputs)
        return outputs
