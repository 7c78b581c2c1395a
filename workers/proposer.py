"""Proposers of speculative tokens: one interface, chosen by `speculative.method`.

The runner asks for proposals after each step's sampling, for every request that sampled; a
request under a grammar has its proposals cut before the first token the grammar rejects
(workers/grammar_spec.py).
The scheduler decides how many of them the next step verifies (scheduler/spec_scheduler.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from scheduler.speculative import SpeculativeConfig
from workers.ngram import propose_ngram


class Proposer(Protocol):
    """Proposes tokens to follow each context.

    A proposer that reads the target model's hidden states (EAGLE heads, MTP) says so with
    `uses_hidden_states`; the runner then passes the last hidden state of each context's row.
    """

    uses_hidden_states: bool

    def propose(
        self, contexts: Sequence[Sequence[int]], hidden_states: torch.Tensor | None = None
    ) -> list[list[int]]:
        """Per context (prompt + outputs, the token just sampled last), up to num_tokens tokens;
        hidden_states: [len(contexts), hidden] when uses_hidden_states, else None."""
        ...


class NgramProposer:
    """Prompt lookup: the tokens that followed the last match of the context's tail."""

    uses_hidden_states = False

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(
        self, contexts: Sequence[Sequence[int]], hidden_states: torch.Tensor | None = None
    ) -> list[list[int]]:
        cfg = self.config
        k = cfg.proposal_length  # the scheduler verifies as many of them as SpecPolicy allows
        return [propose_ngram(ctx, cfg.ngram_min, cfg.ngram_max, k) for ctx in contexts]


def make_proposer(config: SpeculativeConfig | None) -> Proposer | None:
    """The proposer `config.method` names; None without speculation, and for methods `draft` and
    `mtp`, whose model and KV the runner holds itself (workers/draft.py, workers/mtp.py: they
    need the step's batch)."""
    if config is None or config.method in ("draft", "mtp"):
        return None
    if config.method == "ngram":
        return NgramProposer(config)
    raise ValueError(f"speculative.method: {config.method!r} has no proposer")
