"""The parts of OpenAI request bodies that several endpoints share: output formats
(`response_format`, vLLM's `structured_outputs`), tool definitions and choices, an earlier turn's
tool calls, and stream options."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from scheduler.structured_output import StructuredOutput


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema: the schema the reply must follow."""

    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default=True, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("needs json_schema when type is json_schema")
        return self


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsField:
        kinds = ("json_", "regex", "choice", "grammar", "json_object")
        given = [k for k in kinds if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs: give exactly one of json, regex, choice, grammar, json_object"
            )
        return self

    def constraint(self) -> StructuredOutput:
        if self.json_ is not None:
            return StructuredOutput.json_schema(self.json_, "structured_outputs.json")
        if self.regex is not None:
            return StructuredOutput("regex", self.regex, "structured_outputs.regex")
        if self.choice is not None:
            return StructuredOutput.choice(self.choice, "structured_outputs.choice")
        if self.grammar is not None:
            return StructuredOutput("grammar", self.grammar, "structured_outputs.grammar")
        return StructuredOutput("json_object", "", "structured_outputs.json_object")


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str = Field(default="", max_length=8192)
    parameters: dict[str, Any] = Field(default_factory=dict)
    strict: bool | None = None


class ToolDefinition(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str = Field(max_length=64)


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(BaseModel):
    name: str = Field(max_length=64)
    arguments: str | dict[str, Any] = "{}"


class ToolCallMessage(BaseModel):
    """A call an assistant turn made earlier in the conversation."""

    id: str = Field(default="", max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class StreamOptions(BaseModel):
    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {"include_obfuscation": (None, False)}

    include_usage: bool = False
    # vLLM's extension (GuideLLM sends it): every chunk carries the usage so far.
    continuous_usage_stats: bool = False
