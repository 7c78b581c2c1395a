"""What the ingress handles of prefill/decode disaggregation (engine/disagg.py): the prefill
replica's reply and the request as the decode replica resumes it. A module of its own, torch-free,
so the ingress that unpickles a reply and routes it on never imports the engine."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.outputs import RequestOutput
    from scheduler.request import EngineRequest
    from workers.kv_handle import TransferHandle


def decode_request(request: EngineRequest, first: list[int]) -> EngineRequest:
    """The request as the decode engine runs it: resumed after the prefill's tokens. Its prompt
    logprobs came with the prefill's reply; asking again would make the decode engine compute the
    prompt instead of loading its blocks (a prompt_logprobs request never starts from cached KV)."""
    params = replace(request.sampling_params, prompt_logprobs=None)
    return replace(
        request,
        sampling_params=params,
        output_token_ids=list(request.output_token_ids) + list(first),
    )


@dataclass(frozen=True, slots=True)
class PrefillReply:
    """What a prefill replica answers: the tokens it sampled (the first), its last output, whether
    a decode replica goes on from there, and the transfer of the prompt's blocks (None: nothing
    was sent; the decode replica computes the prompt)."""

    token_ids: list[int]
    output: RequestOutput
    continues: bool
    handle: TransferHandle | None
