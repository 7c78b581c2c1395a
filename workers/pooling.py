"""Embeddings: a prompt's final hidden states pooled into one normalised vector.

An embedding request is a prefill whose one sampled token is thrown away; its prompt may run in
several chunks, so a mean is summed chunk by chunk and divided at the prompt's end. The vector
crosses the process boundary as a plain list of floats (ModelRunnerOutput.pooled).
"""

from __future__ import annotations

import torch


class Pooler:
    """Running sums of the mean-pooled requests of one runner, and the pooling itself."""

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}

    def pool(
        self, req_id: str, how: str, hidden: torch.Tensor, start: int, num_prompt: int
    ) -> list[float] | None:
        """Take one chunk's hidden states (rows `start`.. of the prompt); the vector once the
        chunk ends the prompt, else None."""
        final = start + hidden.shape[0] >= num_prompt
        if how == "last":
            return _normalised(hidden[-1]) if final else None
        chunk = hidden.float().sum(dim=0)
        # A chunk at position 0 starts the prompt again (a recomputed preemption included).
        total = chunk if start == 0 else self._sums[req_id] + chunk
        if not final:
            self._sums[req_id] = total
            return None
        self._sums.pop(req_id, None)
        return _normalised(total / num_prompt)

    def drop(self, req_id: str) -> None:
        self._sums.pop(req_id, None)


def _normalised(vector: torch.Tensor) -> list[float]:
    vector = vector.float()
    return torch.nn.functional.normalize(vector, dim=0).cpu().tolist()
