"""The stop rules of a request's sampled tokens: stop token ids, EOS and the length caps.

Stop *strings* need detokenized text and are cut by the frontend; everything decided on token ids
is decided here, once, for the scheduler and for the simulator's multi-step decode.
"""

from __future__ import annotations

from scheduler.request import Request, RequestStatus


def is_stop_token(request: Request, token_id: int) -> bool:
    """Whether sampling token_id ends the request: one of its stop_token_ids, or an EOS id unless
    ignore_eos."""
    return token_id in request.stop_ids


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """The final status the request's last appended token gives it, or None while it goes on.

    A stop token wins over a length cap reached by the same token: the request stopped (finish
    reason "stop"). Otherwise the request is capped once it holds max_tokens outputs or
    max_model_len tokens in all.
    """
    all_ids = request.all_token_ids
    if all_ids[-1] in request.stop_ids:  # is_stop_token, without a call per request per step
        return RequestStatus.FINISHED_STOPPED
    num_tokens = len(all_ids)  # max_num_tokens: the prompt and max_tokens outputs
    if num_tokens >= request.max_num_tokens or num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None
