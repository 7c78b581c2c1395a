"""OpenAI request bodies (validated) and the response chunks built from generation results."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from scheduler.request import MAX_PRIORITY, MAX_TENANT_CHARS
from scheduler.sampling_params import (MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N, MAX_SEED, MAX_STOP_STRINGS,
                                       MAX_TOKEN_ID)

# Documented OpenAI (and vLLM) request fields raylm does not implement: a 400 naming the field
# beats silently generating something the client did not ask for. Neutral values pass.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "parallel_tool_calls": (None, True, False), "response_format": (None, {"type": "text"}),
    "structured_outputs": (None,), "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
    "web_search_options": (None,), "suffix": (None, ""), "best_of": (None, 1),
}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions, each bounded as SamplingParams is."""

    # OpenAI clients send bookkeeping fields we do not use (metadata, store, ...): ignore those;
    # fields that would change the output and are not implemented are refused (_UNSUPPORTED).
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str = Field(max_length=1024)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKEN_ID)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=MAX_TOKEN_ID)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=MAX_SEED)
    stop: list[str] = Field(default_factory=list)
    n: int = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)
    logit_bias: dict[int, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=MAX_TENANT_CHARS)
    priority: int = Field(default=0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    request_timeout_s: float | None = Field(default=None, gt=0, le=86400)  # raylm extension

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, neutral in _UNSUPPORTED.items():
                if name in data and not any(data[name] == v and type(data[name]) is type(v) for v in neutral):
                    raise ValueError(f"{name}: not supported by this server")
        return data

    @model_validator(mode="after")
    def _seeds_stay_in_range(self) -> "_SamplingFields":
        # Choice i of n draws with seed + i: the last one must still be a valid seed.
        if self.seed is not None and self.seed + self.n - 1 >= MAX_SEED:
            raise ValueError(f"seed: seed + n - 1 must be < 2^63, got seed={self.seed}, n={self.n}")
        for token, bias in (self.logit_bias or {}).items():
            if not (0 <= token <= MAX_TOKEN_ID and -100.0 <= bias <= 100.0):
                raise ValueError(f"logit_bias: token {token} must be a token id and its bias in [-100, 100]")
        return self

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: object) -> object:
        if v is None:
            return []
        stops = [v] if isinstance(v, str) else v
        if not isinstance(stops, list):
            return stops  # the list[str] check reports it
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list) and (not v or any(isinstance(p, (str, list)) and not p for p in v)):
            raise ValueError("prompt must not be empty")
        if isinstance(v, str) and not v:
            raise ValueError("prompt must not be empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a batch: each item text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @property
    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0
