"""POST /tokenize and /detokenize, as vLLM defines them: a prompt (or a chat, through the model's
template) to token ids and back, with the frontend the completions use."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deploy.errors import BadRequestError
from deploy.image_parts import ServedVision, image_token_counts
from deploy.schemas import ChatMessage, ChatTemplateFields
from frontend.frontend import Frontend
from scheduler.multimodal import ImageLike, expand_placeholders


class TokenizeRequest(ChatTemplateFields):
    """A `prompt`, or `messages` rendered with the chat template; exactly one."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = Field(default=None, max_length=1024)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    # vLLM's defaults: a prompt gets the tokenizer's specials (BOS), a rendered chat has its own.
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt and messages")
        return self

    @property
    def num_chars(self) -> int:
        """Characters to encode, each message counted with the cost of its role markers."""
        if self.prompt is not None:
            return len(self.prompt)
        return sum(len(m.text()) + 32 for m in self.messages or [])


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = Field(default=None, max_length=1024)
    tokens: list[int]


def tokenize(
    frontend: Frontend, body: TokenizeRequest, messages: list[dict[str, Any]]
) -> list[int]:
    """The token ids of the body's prompt or chat (`messages` as the template takes them)."""
    if body.prompt is not None:
        add = True if body.add_special_tokens is None else body.add_special_tokens
        return frontend.tokenizer.encode(body.prompt, add_special_tokens=add)
    ids = frontend.encode_chat(messages, options=body.chat_options())
    if body.add_special_tokens:
        ids = frontend.tokenizer.build_inputs_with_special_tokens(ids)
    return list(ids)


def with_image_tokens(
    ids: list[int], vision: ServedVision | None, images: Sequence[ImageLike]
) -> list[int]:
    """A chat's ids with each image's placeholder repeated for the tokens the engine gives it
    (engine/multimodal.py's expansion); a 400 when placeholders and images differ in number."""
    placeholder = None if vision is None else vision.placeholder
    if placeholder is None:
        return ids
    found = ids.count(placeholder)
    if found != len(images):
        raise BadRequestError(
            f"messages: {len(images)} images for {found} image placeholders in the rendered chat",
            param="messages",
        )
    return expand_placeholders(ids, placeholder, image_token_counts(vision, images))[0]


def tokenize_response(
    frontend: Frontend, body: TokenizeRequest, ids: list[int], max_model_len: int
) -> dict[str, Any]:
    out: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
    out["token_strs"] = (
        frontend.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    )
    return out


def detokenize(frontend: Frontend, body: DetokenizeRequest) -> dict[str, Any]:
    """{"prompt": text} of the ids (ValueError naming `tokens` for an id outside the vocabulary)."""
    if body.tokens:
        frontend.check_token_ids(body.tokens, "tokens")
    return {"prompt": frontend.tokenizer.decode(body.tokens)}
