"""Batched token sampling: penalties, temperature, min-p / top-k / top-p, seeded draws, logprobs.

One call handles a whole batch with tensor ops; the only Python loop over rows is the noise draw
of requests that carry their own seed. Draws use the exponential race (argmax of p / E with
E ~ Exp(1)), which samples exactly from p and lets each seeded row own its noise.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from scheduler.outputs import TokenLogprobs
from scheduler.sampling_params import SamplingParams
from workers.bans import Bans, apply_bans
from workers.sampling_top import CANDIDATE_SIZES, apply_top_k_top_p

logger = logging.getLogger(__name__)

# Guards the exponential race against a zero draw (p / 0 would win even for a masked token).
_MIN_NOISE = 1e-20


@dataclass(slots=True)
class SamplingState:
    """Per-request sampling inputs the runner keeps across steps."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # the runner appends generated tokens here (append-only)
    generator: torch.Generator | None  # set iff params.seed is not None
    # Penalised requests only: token id -> times generated, plus the prompt's tokens at 0 when the
    # repetition penalty needs them. Outputs are folded in as they arrive (one per step), so a
    # step never recounts a whole sequence nor builds a vocabulary-wide row per request.
    seen: dict[int, int] | None = None
    num_counted: int = 0  # outputs already folded into `seen`
    bans: Bans | None = None  # min_tokens and bad_words: tokens masked before each draw

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_token_ids: list[int],
        device: torch.device,
        output_token_ids: list[int] | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> SamplingState:
        """Fresh state (a resumed request brings its earlier outputs); a seeded one gets a
        generator."""
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(params.seed)
        return cls(
            params,
            list(prompt_token_ids),
            list(output_token_ids or []),
            generator,
            bans=Bans.of(params, eos_token_ids),
        )

    @property
    def has_penalties(self) -> bool:
        p = self.params
        return (
            p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        )

    def seen_tokens(self) -> dict[int, int]:
        """`seen`, brought up to date with output_token_ids (rebuilt if that list was replaced by a
        shorter one)."""
        outputs = self.output_token_ids
        if self.seen is None or len(outputs) < self.num_counted:
            self.seen = (
                dict.fromkeys(self.prompt_token_ids, 0)
                if self.params.repetition_penalty != 1.0
                else {}
            )
            self.num_counted = 0
        seen = self.seen
        for token in outputs[self.num_counted :]:
            seen[token] = seen.get(token, 0) + 1
        self.num_counted = len(outputs)
        return seen


@dataclass(slots=True)
class SamplerOutput:
    """One sampled token per row, and per-row logprobs when any row asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None


def apply_penalties(
    logits: torch.Tensor,
    rows: torch.Tensor,
    token_ids: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """Penalise the (rows[i], token_ids[i]) entries: each row's seen tokens (unique per row), with
    output_counts[i] the times that token was generated (0: prompt only). Repetition penalty
    (CTRL: positive logits divided, negative multiplied), then OpenAI presence / frequency
    penalties over output tokens; per-row parameters are [B]. Entries not listed are unchanged,
    exactly as a dense pass with zero counts leaves them. Out of place."""
    values = logits[rows, token_ids]
    penalty = repetition[rows]
    values = torch.where(values > 0, values / penalty, values * penalty)
    values = values - frequency[rows] * output_counts - presence[rows] * (output_counts > 0)
    return logits.index_put((rows, token_ids), values)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_logit_bias(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Add each row's logit_bias (token id -> bias) in one scatter over the whole batch. Out of
    place."""
    rows, cols, values = [], [], []
    for row, state in enumerate(states):
        for token, bias in state.params.logit_bias.items():
            rows.append(row)
            cols.append(token)
            values.append(bias)
    index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
    return logits.index_put(
        index, torch.tensor(values, dtype=logits.dtype, device=logits.device), accumulate=True
    )


