"""Which request fields a body may carry: the ones raylm implements, and nothing else.

A field the server does not implement (a typo, another server's extension, an OpenAI field raylm
lacks) would otherwise change nothing and say nothing. Every key of a body is checked against the
request model's own fields, nested models included, before the body is validated: under
`unknown_fields: reject` (the default) the first one is a 400 naming its path; under `ignore` they
are dropped and listed in a response header. A model may declare `NEUTRAL` values of fields it does
not implement that ask for nothing (`best_of: 1`, a message's `refusal: null`): those pass.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import quote

from pydantic import BaseModel

from deploy.errors import BadRequestError

UnknownFields = Literal["reject", "ignore"]
IGNORED_HEADER = "x-raylm-ignored-fields"
# The header lists this many paths at most (each at most MAX_SHOWN_CHARS), then a count of the
# rest: a body of 100,000 unknown keys gets a bounded header.
MAX_LISTED = 32
MAX_SHOWN_CHARS = 64


@dataclass(slots=True)
class Ignored:
    """The paths of the fields dropped from one body (under `unknown_fields: ignore`)."""

    paths: list[str] = field(default_factory=list)
    count: int = 0

    def add(self, path: str) -> None:
        self.count += 1
        if len(self.paths) < MAX_LISTED:
            self.paths.append(path)

    def header(self) -> dict[str, str]:
        """The response header naming what was ignored (none when nothing was); ASCII only, so a
        key with any character in it cannot break or forge a header line."""
        if not self.count:
            return {}
        shown = [quote(p[:MAX_SHOWN_CHARS], safe="._-[]") for p in self.paths]
        if self.count > len(shown):
            shown.append(f"+{self.count - len(shown)} more")
        return {IGNORED_HEADER: ", ".join(shown)}


def check_fields(data: dict[str, Any], model: type[BaseModel], mode: UnknownFields) -> Ignored:
    """Refuse (reject) or drop in place (ignore) every key `model` does not implement."""
    ignored = Ignored()
    stack: list[tuple[dict[str, Any], type[BaseModel], str]] = [(data, model, "")]
    while stack:  # iterative: the nesting depth is the models', not the body's
        obj, cls, path = stack.pop()
        if cls.model_config.get("extra") == "forbid":
            continue  # a strict model (the Responses API, embeddings) refuses unknowns itself
        known = _known(cls)
        neutral: dict[str, tuple[Any, ...]] = getattr(cls, "NEUTRAL", {})
        for key in list(obj):
            where = f"{path}{key}"
            if key in known:
                stack.extend(_children(obj[key], known[key], f"{where}."))
                continue
            if key in neutral and _is_neutral(obj[key], neutral[key]):
                del obj[key]  # asks for nothing: the model never sees it
                continue
            if mode == "reject":
                raise BadRequestError(_refusal(where, key in neutral), param=where[:256])
            del obj[key]
            ignored.add(where)
    return ignored


def _refusal(where: str, documented: bool) -> str:
    shown = where if len(where) <= MAX_SHOWN_CHARS else where[:MAX_SHOWN_CHARS] + "..."
    what = "not supported by this server" if documented else "unknown field"
    return f"{shown}: {what} (the server's unknown_fields setting is reject)"


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    return any(value == v and type(value) is type(v) for v in neutral)


def _children(
    value: Any, models: tuple[type[BaseModel], ...], prefix: str
) -> list[tuple[dict[str, Any], type[BaseModel], str]]:
    """The nested objects of one field's value that are themselves request models."""
    if not models:
        return []
    model = models[0]  # a field holds at most one request model (checked by _known)
    if isinstance(value, dict):
        return [(value, model, prefix)]
    if isinstance(value, list):
        return [(v, model, f"{prefix}{i}.") for i, v in enumerate(value) if isinstance(v, dict)]
    return []


_KNOWN: dict[type[BaseModel], dict[str, tuple[type[BaseModel], ...]]] = {}


def _known(cls: type[BaseModel]) -> dict[str, tuple[type[BaseModel], ...]]:
    """Each field name (and alias) of cls -> the request models its annotation holds."""
    if cls not in _KNOWN:
        known: dict[str, tuple[type[BaseModel], ...]] = {}
        for name, info in cls.model_fields.items():
            models = tuple(_models_in(info.annotation))
            if len(models) > 1:
                raise TypeError(f"{cls.__name__}.{name}: one nested model per field")
            known[name] = models
            if info.alias:
                known[info.alias] = models
        _KNOWN[cls] = known
    return _KNOWN[cls]


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The BaseModel classes inside an annotation (X | None, list[X], Literal | X), not inside
    dicts: a dict-typed field (a schema, tool parameters) is free-form JSON."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin in (dict, typing.Literal) or annotation is Any:
        return []
    if origin in (list, typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]
    return []
