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

# Bulk tokens a step takes beside a neighbour (unless SchedulerConfig.bulk_tokens_per_step says):
# max_num_batched_tokens / BULK_SHARE_DIVISOR, at least MIN_BULK_TOKENS so bulk work always moves
# (8 at the default budget of 2048; 16 and 32 at the 4096 and 8192 GPU deployments use). On a GPU,
# where a step's cost hardly grows with a few hundred more rows, set it higher. A
# prompt-logprobs row counts PROMPT_LOGPROB_ROW_COST tokens: a forward token and a full-vocabulary
# logits row with its log-softmax and top-k. Measured on a CPU (the default model, one thread,
# bench/neighbour_latency.py): a neighbour's decode step is 12.4 ms alone, 24.2 ms beside 8
# embedding tokens, 29.1 ms beside 8 prompt-logprobs rows, 37-49 ms beside 16 tokens or rows.
BULK_SHARE_DIVISOR = 256
MIN_BULK_TOKENS = 8
PROMPT_LOGPROB_ROW_COST = 2
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


def bulk_cost(req: Request, computed: int) -> int:
    """What each token of req's chunk from `computed` counts against the share: 0 when it is
    not bulk."""
    if not is_bulk(req, computed):
        return 0
    return 1 if req.sampling_params.pooling is not None else PROMPT_LOGPROB_ROW_COST


def bulk_share(max_num_batched_tokens: int, configured: int | None = None) -> int:
    """Bulk tokens one step takes while a neighbour streams (`configured`: the setting)."""
    if configured is not None:
        return configured
    return max(MIN_BULK_TOKENS, max_num_batched_tokens // BULK_SHARE_DIVISOR)


@dataclass(slots=True)
class BulkBudget:
    """One step's bulk tokens left; the scheduler caps each chunk with `cap` and charges what it
    scheduled with `charge`."""

    left: int = _NO_CAP

    @classmethod
    def for_step(
        cls, running: Iterable[Request], max_num_batched_tokens: int, share: int | None = None
    ) -> BulkBudget:
        """The allowance of a step whose running batch is `running` (before the step): the whole
        budget unless one of them is not bulk."""
        neighbour = any(not is_bulk(r, r.num_computed_tokens) for r in running)
        return cls(bulk_share(max_num_batched_tokens, share) if neighbour else _NO_CAP)

    def cap(self, req: Request, computed: int) -> int:
        """The most tokens req's chunk from `computed` may take this step (no cap if not bulk)."""
        cost = bulk_cost(req, computed)
        return max(self.left, 0) // cost if cost else _NO_CAP

    def charge(self, req: Request, computed: int, n: int) -> None:
        """req's chunk of n tokens from `computed` is scheduled."""
        self.left -= n * bulk_cost(req, computed)
