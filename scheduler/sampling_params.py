"""Per-request generation parameters, validated where they are built.

Every field is bounded: a value that passes here can never fail a batch (huge top_k, seeds past
2^63, NaN temperatures, thousands of stop strings all stop at this door with the field named).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from scheduler.structured_output import StructuredOutput
from settings import shown as _shown

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 4
MAX_STOP_TOKEN_IDS = 64
MAX_SEED = 2**63  # exclusive: a torch.Generator seed is a signed 64-bit integer
MAX_TOKEN_ID = 2**31 - 1  # vocabularies are far smaller; the engine checks against the real one
MAX_TOKENS = 2**31 - 1  # positions are 32-bit; the engine checks against max_model_len
MAX_N = 128
MAX_LOGIT_BIAS = 300
# Banned words (vLLM's bad_words): each word is checked against every row's outputs at every
# step, so their number and length are bounded; a word becomes one or two token sequences.
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256
MAX_BAD_WORD_TOKENS = 256
# OpenAI's range (vLLM's too). A smaller positive temperature is greedy: dividing float32 logits
# by it would overflow them (1e-46 is 0 in float32).
MAX_TEMPERATURE = 2.0
MIN_TEMPERATURE = 1e-5
# Positive logits are divided by the penalty and negative ones multiplied: within [1/100, 100]
# float32 logits stay finite (a penalty that rounds to 0 in float32 would make them inf or NaN).
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
# How an embedding request pools the final hidden states of its prompt.
POOLINGS = ("last", "mean")


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field_name}: {message}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past the float range
        return False


# The float fields: each must be a finite number before its range is checked.
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. Every bound of a request's sampling fields is here;
    the HTTP schema only parses and hands the values over."""

    max_tokens: int = 16
    # In [0, MAX_TEMPERATURE]; below MIN_TEMPERATURE (0 included) the pick is greedy.
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # top-N logprobs per sampled token (0: only the sampled one)
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # applied on text by the detokenizing frontends
    n: int = 1  # parallel samples: the frontends fan a request out into n engine requests
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    structured: StructuredOutput | None = None  # the output must match this constraint
    # EOS and stop_token_ids cannot be sampled before this many outputs (vLLM's min_tokens).
    min_tokens: int = 0
    # Words that must never complete in the output: the frontend encodes each into token
    # sequences (bad_words_token_ids), whose last token the sampler masks when the outputs end
    # with the rest of the sequence.
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # keep the stop string (or stop token's text)
    skip_special_tokens: bool = True  # detokenization drops special tokens' text
    spaces_between_special_tokens: bool = True  # passed to the tokenizer's decode
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens
    # An embedding request: the prompt's final hidden states pooled ("last" token or "mean"),
    # returned with the one token the request samples (RequestOutput.pooled).
    pooling: str | None = None
    # The log-probability of each prompt token after the first, plus this many alternatives
    # (computed in the prefill; such a request does not reuse cached prompt blocks).
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        self._check_numbers()
        self._check_lists()
        self._check_extensions()
        self._check_pooling()

    def _check_pooling(self) -> None:
        if self.pooling is None:
            return
        _check(
            self.pooling in POOLINGS,
            "pooling",
            f"must be one of {list(POOLINGS)}, got {_shown(self.pooling)}",
        )
        _check(
            self.max_tokens == 1 and self.structured is None and self.logprobs is None,
            "pooling",
            "an embedding request samples one token, with no constraint and no logprobs",
        )

    def _check_numbers(self) -> None:
        self._check_finite()
        self._check_ranges()
        self._check_penalties()
        self._check_counts()
        self._check_constraint_flags()

    def _check_finite(self) -> None:
        """max_tokens an integer in range, and every float field a finite number (NaN and the
        infinities would pass or fail the range checks by accident)."""
        _check(
            _is_int(self.max_tokens) and 1 <= self.max_tokens <= MAX_TOKENS,
            "max_tokens",
            f"must be an integer in [1, 2^31), got {_shown(self.max_tokens)}",
        )
        for name in _FLOAT_FIELDS:
            _check(
                _is_number(getattr(self, name)),
                name,
                f"must be a finite number, got {_shown(getattr(self, name))}",
            )

    def _check_ranges(self) -> None:
        _check(
            0.0 <= self.temperature <= MAX_TEMPERATURE,
            "temperature",
            f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}",
        )
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(
            _is_int(self.top_k) and -1 <= self.top_k <= MAX_TOKEN_ID,
            "top_k",
            f"must be -1, 0 (off) or a vocabulary-sized k >= 1, got {_shown(self.top_k)}",
        )
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        if self.top_k == -1:
            self.top_k = 0

    def _check_penalties(self) -> None:
        _check(
            MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
            "repetition_penalty",
            f"must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}], "
            f"got {self.repetition_penalty}",
        )
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            f"must be in [-2, 2], got {self.presence_penalty}",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty}",
        )

    def _check_counts(self) -> None:
        _check(
            self.seed is None or (_is_int(self.seed) and 0 <= self.seed < MAX_SEED),
            "seed",
            f"must be an integer in [0, 2^63), got {_shown(self.seed)}",
        )
        _check(
            self.logprobs is None
            or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs",
            f"must be in [0, {MAX_LOGPROBS}], got {_shown(self.logprobs)}",
        )
        _check(
            _is_int(self.n) and 1 <= self.n <= MAX_N,
            "n",
            f"must be in [1, {MAX_N}], got {_shown(self.n)}",
        )

    def _check_constraint_flags(self) -> None:
        _check(
            self.structured is None or isinstance(self.structured, StructuredOutput),
            "structured",
            f"must be a StructuredOutput, got {type(self.structured).__name__}",
        )
        _check(
            isinstance(self.ignore_eos, bool),
            "ignore_eos",
            f"must be true or false, got {_shown(self.ignore_eos)}",
        )
        # A constraint ends where its grammar accepts: generating past that point has no valid
        # token.
        _check(
            not (self.ignore_eos and self.structured is not None),
            "ignore_eos",
            "cannot be combined with a structured output constraint",
        )

    def _check_lists(self) -> None:
        _check(
            isinstance(self.stop_token_ids, list)
            and len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS
            and all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in self.stop_token_ids),
            "stop_token_ids",
            f"must be at most {MAX_STOP_TOKEN_IDS} token ids >= 0",
        )
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(
            isinstance(self.stop, list) and len(self.stop) <= MAX_STOP_STRINGS,
            "stop",
            f"at most {MAX_STOP_STRINGS} stop strings",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"
        )
        self._check_logit_bias()

    def _check_logit_bias(self) -> None:
        _check(
            isinstance(self.logit_bias, dict) and len(self.logit_bias) <= MAX_LOGIT_BIAS,
            "logit_bias",
            f"must map at most {MAX_LOGIT_BIAS} token ids to biases",
        )
        for token, bias in self.logit_bias.items():
            _check(
                _is_int(token) and 0 <= token <= MAX_TOKEN_ID,
                "logit_bias",
                f"token id {_shown(token)} is invalid",
            )
            _check(
                _is_number(bias) and -100.0 <= bias <= 100.0,
                "logit_bias",
                f"bias of token {token} must be in [-100, 100], got {_shown(bias)}",
            )

    def _check_extensions(self) -> None:
        """vLLM's sampling and detokenization extensions."""
        _check(
            self.prompt_logprobs is None
            or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
            "prompt_logprobs",
            f"must be in [0, {MAX_LOGPROBS}], got {_shown(self.prompt_logprobs)}",
        )
        self._check_min_tokens()
        self._check_detokenize_flags()
        self._check_truncation()
        self._check_bad_words()

    def _check_min_tokens(self) -> None:
        _check(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be an integer in [0, max_tokens={self.max_tokens}], "
            f"got {_shown(self.min_tokens)}",
        )
        _check(
            not (self.min_tokens and self.structured is not None),
            "min_tokens",
            "cannot be combined with a structured output constraint (or tools)",
        )

    def _check_detokenize_flags(self) -> None:
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            value = getattr(self, name)
            _check(isinstance(value, bool), name, f"must be true or false, got {_shown(value)}")
        value = self.spaces_between_special_tokens
        _check(
            isinstance(value, bool),
            "spaces_between_special_tokens",
            f"must be true or false, got {_shown(value)}",
        )

    def _check_truncation(self) -> None:
        _check(
            self.truncate_prompt_tokens is None
            or (
                _is_int(self.truncate_prompt_tokens)
                and 1 <= self.truncate_prompt_tokens <= MAX_TOKENS
            ),
            "truncate_prompt_tokens",
            f"must be an integer in [1, 2^31), got {_shown(self.truncate_prompt_tokens)}",
        )

    def _check_bad_words(self) -> None:
        _check(
            isinstance(self.bad_words, list)
            and len(self.bad_words) <= MAX_BAD_WORDS
            and all(
                isinstance(w, str) and w.strip() and len(w) <= MAX_BAD_WORD_CHARS
                for w in self.bad_words
            ),
            "bad_words",
            f"must be at most {MAX_BAD_WORDS} non-blank strings of at most "
            f"{MAX_BAD_WORD_CHARS} characters",
        )
        ids = self.bad_words_token_ids
        _check(
            isinstance(ids, list)
            and len(ids) <= 2 * MAX_BAD_WORDS
            and all(
                isinstance(seq, list)
                and 1 <= len(seq) <= MAX_BAD_WORD_TOKENS
                and all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in seq)
                for seq in ids
            ),
            "bad_words",
            f"token sequences: at most {2 * MAX_BAD_WORDS} of 1 to {MAX_BAD_WORD_TOKENS} token "
            "ids >= 0",
        )

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError unless every token id and top_k fit the model's vocabulary."""
        _check(
            self.top_k <= vocab_size,
            "top_k",
            f"must be <= the vocabulary size {vocab_size}, got {self.top_k}",
        )
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", list(self.logit_bias)),
            ("bad_words", [t for seq in self.bad_words_token_ids for t in seq]),
        ):
            _check(
                all(t < vocab_size for t in ids),
                name,
                f"token ids must be < the vocabulary size {vocab_size}",
            )

    @property
    def greedy(self) -> bool:
        """A temperature below MIN_TEMPERATURE takes the argmax."""
        return self.temperature < MIN_TEMPERATURE
