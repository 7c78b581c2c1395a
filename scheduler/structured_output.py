"""The output constraint a request carries: plain text, picklable, compiled only where it is used.

It crosses Ray boundaries inside SamplingParams, so it holds the constraint's source text and
never a compiled grammar; each worker process compiles and caches it (workers.structured).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 200_000  # a schema or grammar past this is an attack, not a use
MAX_CHOICES = 1024


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """kind: one of KINDS; spec: schema JSON text, regex, Lark/EBNF grammar, or JSON list of
    choices."""

    kind: str
    spec: str = ""
    field_name: str = "structured_outputs"  # the request field it came from, named in errors
    # A token id: the constraint applies to the output after its first occurrence (the end of a
    # reasoning block); the output before it is free. None: from the first output token.
    after: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(
                f"{self.field_name}: kind must be one of {list(KINDS)}, got {self.kind!r}"
            )
        if not isinstance(self.spec, str) or len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(
                f"{self.field_name}: must be text of at most {MAX_SPEC_CHARS} characters"
            )
        if self.after is not None and (
            not isinstance(self.after, int) or isinstance(self.after, bool) or self.after < 0
        ):
            raise ValueError(f"{self.field_name}: after must be a token id, got {self.after!r}")
        if self.kind != "json_object" and not self.spec:
            raise ValueError(f"{self.field_name}: the {self.kind} must not be empty")

    @classmethod
    def json_schema(
        cls, schema: Any, field_name: str = "structured_outputs.json"
    ) -> StructuredOutput:
        """From a schema object (dict or bool) or its JSON text."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{field_name}: not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"{field_name}: a JSON schema must be an object")
        return cls("json_schema", json.dumps(schema, sort_keys=True), field_name)

    @classmethod
    def choice(
        cls, choices: Any, field_name: str = "structured_outputs.choice"
    ) -> StructuredOutput:
        """Output exactly one of `choices` (non-empty strings)."""
        if (
            not isinstance(choices, list)
            or not 0 < len(choices) <= MAX_CHOICES
            or not all(isinstance(c, str) and c for c in choices)
        ):
            raise ValueError(
                f"{field_name}: must be a list of 1 to {MAX_CHOICES} non-empty strings"
            )
        return cls("choice", json.dumps(choices), field_name)

    @property
    def choices(self) -> list[str]:
        return json.loads(self.spec) if self.kind == "choice" else []
