"""N-gram (prompt lookup) proposals: what followed the last time the context's tail was seen.

Pure Python over token ids, no torch: the match is a `bytes.rfind` over the context packed as
64-bit integers, so a long context costs one C scan per n-gram length rather than a Python loop.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_WIDTH = 8  # bytes per packed token id


def propose_ngram(token_ids: Sequence[int], ngram_min: int, ngram_max: int, k: int) -> list[int]:
    """k tokens that followed the most recent earlier occurrence of the context's last n tokens,
    for the longest n from ngram_max down to ngram_min that occurs; [] when none does."""
    length = len(token_ids)
    if k <= 0 or length < 2:
        return []
    data = array("q", token_ids).tobytes()
    # A match must end before the last token, so that at least one token follows it.
    limit = (length - 1) * _WIDTH
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        pattern = data[-n * _WIDTH :]
        pos = data.rfind(pattern, 0, limit)
        while pos > 0 and pos % _WIDTH:  # matched across token boundaries: look further back
            pos = data.rfind(pattern, 0, pos + len(pattern) - 1)
        if pos >= 0:
            return _continuation(token_ids, pos // _WIDTH + n, k)
    return []


def _continuation(token_ids: Sequence[int], start: int, k: int) -> list[int]:
    """k tokens from token_ids[start:], read on into the proposal itself when the context ends
    first: a match close to the end is a repeating run, and the run goes on."""
    length = len(token_ids)
    out = list(token_ids[start : start + k])
    while len(out) < k:
        out.append(out[start + len(out) - length])
    return out