class Sampler:
    """Picks the next token for every row of a logits batch."""

    def sample(
        self,
        logits: torch.Tensor,
        states: list[SamplingState],
        unmasked: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """logits: [B, V] on any device, one row per state (row i belongs to states[i]).

        unmasked: the same logits before a grammar masked them. Logprobs come from it, as OpenAI
        reports them: the model's distribution, finite, not the mask's -inf."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(
                f"logits: expected shape [{len(states)}, V], got {tuple(logits.shape)}"
            )
        if not states:
            return SamplerOutput([], None)
        logits = logits.float()
        wants_logprobs = any(s.params.logprobs is not None for s in states)
        raw = logits if unmasked is None else unmasked.float()
        raw_logprobs = raw.log_softmax(dim=-1) if wants_logprobs else None
        if any(s.params.logit_bias for s in states):
            logits = apply_logit_bias(logits, states)
        if any(s.bans is not None for s in states):
            logits = apply_bans(logits, [(s.bans, s.output_token_ids) for s in states])
        if not wants_logprobs and all(s.params.greedy and not s.has_penalties for s in states):
            return SamplerOutput(logits.argmax(dim=-1).tolist(), None)

        if any(s.has_penalties for s in states):
            logits = _penalise(logits, states)
        token_ids = _pick(logits, states)
        logprobs = (
            None if raw_logprobs is None else _gather_logprobs(raw_logprobs, token_ids, states)
        )
        return SamplerOutput(token_ids.tolist(), logprobs)


def _param_tensor(states: list[SamplingState], name: str, device: torch.device) -> torch.Tensor:
    return torch.tensor(
        [getattr(s.params, name) for s in states], dtype=torch.float32, device=device
    )


def _penalise(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    device = logits.device
    seen = [s.seen_tokens() if s.has_penalties else {} for s in states]
    lengths = torch.tensor([len(d) for d in seen], device=device)
    rows = torch.repeat_interleave(torch.arange(len(states), device=device), lengths)
    token_ids = torch.tensor(list(chain.from_iterable(seen)), dtype=torch.long, device=device)
    counts = torch.tensor(
        list(chain.from_iterable(d.values() for d in seen)), dtype=logits.dtype, device=device
    )
    return apply_penalties(
        logits,
        rows,
        token_ids,
        counts,
        _param_tensor(states, "repetition_penalty", device),
        _param_tensor(states, "presence_penalty", device),
        _param_tensor(states, "frequency_penalty", device),
    )


def _pick(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Greedy rows take the argmax; the others are drawn from their filtered distribution."""
    random_rows = [i for i, s in enumerate(states) if not s.params.greedy]
    if not random_rows:
        return logits.argmax(dim=-1)
    if len(random_rows) == len(states):
        return _draw(logits, states)
    token_ids = logits.argmax(dim=-1)
    index = torch.tensor(random_rows, device=logits.device)
    token_ids[index] = _draw(logits[index], [states[i] for i in random_rows])
    return token_ids


def _draw(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Sample rows with temperature > 0: temperature, then min-p, top-k, top-p, then the race."""
    device = logits.device
    vocab = logits.shape[-1]
    logits = logits / _param_tensor(states, "temperature", device)[:, None]
    if any(s.params.min_p > 0.0 for s in states):
        logits = apply_min_p(logits, _param_tensor(states, "min_p", device))
    if any(s.params.top_k > 0 or s.params.top_p < 1.0 for s in states):
        top_k = torch.tensor(
            [s.params.top_k if s.params.top_k > 0 else vocab for s in states], device=device
        )
        # p = 1 disables the filter; rounding in the cumulative sum must not trim the tail.
        top_p = torch.tensor(
            [s.params.top_p if s.params.top_p < 1.0 else 2.0 for s in states], device=device
        )
        # A GPU sorts a row in microseconds; the candidate sets' host syncs would cost more there.
        sizes = CANDIDATE_SIZES if device.type == "cpu" else ()
        logits = apply_top_k_top_p(logits, top_k, top_p, sizes)
    probs = logits.softmax(dim=-1)
    return probs.div_(_exponential_noise(probs, states)).argmax(dim=-1)


def position_seed(seed: int, position: int) -> int:
    """The generator seed of output position `position` of a request seeded with `seed`.

    Keyed by position, not advanced draw by draw, so a request resumed elsewhere with its first
    `position` tokens draws exactly what it would have drawn (splitmix64 mixing, 63-bit result).
    """
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 1


def _exponential_noise(probs: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Exp(1) noise: one batched draw for unseeded rows, each seeded row from its own generator
    keyed by (seed, output position), so a seeded row's token depends only on its seed, its
    logits and how many tokens it has produced."""
    noise = torch.empty_like(probs)
    seeded = [(i, s, s.generator) for i, s in enumerate(states) if s.generator is not None]
    if len(seeded) < len(states):
        # -log(1 - U) is Exp(1) exactly, and on CPU several times cheaper than exponential_, which
        # over a full vocabulary is a sizeable share of a decode step. Seeded rows keep
        # exponential_, so their per-position streams stay what they were.
        noise.uniform_().neg_().log1p_().neg_()
    for i, state, generator in seeded:
        seed = state.params.seed
        assert seed is not None  # a generator is set iff the request is seeded
        generator.manual_seed(position_seed(seed, len(state.output_token_ids)))
        noise[i].exponential_(generator=generator)
    return noise.clamp_min_(_MIN_NOISE)


def _gather_logprobs(
    raw_logprobs: torch.Tensor, token_ids: torch.Tensor, states: list[SamplingState]
) -> list[TokenLogprobs | None]:
    """Sampled token first, then the top-N of the raw (unpenalised, untempered) distribution."""
    sampled = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()
    ids = token_ids.tolist()
    top_n = min(max(s.params.logprobs or 0 for s in states), raw_logprobs.shape[-1])
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    if top_n > 0:
        values, indices = raw_logprobs.topk(top_n, dim=-1)
        top_values, top_ids = values.tolist(), indices.tolist()
    result: list[TokenLogprobs | None] = []
    for row, state in enumerate(states):
        n = state.params.logprobs
        if n is None:
            result.append(None)
            continue
        ranked = list(zip(top_ids[row][:n], top_values[row][:n])) if n else []
        result.append([(ids[row], sampled[row])] + ranked)
    return result
