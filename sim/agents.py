"""An agent workload: long shared contexts, each forked many ways, each fork a multi-turn session.

Context c (`contexts` of them, starting uniformly over `start_spread_s`) is `context_len` tokens
(a repository, a long document, an agent's accumulated plan). Its first request (the parent agent's
planning turn) computes it; `fork_after_s` later its `forks` sub-agents start within
`fork_spread_s` of each other, each one a session of `turns` turns: turn k's prompt is the context,
the fork's earlier questions and answers, and a new question; the next turn arrives `think_s`
after it (tool calls, the agent's own work). So every fork shares the context with its siblings
and each turn shares the whole previous turn with the fork's next (the llm-d agent workload:
one context forked 43 ways). Deterministic by seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from settings import check_settings, setting
from sim.turns import check_turn_shape, session
from sim.workload import MAX_LEN, SimRequest

MAX_SECONDS = 1e6


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """Contexts, their forks and turns, and the lengths and pauses of each turn."""

    contexts: int = setting(8, "shared contexts", ge=1, le=1 << 20)
    context_len: int = setting(2048, "tokens of each context", ge=1, le=MAX_LEN)
    forks: int = setting(8, "sub-agent sessions forked from each context", ge=1, le=1 << 16)
    turns: int = setting(3, "turns of each fork's session", ge=1, le=1 << 16)
    question_len: tuple[int, int] = (32, 128)  # a turn's new tokens, uniform inclusive
    answer_len: tuple[int, int] = (16, 64)
    think_s: tuple[float, float] = (5.0, 15.0)  # from one turn's arrival to the next
    fork_after_s: float = setting(
        5.0, "forks start this long after their context's first request", ge=0, le=MAX_SECONDS
    )
    fork_spread_s: float = setting(
        1.0, "a context's forks start within this window", ge=0, le=MAX_SECONDS
    )
    start_spread_s: float = setting(
        60.0, "contexts start uniformly over this window", ge=0, le=MAX_SECONDS
    )
    seed: int = setting(0, "seed of the draws", ge=0, lt=2**63)

    def __post_init__(self) -> None:
        check_settings(self)
        check_turn_shape(self)

    @property
    def num_requests(self) -> int:
        return self.contexts * (1 + self.forks * self.turns)


def _session(
    cfg: AgentConfig, rng: random.Random, ctx: str, name: str, t: float, turns: int
) -> list[tuple[float, str, int, int, str]]:
    """One session's turns as (arrival, group, prompt length, answer length, context group)."""
    return [
        (u.arrival_s, name, u.prompt_len, u.answer_len, ctx)
        for u in session(cfg, rng, cfg.context_len, t, turns)
    ]


def agent_workload(cfg: AgentConfig) -> list[SimRequest]:
    """Every context's first request and its forks' turns, in arrival order. A session's group is
    its whole token sequence (its first context_len tokens its context's), so each turn's prompt
    begins with the previous turn's prompt and answer."""
    rng = random.Random(cfg.seed)
    turns: list[tuple[float, str, int, int, str]] = []
    for c in range(cfg.contexts):
        ctx = f"c{c}"
        start = rng.uniform(0, cfg.start_spread_s)
        turns += _session(cfg, rng, ctx, f"{ctx}.root", start, 1)
        for f in range(cfg.forks):
            t = start + cfg.fork_after_s + rng.uniform(0, cfg.fork_spread_s)
            turns += _session(cfg, rng, ctx, f"{ctx}.f{f}", t, cfg.turns)
    turns.sort()
    return [
        SimRequest(
            request_id=f"r{i}",
            arrival_s=t,
            prompt_len=prompt,
            output_len=answer,
            prefix_group=group,
            prefix_len=prompt,
            tenant=ctx,
            context_group=ctx,
            context_len=cfg.context_len,
            session=group,
        )
        for i, (t, group, prompt, answer, ctx) in enumerate(turns)
    ]
