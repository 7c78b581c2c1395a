"""What the ingress sends a replica: one plain, cheap-to-pickle generation request."""
from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.sampling_params import SamplingParams


@dataclass(slots=True)
class GenerateRequest:
    """A tokenized prompt bound for one LLMReplica.

    block_hashes are the chained hash_block_tokens of the prompt's full blocks (block size of the
    deployment), computed in the ingress so the fleet router can estimate prefix-cache affinity
    without tokenizing. The router reads it as ``pending_request.args[0]``.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    tenant: str = "default"
    block_hashes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id: must be a non-empty string")
        if not self.prompt_token_ids:
            raise ValueError(f"prompt_token_ids: request {self.request_id!r} has an empty prompt")
