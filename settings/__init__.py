"""Settings declared once: each dataclass field carries its default, its range and its doc.

Every config of the tree (AppConfig > EngineConfig > SchedulerConfig, RoutingConfig) is a dataclass
whose fields are declared with `setting(...)`, or are sections: fields typed as another config.
- `check_settings(obj)`, called by each config's `__post_init__`, validates an instance against
  those declarations (type, finiteness, range, choices) and builds sections given as mappings.
- `build(cls, mapping)` makes a config from a mapping (a YAML section, request_router_kwargs): an
  unknown key or a bad value raises a ValueError naming its path, e.g.
  `engine.scheduler.max_num_seqs: must be >= 1, got 0`.
- `nest(cls, flat)` moves flat keys (`max_num_seqs: 32`) into the section that declares them.
The same metadata renders the configuration table, so docs cannot drift from code.
"""

from __future__ import annotations

import difflib
import functools
import math
import types
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass
from typing import (
    TYPE_CHECKING,
    Any,
    TypeGuard,
    TypeVar,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

C = TypeVar("C", bound="DataclassInstance")  # a setting() dataclass

# Every integer setting reaches Ray, Serve or torch, which hold it in 64 bits.
INT_LIMIT = 2**63
PATH_MAX = 4096  # Linux's: the longest path a `path` setting may name
# Error messages quote at most this much of a bad value (a 10 MB string is not echoed back).
_SHOWN_CHARS = 80


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
    path: bool = False,
) -> Any:
    """A config field with its range and doc; `derived` says what fills it in when left unset;
    `path`: a string setting that names a file or directory (1 to PATH_MAX characters, no NUL).
    A `default` of dataclasses.MISSING makes the setting required."""
    meta = {
        "doc": doc,
        "ge": ge,
        "gt": gt,
        "le": le,
        "lt": lt,
        "choices": choices,
        "derived": derived,
        "path": path,
    }
    return field(default=default, metadata=meta)


def clipped(text: str) -> str:
    """text, cut short."""
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def shown(value: Any) -> str:
    """repr(value), cut short."""
    return clipped(repr(value))


@dataclass(frozen=True, slots=True)
class _Kind:
    """What a field's annotation allows: a base type (int, float, bool, str, dict, a config class or
    None for anything), whether None is allowed, and the config class of a dict's values."""

    base: type | None
    optional: bool
    item: type | None = None


def is_config(tp: object) -> TypeGuard[type[DataclassInstance]]:
    """A config class: a dataclass, as every config of the tree is."""
    return isinstance(tp, type) and is_dataclass(tp)


