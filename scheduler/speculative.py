"""Speculative decoding: its settings, and how many proposed tokens each request may verify.

The runner proposes (workers/proposer.py) and verifies (workers/spec_verify.py); the scheduler
decides how many of a request's proposed tokens run in a step, counts them in the token budget,
allocates their KV slots and gives back the slots of rejected ones (scheduler/features_spec.py).
`SpecPolicy` here is the adaptive part: a pure object, so the simulator can run it unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from settings import check_settings, setting

SPEC_METHODS = ("ngram", "draft", "mtp")
MAX_SPEC_TOKENS = 16  # verifying more per step costs more than even a perfect run gains on CPU
MAX_NGRAM = 64
MAX_DRAFT_MODEL_CHARS = 4096
MAX_SPEC_BATCH = 1 << 16  # more running requests than any replica holds
# Acceptance estimate: the mean of a request's first observed verify steps (and shadow proposals
# checked against the tokens decoded without speculation), then an exponential average of weight
# _EMA_WEIGHT. Before any observation it is 1.0, so each request gets tried; the first verify step
# then replaces that guess outright. Starting the average at 1.0 instead took three verify steps
# that accepted nothing to pass under min_acceptance_rate 0.4: the sampled chat workload, where
# nothing is accepted, lost 4% to them (bench/results/2026-11-29-cpu-layer-driver.md).
_EMA_WEIGHT = 0.3


@dataclass(slots=True)
class SpeculativeConfig:
    """`speculative:` in the engine settings; unset (the default) decodes one token per step."""

    method: str = setting(
        "ngram",
        "how tokens are proposed: `ngram` (prompt lookup), `draft` (a smaller model with the "
        "same tokenizer, `draft_model`) or `mtp` (the checkpoint's multi-token-prediction "
        "layer: DeepSeek-V3's num_nextn_predict_layers, docs/mla.md)",
        choices=SPEC_METHODS,
    )
    num_tokens: int = setting(4, "tokens proposed and verified per step", ge=1, le=MAX_SPEC_TOKENS)
    max_num_tokens: int = setting(
        0,
        "ngram: adaptive length; above num_tokens, a request whose verify step accepted every "
        "proposed token may verify num_tokens more the next step, up to this; one rejected "
        "token sends it back to num_tokens (0: always num_tokens)",
        ge=0,
        le=MAX_SPEC_TOKENS,
    )
    ngram_min: int = setting(2, "ngram: shortest suffix matched", ge=1, le=MAX_NGRAM)
    ngram_max: int = setting(4, "ngram: longest suffix matched (tried first)", ge=1, le=MAX_NGRAM)
    draft_model: str | None = setting(
        None,
        "draft: the draft model (`default`, an HF directory or a `.gguf` file) with the model's "
        "vocabulary and tokenizer; it runs on rank 0 only",
        path=True,
    )
    max_batch_size: int = setting(
        4,
        "no speculation in a step whose running batch is larger: a large batch has no idle "
        "compute to spend (on CPU, past about 4 requests; a GPU has room for more)",
        ge=1,
        le=MAX_SPEC_BATCH,
    )
    min_acceptance_rate: float = setting(
        0.4,
        "a request speculates only while its recent share of accepted proposed tokens is at "
        "least this (its proposals are still checked against what it decodes, so it resumes)",
        ge=0,
        le=1,
    )

    def __post_init__(self) -> None:
        check_settings(self)
        if self.ngram_min > self.ngram_max:
            raise ValueError(
                f"ngram_min: must be <= ngram_max={self.ngram_max}, got {self.ngram_min}"
            )
        self._check_max_num_tokens()
        path = self.draft_model
        if self.method == "draft" and path is None:
            raise ValueError("draft_model: method 'draft' needs a draft model")
        if self.method != "draft" and path is not None:
            raise ValueError(f"draft_model: only with method 'draft', not {self.method!r}")

    def _check_max_num_tokens(self) -> None:
        top = self.max_num_tokens
        if top and top < self.num_tokens:
            raise ValueError(
                f"max_num_tokens: must be 0 or >= num_tokens={self.num_tokens}, got {top}"
            )
        if top and self.method != "ngram":
            # A draft model or MTP layer runs one forward per proposed token: its length is fixed.
            raise ValueError(f"max_num_tokens: only with method 'ngram', not {self.method!r}")

    @property
    def proposal_length(self) -> int:
        """The most tokens a request may propose and verify in a step."""
        return max(self.num_tokens, self.max_num_tokens)


@dataclass(slots=True)
class _Acceptance:
    rate: float = 1.0  # recent share of proposed tokens accepted
    observed: int = 0  # verify steps and shadow checks counted in `rate`
    shadow: list[int] = field(default_factory=list)  # a proposal not run, checked as tokens come
    shadow_at: int = 0  # the request's token count when `shadow` was proposed
    k: int = 0  # proposed tokens it may verify next (max_num_tokens); 0: num_tokens


class SpecPolicy:
    """How many proposed tokens each request verifies: fewer when the batch is large, none for a
    request whose recent proposals were mostly rejected.

    A request that does not speculate keeps a "shadow" proposal, compared with the tokens it then
    decodes one by one: its estimate keeps moving at no cost, and it speculates again as soon as
    its output turns repetitive.
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._by_req: dict[str, _Acceptance] = {}

    def num_tokens(self, req_id: str, batch_size: int) -> int:
        """Proposed tokens req_id may verify in a step of batch_size running requests."""
        cfg = self.config
        if batch_size > cfg.max_batch_size:
            return 0
        acc = self._by_req.get(req_id)
        if acc is not None and acc.rate < cfg.min_acceptance_rate:
            return 0
        return acc.k if acc is not None and acc.k else cfg.num_tokens

    def observe(self, req_id: str, num_proposed: int, num_accepted: int) -> None:
        """A verify step of req_id accepted num_accepted of num_proposed tokens."""
        if num_proposed <= 0:
            return
        acc = self._by_req.setdefault(req_id, _Acceptance())
        acc.observed += 1
        weight = max(_EMA_WEIGHT, 1 / acc.observed)  # a plain mean until the average takes over
        acc.rate += weight * (num_accepted / num_proposed - acc.rate)
        acc.shadow = []
        cfg = self.config
        if cfg.max_num_tokens:  # a copied run goes on: verify more of it per step, until a miss
            grown = min(max(acc.k, cfg.num_tokens) + cfg.num_tokens, cfg.max_num_tokens)
            acc.k = grown if num_accepted >= num_proposed else cfg.num_tokens

    def shadow(self, req_id: str, proposal: list[int], num_tokens: int) -> None:
        """Keep a proposal that will not run (made when the request held num_tokens tokens), unless
        an earlier one is still being checked."""
        acc = self._by_req.setdefault(req_id, _Acceptance())
        if not acc.shadow and proposal:  # judged at the length it would verify
            acc.shadow, acc.shadow_at = proposal[: acc.k or self.config.num_tokens], num_tokens

    def check_shadow(self, req_id: str, token_ids: list[int]) -> None:
        """Compare req_id's shadow proposal with the tokens decoded since (token_ids: all of them);
        once it is decided, it counts as a verify step would have."""
        acc = self._by_req.get(req_id)
        if acc is None or not acc.shadow:
            return
        decoded = token_ids[acc.shadow_at :]
        shadow = acc.shadow
        accepted = 0
        for proposed, actual in zip(shadow, decoded):
            if proposed != actual:
                break
            accepted += 1
        if accepted < len(shadow) and accepted == len(decoded):
            return  # every decoded token matched so far: wait for the next
        self.observe(req_id, len(shadow), accepted)

    def drop(self, req_id: str) -> None:
        self._by_req.pop(req_id, None)

    def rate(self, req_id: str) -> float:
        acc = self._by_req.get(req_id)
        return 1.0 if acc is None else acc.rate
