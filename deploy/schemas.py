"""OpenAI request bodies (validated) and the response chunks built from generation results."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from deploy.schema_parts import (
    NamedToolChoice,
    ResponseFormat,
    StreamOptions,
    StructuredOutputsField,
    ToolCallMessage,
    ToolDefinition,
)
from frontend.chat import ChatOptions
from router.sessions import MAX_SESSION_ID_CHARS
from scheduler.request import MAX_CACHE_SALT_CHARS, MAX_PRIORITY, MAX_TENANT_CHARS
from scheduler.sampling_params import MAX_SEED, MAX_TOKENS, SamplingParams
from scheduler.structured_output import StructuredOutput

# Documented OpenAI (and vLLM) request fields raylm does not implement, with the values that ask
# for nothing: those pass, any other is refused naming the field (deploy/fields.py), unless the
# server's unknown_fields setting is ignore.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "guided_decoding_backend": (None,),
    "structural_tag": (None,),
    "store": (None, False),
    "service_tier": (None, "auto", "default"),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "moderation": (None,),
    "prompt_cache_options": (None,),
    "prompt_cache_retention": (None,),
}
MAX_TOOLS = 128
# The longest cache_salt or prompt_cache_key (OpenAI's bound on prompt_cache_key is lower).
MAX_CACHE_KEY_CHARS = MAX_CACHE_SALT_CHARS
# The messages of one conversation, as OpenAI (and Azure OpenAI) bound them; the app's
# `max_messages` setting defaults to this and is passed in the validation context.
MAX_MESSAGES = 2048
# Content parts and earlier tool calls over all the messages of one conversation: each costs a
# validation, and a body of empty ones is almost all overhead.
MAX_MESSAGE_PARTS = 4096


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions. The sampling fields are only
    parsed here: SamplingParams owns their bounds, and its ValueError is a 400 naming the field."""

    # Every key of a body is checked against these fields before validation (deploy/fields.py):
    # what is not declared here is refused, or dropped under unknown_fields: ignore.
    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = _UNSUPPORTED
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str = Field(max_length=1024)
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=MAX_TENANT_CHARS)
    # OpenAI's bookkeeping: accepted within OpenAI's bounds, not used.
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    safety_identifier: str | None = Field(default=None, max_length=MAX_TENANT_CHARS)
    # Prefix-cache partitions (deploy/cache_scope.py): vLLM's cache_salt, and OpenAI's key, which
    # is always the tenant's own.
    prompt_cache_key: str | None = Field(default=None, max_length=MAX_CACHE_KEY_CHARS)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_KEY_CHARS)
    priority: int = Field(default=0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    request_timeout_s: float | None = Field(default=None, gt=0, le=86400)  # raylm extension
    # raylm extension: the agent conversation this request is a turn of; the fleet router keeps a
    # session's turns on the replica holding its context while that replica is within the load
    # ceiling (docs/router.md#sessions).
    session_id: str | None = Field(default=None, min_length=1, max_length=MAX_SESSION_ID_CHARS)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None  # vLLM extension
    guided_json: dict[str, Any] | bool | str | None = (
        None  # vLLM's older spelling of structured_outputs
    )
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's sampling and detokenization extensions (bounded by SamplingParams).
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None

    @model_validator(mode="after")
    def _sampling_bounds(self) -> _SamplingFields:
        # Built once here, SamplingParams refuses a bad value before any work is done. Unset,
        # max_tokens is checked as large enough for min_tokens (the context decides later).
        max_tokens = self.asked_max_tokens
        if max_tokens is None:
            floor = self.min_tokens if 0 < self.min_tokens <= MAX_TOKENS else 1
            max_tokens = max(1, floor)
        try:
            params = self.sampling_params(max_tokens, self.asked_logprobs)
            replace(params, n=self.n)  # each choice is one engine request; n bounds the fan-out
        except ValueError as exc:
            name, _, problem = str(exc).partition(":")
            raise ValueError(f"{self.field_name(name)}:{problem}") from None
        # Choice i of n draws with seed + i: the last one must still be a valid seed.
        if self.seed is not None and self.seed + self.n - 1 >= MAX_SEED:
            raise ValueError(f"seed: seed + n - 1 must be < 2^63, got seed={self.seed}, n={self.n}")
        return self

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        structured: StructuredOutput | None = None,
        choice: int = 0,
        bad_words_token_ids: list[list[int]] | None = None,
    ) -> SamplingParams:
        """The SamplingParams of choice `choice` of this request (seeded seed + choice); the
        bad words' token sequences come from the frontend (Frontend.bad_words_token_ids)."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=None if self.seed is None else self.seed + choice,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logprobs=logprobs,
            ignore_eos=self.ignore_eos,
            stop=list(self.stop),
            logit_bias=dict(self.logit_bias or {}),
            structured=structured,
            min_tokens=self.min_tokens,
            stop_token_ids=list(self.stop_token_ids or []),
            bad_words=list(self.bad_words or []),
            bad_words_token_ids=bad_words_token_ids or [],
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            prompt_logprobs=self.asked_prompt_logprobs,
        )

    @property
    def asked_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token (None: the prompt's log-probabilities are not asked)."""
        return self.prompt_logprobs

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self) -> _SamplingFields:
        if self.stream and self.asked_prompt_logprobs is not None:
            name = "prompt_logprobs" if self.prompt_logprobs is not None else "echo"
            raise ValueError(f"{name}: the prompt's log-probabilities are not streamed")
        return self

    @property
    def asked_max_tokens(self) -> int | None:
        """max_tokens as the client asked for it (unset: what the context leaves)."""
        return self.max_tokens

    @property
    def asked_logprobs(self) -> int | None:
        """The top-logprobs count as the client asked for it (None: no logprobs)."""
        return None

    def field_name(self, name: str) -> str:
        """This request's name for a SamplingParams field."""
        return name

    def output_constraint(self) -> StructuredOutput | None:
        """The constraint asked for by response_format, structured_outputs or a guided_* field."""
        found: list[StructuredOutput] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(StructuredOutput("json_object", "", "response_format"))
        elif rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
            found.append(
                StructuredOutput.json_schema(
                    rf.json_schema.schema_, "response_format.json_schema.schema"
                )
            )
        if self.structured_outputs is not None:
            found.append(self.structured_outputs.constraint())
        if self.guided_json is not None:
            found.append(StructuredOutput.json_schema(self.guided_json, "guided_json"))
        if self.guided_regex is not None:
            found.append(StructuredOutput("regex", self.guided_regex, "guided_regex"))
        if self.guided_choice is not None:
            found.append(StructuredOutput.choice(self.guided_choice, "guided_choice"))
        if self.guided_grammar is not None:
            found.append(StructuredOutput("grammar", self.guided_grammar, "guided_grammar"))
        if len(found) > 1:
            raise ValueError(f"{found[1].field_name}: only one output constraint per request")
        return found[0] if found else None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: object) -> object:
        if v is None:
            return []
        return [v] if isinstance(v, str) else v


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    # Tools belong to chat: here only their neutral values pass.
    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_UNSUPPORTED,
        "tools": (None, []),
        "tool_choice": (None, "none"),
        "parallel_tool_calls": (None,),
    }

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False

    @property
    def asked_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def echo_logprobs(self) -> bool:
        """echo with logprobs: the prompt's tokens lead the logprobs (from its prefill)."""
        return self.echo and self.logprobs is not None

    @property
    def asked_prompt_logprobs(self) -> int | None:
        if self.echo_logprobs:
            return max(self.logprobs or 0, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: Any) -> Any:
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
            return [cast(list[int], list(p))]
        return cast(list[str | list[int]], list(p))


