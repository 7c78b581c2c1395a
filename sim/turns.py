"""Multi-turn sessions, the part the simulator's chat (sim/tier_study.py) and agent
(sim/agents.py) workloads share: turn k's prompt is the session's tokens so far (where it
started, the earlier questions and answers) and a new question; the next turn arrives a think
time after it."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

from sim.workload import check_len_ranges

MAX_THINK_S = 1e6


class TurnShape(Protocol):
    """A workload config's turn ranges, each drawn uniformly and inclusive."""

    @property
    def question_len(self) -> tuple[int, int]: ...

    @property
    def answer_len(self) -> tuple[int, int]: ...

    @property
    def think_s(self) -> tuple[float, float]: ...


def check_turn_shape(shape: TurnShape) -> None:
    """A ValueError naming the range that is out of bounds: lengths in [1, 2^20] tokens, think
    times in [0, 1e6] seconds, low <= high."""
    check_len_ranges(shape, "question_len", "answer_len")
    lo, hi = shape.think_s
    if not 0 <= lo <= hi <= MAX_THINK_S:  # False for NaN
        raise ValueError(f"think_s: need 0 <= low <= high <= 1e6, got {shape.think_s}")


@dataclass(frozen=True, slots=True)
class Turn:
    arrival_s: float
    prompt_len: int  # the session's tokens before it and its new question
    answer_len: int


def session(
    shape: TurnShape, rng: random.Random, start_len: int, start_s: float, turns: int
) -> list[Turn]:
    """A session's turns, the first arriving at start_s after start_len tokens of its own (a
    shared context; 0: none)."""
    out = []
    prompt, t = start_len, start_s
    for _ in range(turns):
        prompt += rng.randint(*shape.question_len)
        answer = rng.randint(*shape.answer_len)
        out.append(Turn(t, prompt, answer))
        prompt += answer
        t += rng.uniform(*shape.think_s)
    return out
