"""Settings declared once: each dataclass field carries its default, its range and its doc.

`setting(...)` declares a field; `check_settings(obj)` validates an instance against those
declarations (type, finiteness, range, choices) and raises ValueError naming the field's path.
The same metadata renders the README's configuration table, so docs cannot drift from code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import Field, field, fields
from typing import Any


def setting(
    default: Any,
    doc: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: tuple[Any, ...] | None = None,
    derived: str | None = None,
) -> Any:
    """A config field with its range and doc; `derived` says what fills it in when left unset."""
    meta = {
        "doc": doc,
        "ge": ge,
        "gt": gt,
        "le": le,
        "lt": lt,
        "choices": choices,
        "derived": derived,
    }
    return field(default=default, metadata=meta)


def _type_error(value: Any, base: str) -> str | None:
    if base == "int":
        return (
            None if isinstance(value, int) and not isinstance(value, bool) else "must be an integer"
        )
    if base == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return "must be a number"
        return None if math.isfinite(value) else "must be finite"
    if base == "bool":
        return None if isinstance(value, bool) else "must be true or false"
    if base == "str":
        return None if isinstance(value, str) else "must be a string"
    return None  # nested configs and runtime objects check themselves


def _range_error(value: Any, meta: Mapping[str, Any]) -> str | None:
    if meta["choices"] is not None and value not in meta["choices"]:
        return f"must be one of {list(meta['choices'])}"
    for key, ok, word in (
        ("ge", lambda b: value >= b, ">="),
        ("gt", lambda b: value > b, ">"),
        ("le", lambda b: value <= b, "<="),
        ("lt", lambda b: value < b, "<"),
    ):
        bound = meta[key]
        if bound is not None and not ok(bound):
            return f"must be {word} {bound}"
    return None


def check_settings(obj: Any, prefix: str = "") -> None:
    """Validate every declared setting of a dataclass instance; ints given for floats become
    floats."""
    for f in fields(obj):
        if "doc" not in f.metadata:
            continue
        value = getattr(obj, f.name)
        type_name = str(f.type)
        if value is None and "None" in type_name:
            continue
        base = type_name.split("|")[0].strip()
        problem = _type_error(value, base) or _range_error(value, f.metadata)
        if problem:
            raise ValueError(f"{prefix}{f.name}: {problem}, got {value!r}")
        if base == "float" and isinstance(value, int):
            setattr(obj, f.name, float(value))


def declared_settings(cls: type) -> list[Field]:
    """The fields of a config dataclass declared with `setting` (in declaration order)."""
    return [f for f in fields(cls) if "doc" in f.metadata]


def range_text(meta: dict[str, Any]) -> str:
    """A short human-readable range, e.g. ">= 1", "(0, 1]", "fcfs | priority | fair"."""
    if meta.get("choices"):
        return " \\| ".join(str(c) for c in meta["choices"])
    low = (
        f"[{meta['ge']}"
        if meta.get("ge") is not None
        else f"({meta['gt']}"
        if meta.get("gt") is not None
        else None
    )
    high = (
        f"{meta['le']}]"
        if meta.get("le") is not None
        else f"{meta['lt']})"
        if meta.get("lt") is not None
        else None
    )
    if low and high:
        return f"{low}, {high}"
    if low:
        return (">= " if low[0] == "[" else "> ") + low[1:]
    if high:
        return ("<= " if high[-1] == "]" else "< ") + high[:-1]
    return ""