def _kind(hint: Any) -> _Kind:
    optional = False
    if get_origin(hint) in (Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        optional = len(args) < len(get_args(hint))
        hint = args[0] if len(args) == 1 else Any
    if get_origin(hint) is dict:
        value_type = get_args(hint)[1] if get_args(hint) else Any
        return _Kind(dict, optional, value_type if is_config(value_type) else None)
    return _Kind(hint if isinstance(hint, type) else None, optional)


@functools.cache
def _checked_fields(cls: type) -> tuple[tuple[Field, _Kind], ...]:
    """The declared settings and the sections of a config class, with what each allows."""
    hints = get_type_hints(cls)
    out = []
    for f in fields(cls):
        kind = _kind(hints[f.name])
        if "doc" in f.metadata or (is_config(kind.base) and not kind.optional):
            out.append((f, kind))
    return tuple(out)


def _type_error(value: Any, base: type | None) -> str | None:
    if base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return None if -INT_LIMIT <= value < INT_LIMIT else "must fit in 64 bits"
        return "must be an integer"
    if base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return "must be a number"
        try:
            return None if math.isfinite(value) else "must be finite"
        except OverflowError:  # an int past the float range
            return "must be finite"
    if base is bool:
        return None if isinstance(value, bool) else "must be true or false"
    if base is str:
        return None if isinstance(value, str) else "must be a string"
    if base is dict:
        return None if isinstance(value, Mapping) else "must be a mapping"
    return None  # runtime objects check themselves


def _range_error(value: Any, meta: Mapping[str, Any]) -> str | None:
    if meta.get("choices") is not None and value not in meta["choices"]:
        return f"must be one of {list(meta['choices'])}"
    if meta.get("path") and not (0 < len(value) <= PATH_MAX and "\0" not in value):
        return f"must be a path of 1 to {PATH_MAX} characters without NUL"
    for key, ok, word in (
        ("ge", lambda b: value >= b, ">="),
        ("gt", lambda b: value > b, ">"),
        ("le", lambda b: value <= b, "<="),
        ("lt", lambda b: value < b, "<"),
    ):
        bound = meta.get(key)
        if bound is not None and not ok(bound):
            return f"must be {word} {bound}"
    return None


def _checked(f: Field, kind: _Kind, value: Any) -> Any:
    """The field's value once valid (a section built from its mapping, an int made a float)."""
    section = kind.base
    if is_config(section):
        if isinstance(value, (section, Mapping)):
            return build(section, value, f"{f.name}.")
        raise ValueError(f"{f.name}: must be a mapping, got {shown(value)}")
    problem = _type_error(value, kind.base) or _range_error(value, f.metadata)
    if problem:
        raise ValueError(f"{f.name}: {problem}, got {shown(value)}")
    if kind.base is dict:
        return _checked_mapping(f, kind, value)
    return float(value) if kind.base is float else value


def _checked_mapping(f: Field, kind: _Kind, value: Mapping[str, Any]) -> dict[str, Any]:
    """A mapping setting: string keys, each value a config when the annotation says so."""
    if any(not isinstance(key, str) for key in value):
        raise ValueError(f"{f.name}: keys must be strings")
    if kind.item is None:
        return dict(value)
    # Entries are named by position: a key may be a secret (api_keys).
    items = enumerate(value.items())
    return {key: build(kind.item, item, f"{f.name}[{i}].") for i, (key, item) in items}


def check_settings(obj: Any) -> None:
    """Validate every declared setting and section of a config instance, naming the field of the
    first bad value; sections given as mappings become configs, ints given for floats floats."""
    cls: type = type(obj)
    for f, kind in _checked_fields(cls):
        value = getattr(obj, f.name)
        if value is None and kind.optional:
            continue
        checked = _checked(f, kind, value)
        if checked is not value:  # a frozen config is still being built: it may set its own
            object.__setattr__(obj, f.name, checked)


def build(cls: type[C], data: Mapping[str, Any] | C | None, path: str = "") -> C:
    """The config `cls` from a mapping, its sections from nested mappings (an instance passes as
    it is, None gives the defaults). A ValueError names the path of an unknown key, a missing
    required one or a bad value: `path` prefixes what `cls` names."""
    if isinstance(data, cls):
        return data
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        where = path.removesuffix(".") or cls.__name__
        raise ValueError(f"{where}: must be a mapping, got {shown(data)}")
    _check_keys(cls, data, path)
    try:
        return cls(**data)
    except ValueError as exc:
        raise ValueError(f"{path}{exc}") from None


def _check_keys(cls: type, data: Mapping[str, Any], path: str) -> None:
    """Every key of data a setting of cls, every required setting given."""
    params = {f.name: f for f in fields(cls) if f.init}
    for key in data:
        if key not in params:
            name = clipped(key) if isinstance(key, str) else shown(key)
            raise ValueError(f"{path}{name}: unknown setting; {_known(cls, key)}")
    for name, f in params.items():
        if name not in data and f.default is MISSING and f.default_factory is MISSING:
            raise ValueError(f"{path}{name}: required")


def _known(cls: type, key: Any) -> str:
    """The settings nearest an unknown key, from every section of cls's tree (flat names, and
    `section.name` inside an optional section); all of this level's where none is near."""
    near = difflib.get_close_matches(str(key)[:_SHOWN_CHARS], _tree_names(cls), n=4, cutoff=0.6)
    if near:
        return f"known: {near} are the nearest (every setting: docs/configuration.md)"
    return f"known: {sorted(f.name for f in fields(cls) if f.init)}"


@functools.cache
def _tree_names(cls: type) -> list[str]:
    names = [f.name for f in fields(cls) if f.init] + list(_names_below(cls))
    for f, kind in _checked_fields(cls):
        if is_config(kind.base) and kind.optional:
            names += [f"{f.name}.{name}" for name in _tree_names(kind.base)]
    return names


def nest(cls: type, flat: Mapping[str, Any]) -> dict[str, Any]:
    """`flat` for `build(cls, ...)`: a key declared in a section (at any depth) moves into it, so
    `max_num_seqs` lands in `engine.scheduler`. A section may also be named, with a mapping or a
    config: its entries merge with the flat keys, which win. Unknown keys stay for `build` to
    name."""
    return _nest(cls, flat.items())


def _nest(cls: type, items: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    sections = _sections(cls)
    below = _names_below(cls)
    out: dict[str, Any] = {}
    parts: dict[str, list[tuple[str, Any]]] = {}
    for key, value in items:
        if key in sections and (value is None or isinstance(value, (Mapping, sections[key]))):
            parts.setdefault(key, [])[:0] = _entries(value)
        elif key in below:
            parts.setdefault(below[key], []).append((key, value))
        else:
            out[key] = value
    for name, entries in parts.items():
        out[name] = _nest(sections[name], entries)
    return out


def _entries(value: Any) -> list[tuple[str, Any]]:
    if value is None:
        return []
    if isinstance(value, Mapping):
        return list(value.items())
    return [(f.name, getattr(value, f.name)) for f in fields(value) if f.init]


@functools.cache
def _sections(cls: type) -> dict[str, type]:
    """The sections that are always there (an optional one, like autoscaling, takes no flat
    keys)."""
    out: dict[str, type] = {}
    for f, kind in _checked_fields(cls):
        if is_config(kind.base) and not kind.optional:
            out[f.name] = kind.base
    return out


@functools.cache
def _names_below(cls: type) -> dict[str, str]:
    """Every field name declared under one of cls's sections, at any depth -> that section. A name
    declared twice in the tree would make a flat key ambiguous: TypeError."""
    out: dict[str, str] = {}
    seen = {f.name for f in fields(cls) if f.init}
    for section, section_cls in _sections(cls).items():
        for name in [f.name for f in fields(section_cls) if f.init] + list(
            _names_below(section_cls)
        ):
            if name in seen:
                raise TypeError(f"{name}: declared twice in the {cls.__name__} tree")
            seen.add(name)
            out[name] = section
    return out


def declared_settings(cls: type) -> list[Field]:
    """The fields of a config dataclass declared with `setting` (in declaration order)."""
    return [f for f in fields(cls) if "doc" in f.metadata]


def numeric_settings(cls: type) -> list[Field]:
    """The declared settings of a config class that hold a number (int or float, None allowed or
    not): those a range must bound."""
    return [
        f for f, kind in _checked_fields(cls) if "doc" in f.metadata and kind.base in (int, float)
    ]


def range_text(meta: Mapping[str, Any]) -> str:
    """A short human-readable range, e.g. ">= 1", "(0, 1]", "fcfs | priority | fair"."""
    if meta.get("choices"):
        return " \\| ".join(str(c) for c in meta["choices"])
    low, high = _bound(meta, ("ge", "gt")), _bound(meta, ("le", "lt"))
    if low and high:
        return f"{_BRACKETS[low[0]]}{low[1]}, {high[1]}{_BRACKETS[high[0]]}"
    bound = low or high
    return f"{_WORDS[bound[0]]}{bound[1]}" if bound else ""


_BRACKETS = {"ge": "[", "gt": "(", "le": "]", "lt": ")"}
_WORDS = {"ge": ">= ", "gt": "> ", "le": "<= ", "lt": "< "}


def _bound(meta: Mapping[str, Any], keys: tuple[str, str]) -> tuple[str, Any] | None:
    """The first of keys that meta bounds, with its bound."""
    for key in keys:
        if meta.get(key) is not None:
            return key, meta[key]
    return None