def count_parts(items: list[Any], keys: tuple[str, ...]) -> int:
    """List-valued parts (content parts, tool calls, ...) over a raw JSON list of objects."""
    return sum(
        len(item[key])
        for item in items
        if isinstance(item, dict)
        for key in keys
        if isinstance(item.get(key), list)
    )


def bounded_messages(data: Any, info: ValidationInfo) -> Any:
    """A body's messages counted on the raw JSON, before a single message is validated."""
    messages = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(messages, list):
        return data
    limit = (info.context or {}).get("max_messages", MAX_MESSAGES)
    if len(messages) > limit:
        raise ValueError(f"messages: at most {limit} messages, got {len(messages)}")
    parts = count_parts(messages, ("content", "tool_calls"))
    if parts > MAX_MESSAGE_PARTS:
        raise ValueError(
            f"messages: at most {MAX_MESSAGE_PARTS} content parts and tool calls over all "
            f"messages, got {parts}"
        )
    return data


class ImageURL(BaseModel):
    url: str  # a data: URL, or http(s) from allowed_media_domains; bounded where it is decoded
    # Accepted as OpenAI defines it; the model's image processor decides the resolution.
    detail: Literal["auto", "low", "high"] | None = None


class ContentPart(BaseModel):
    """A text part, or an image part (a vision model's: deploy/image_parts.py decodes it). One
    model for both, as deploy/fields.py walks one nested model per field."""

    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageURL | None = None

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> ContentPart:
        if self.type == "text" and (self.text is None or self.image_url is not None):
            raise ValueError("text: a text part holds `text` (and no image_url)")
        if self.type == "image_url" and (self.image_url is None or self.text is not None):
            raise ValueError("image_url: an image_url part holds `image_url` (and no text)")
        return self


class ChatMessage(BaseModel):
    # What the openai client writes back when a reply's message object is appended as it is.
    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {
        "refusal": (None,),
        "annotations": (None, []),
        "audio": (None,),
        "function_call": (None,),
        "reasoning_content": (None,),
    }
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(default=None, max_length=256)

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text or "" for part in self.content)
        return self.content or ""

    @property
    def num_images(self) -> int:
        if not isinstance(self.content, list):
            return 0
        return sum(part.type == "image_url" for part in self.content)


class ChatTemplateFields(BaseModel):
    """vLLM's fields for how the chat template renders a conversation (chat and /tokenize); the
    conversation's `messages` are counted on the raw body before any is validated."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _bounded_messages(cls, data: Any, info: ValidationInfo) -> Any:
        return bounded_messages(data, info)

    @model_validator(mode="after")
    def _chat_options_valid(self) -> ChatTemplateFields:
        self.chat_options()
        return self

    def chat_options(self) -> ChatOptions:
        """How the conversation is rendered (ValueError naming the field when it cannot be)."""
        return ChatOptions(
            self.add_generation_prompt,
            self.continue_final_message,
            dict(self.chat_template_kwargs or {}),
        )


class ChatCompletionRequest(_SamplingFields, ChatTemplateFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice: no tool named {choice.function.name!r} in tools")
        if choice == "required" and not names:
            raise ValueError("tool_choice: `required` needs at least one tool")
        return self

    @property
    def tool_choice_name(self) -> str:
        """ "none", "auto", "required" or the forced function's name (OpenAI's defaults applied)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice or ("auto" if self.tools else "none")

    @property
    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    @property
    def asked_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def asked_logprobs(self) -> int | None:
        # top_logprobs is bounded even while logprobs is off.
        return self.top_logprobs if self.top_logprobs is not None else self.num_logprobs

    def field_name(self, name: str) -> str:
        if name == "logprobs":
            return "top_logprobs"
        if name == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return name
