"""The step's allowance of bulk tokens: work no one is streaming, kept from stalling those who are.

Two kinds of prompt token cost a step more than it delivers to anyone waiting on a stream:
- an embedding request's prompt (SamplingParams.pooling): thousands of tokens, one vector at the
  end;
- a prompt position scored for `prompt_logprobs` (echo included): a full-vocabulary logits row,
  its log-softmax and top-k, on top of the forward.

While a request that is not bulk runs (a decode, or an ordinary prefill), the bulk tokens of a
step are capped at a share of the token budget, so a decoding neighbour's inter-token latency
stays near its solo figure: the bulk request is slower, its neighbours are not. With no such
neighbour a bulk request gets the whole budget. The cap is on the step, not the request: 128
embedding inputs share one allowance, and are charged to their tenant's fair share like any
prefill (Scheduler._charge_input).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from scheduler.request import Request

# Bulk tokens a step takes beside a neighbour: max_num_batched_tokens / BULK_SHARE_DIVISOR, at least
# MIN_BULK_TOKENS so bulk work always moves (16 at the default budget of 2048; 32 and 64 at the
# 4096 and 8192 that GPU deployments use, where a step's cost hardly grows with a few more rows).
# Measured on a CPU (the default model, one thread): a decode step 35 ms alone, 42-46 ms beside 16
# bulk tokens, 130-220 ms beside 64 (bench/neighbour_latency.py prints the figures).
BULK_SHARE_DIVISOR = 128
MIN_BULK_TOKENS = 16
_NO_CAP = 1 << 62


def is_bulk(req: Request, computed: int) -> bool:
    """Whether a chunk of req starting at `computed` is bulk work: an embedding prompt, or prompt
    positions still to be scored for prompt_logprobs (a resumed request sent them before)."""
    params = req.sampling_params
    if params.pooling is not None:
        return True
    return (
        params.prompt_logprobs is not None
        and not req.output_token_ids
        and computed < req.num_prompt_tokens - 1
    )


def bulk_share(max_num_batched_tokens: int) -> int:
    """Bulk tokens one step takes while a neighbour streams."""
    return max(MIN_BULK_TOKENS, max_num_batched_tokens // BULK_SHARE_DIVISOR)


@dataclass(slots=True)
class BulkBudget:
    """One step's bulk tokens left; the scheduler caps each chunk with `cap` and charges what it
    scheduled with `charge`."""

    left: int = _NO_CAP

    @classmethod
    def for_step(cls, running: Iterable[Request], max_num_batched_tokens: int) -> BulkBudget:
        """The allowance of a step whose running batch is `running` (before the step): the whole
        budget unless one of them is not bulk."""
        neighbour = any(not is_bulk(r, r.num_computed_tokens) for r in running)
        return cls(bulk_share(max_num_batched_tokens) if neighbour else _NO_CAP)

    def cap(self, req: Request, computed: int) -> int:
        """The most tokens req's chunk from `computed` may take this step (no cap if not bulk)."""
        return max(self.left, 0) if is_bulk(req, computed) else _NO_CAP

    def charge(self, req: Request, computed: int, n: int) -> None:
        """req's chunk of n tokens from `computed` is scheduled."""
        if is_bulk(req, computed):
            self.left -= n
