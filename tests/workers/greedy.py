"""Greedy-decoding references and the comparison rule used by the correctness tests.

Two greedy decoders may part ways only at a true near-tie: where the reference's two best
tokens have log-probabilities within NEAR_TIE of each other. Any other difference is a bug.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig

NEAR_TIE = 1e-3


@dataclass(slots=True)
class Greedy:
    """A greedy continuation and, per generated token, the reference's two best logprobs."""

    token_ids: list[int]
    top2: list[tuple[float, float]]


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> Greedy:
    """Hugging Face `generate` (greedy, EOS ignored) with the logits of every step."""
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    # An explicit eos_token_id=None is filled in from the model's defaults; clear those instead.
    saved, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    try:
        out = model.generate(
            torch.tensor([prompt_ids], device=model.device), generation_config=config
        )
    finally:
        model.generation_config.eos_token_id = saved
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    top2 = [tuple(step[0].float().log_softmax(-1).topk(2).values.tolist()) for step in out.logits]
    return Greedy(tokens, top2)


def from_logprobs(token_ids: list[int], logprobs: list) -> Greedy:
    """A Greedy from raylm output with SamplingParams(logprobs=2): (sampled, top-1, top-2) per
    token."""
    return Greedy(list(token_ids), [(lp[1][1], lp[2][1]) for lp in logprobs])


def assert_greedy_match(tokens: list[int], ref: Greedy, what: str = "") -> None:
    """tokens equal ref.token_ids, except after a first difference that sits on a near-tie."""
    n = min(len(tokens), len(ref.token_ids))
    assert len(tokens) == len(ref.token_ids), (
        f"{what}: {len(tokens)} tokens vs reference {len(ref.token_ids)}"
    )
    for i in range(n):
        if tokens[i] != ref.token_ids[i]:
            best, second = ref.top2[i]
            assert best - second <= NEAR_TIE, (
                f"{what}: token {i} is {tokens[i]}, reference {ref.token_ids[i]}, and the "
                "reference's "
                f"top-2 logprobs {best:.6f} / {second:.6f} are not a near-tie"
            )
            return
