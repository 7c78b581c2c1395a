"""Random one-message chats of common words: prompts of varied length for greedy-parity checks and
the benchmarks that report them."""

from __future__ import annotations

import random

WORDS = [
    "river",
    "stone",
    "light",
    "market",
    "engine",
    "garden",
    "winter",
    "paper",
    "signal",
    "forest",
    "copper",
]


def random_chats(n: int, seed: int, max_words: int) -> list[list[dict[str, str]]]:
    """n chats of one user message of 3 to max_words words, the same for the same seed."""
    rng = random.Random(seed)
    chats = []
    for _ in range(n):
        length = rng.randint(3, max_words)
        text = " ".join(rng.choice(WORDS) for _ in range(length))
        chats.append([{"role": "user", "content": text}])
    return chats
