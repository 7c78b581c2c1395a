"""Structural bounds on a client's constraint, checked in Python before any native grammar call.

llguidance recurses once per rule or `$ref` link while it validates, and expands counted
repetitions (`a{1000}{1000}` is a million-state regex) before it meters its own work, so the
shape of a spec, not only its length, decides what checking it costs. These bounds sit well above
what real schemas, regexes and grammars use and well below what hurts: each is ValueError naming
the field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from scheduler.structured_output import StructuredOutput

MAX_GRAMMAR_RULES = 1_000  # rules of a Lark grammar (and `$defs` of a schema)
MAX_SCHEMA_DEPTH = 64  # nesting of a JSON schema document, `$ref` links followed included
MAX_REGEX_EXPANSION = 20_000  # atoms of one regex once counted repetitions are expanded
MAX_TOTAL_EXPANSION = 200_000  # the same, summed over every regex and repetition of one spec
MAX_REPEAT_COUNT = 100_000  # the largest count written in a repetition

_LARK_RULE = re.compile(r"^\s*[?!]?([a-z_][a-z0-9_]*)(\.-?\d+)?\s*:", re.MULTILINE)
_LARK_REGEX = re.compile(r"/((?:[^/\\\n]|\\.)+)/[imslux]*")
_LARK_REPEAT = re.compile(r"~\s*(\d+)(?:\s*\.\.\s*(\d+))?")
_REPEAT = re.compile(r"\{(\d*)(?:(,)(\d*))?\}")
_STRING_LENGTHS = ("minLength", "maxLength")


def check_bounds(constraint: StructuredOutput) -> None:
    """ValueError naming the constraint's field if its shape is past the bounds."""
    field_name = constraint.field_name
    if constraint.kind == "regex":
        _check_total(regex_expansion(constraint.spec, field_name), field_name)
    elif constraint.kind == "grammar":
        _check_lark(constraint.spec, field_name)
    elif constraint.kind == "json_schema":
        _check_schema(json.loads(constraint.spec), field_name)


def regex_expansion(pattern: str, field_name: str) -> int:
    """How many atoms the regex has once counted repetitions are written out (alternatives are
    summed: all of them are built). ValueError if one regex is past MAX_REGEX_EXPANSION."""
    total = _Expansion(pattern, field_name).size()
    if total > MAX_REGEX_EXPANSION:
        raise ValueError(
            f"{field_name}: a regex expands to {total} atoms once its counted repetitions are "
            f"written out (at most {MAX_REGEX_EXPANSION}); nest fewer {{n}} counts"
        )
    return total


class _Expansion:
    """A one-pass scan of a regex: a stack of open groups, each the size of its body so far and
    of its last atom (the one a quantifier multiplies)."""

    def __init__(self, pattern: str, field_name: str) -> None:
        self.pattern, self.field_name, self.i = pattern, field_name, 0
        self.stack: list[list[int]] = [[0, 0]]  # [body size, last atom size] per open group

    def size(self) -> int:
        p = self.pattern
        while self.i < len(p):
            c = p[self.i]
            self.i += 1
            if c == "\\":
                self._atom(1)
                self._skip_escape()
            elif c == "[":
                self._skip_class()
                self._atom(1)
            elif c == "(":
                self.stack.append([0, 0])
            elif c == ")" and len(self.stack) > 1:
                body, _ = self.stack.pop()
                self._atom(max(body, 1))
            elif c == "|":
                self.stack[-1][1] = 0
            elif c == "{" and (m := _REPEAT.match(p, self.i - 1)) and (m.group(1) or m.group(3)):
                self.i = m.end()
                self._repeat(_count(m.group(1), self.field_name), m.group(2), m.group(3))
            elif c not in "*+?":
                self._atom(1)
        return sum(body for body, _ in self.stack)

    def _atom(self, size: int) -> None:
        top = self.stack[-1]
        top[0] += size
        top[1] = size

    def _repeat(self, low: int, comma: str | None, high_text: str | None) -> None:
        high = _count(high_text, self.field_name) if high_text else (low + 1 if comma else low)
        top = self.stack[-1]
        grown = top[1] * max(high, 1)
        top[0] += grown - top[1]
        top[1] = grown
        if top[0] > MAX_REGEX_EXPANSION:  # stop before a nested bomb builds a huge integer
            raise ValueError(
                f"{self.field_name}: a regex expands past {MAX_REGEX_EXPANSION} atoms once its "
                "counted repetitions are written out; nest fewer {n} counts"
            )

    def _skip_escape(self) -> None:
        p = self.pattern
        if self.i < len(p) and p[self.i] in "pPxuN" and p[self.i + 1 : self.i + 2] == "{":
            end = p.find("}", self.i)
            self.i = len(p) if end < 0 else end + 1
        else:
            self.i += 1

    def _skip_class(self) -> None:
        p, i = self.pattern, self.i
        if i < len(p) and p[i] == "^":
            i += 1
        if i < len(p) and p[i] == "]":
            i += 1
        while i < len(p) and p[i] != "]":
            i += 2 if p[i] == "\\" else 1
        self.i = i + 1


def _count(text: str | None, field_name: str) -> int:
    if not text:
        return 0
    if len(text) > 6 or int(text) > MAX_REPEAT_COUNT:
        raise ValueError(f"{field_name}: a repetition count is past {MAX_REPEAT_COUNT}")
    return int(text)


def _check_total(total: int, field_name: str) -> None:
    if total > MAX_TOTAL_EXPANSION:
        raise ValueError(
            f"{field_name}: its regexes and repetitions expand to {total} atoms in all "
            f"(at most {MAX_TOTAL_EXPANSION})"
        )


def _check_lark(grammar: str, field_name: str) -> None:
    rules = len(_LARK_RULE.findall(grammar))
    if rules > MAX_GRAMMAR_RULES:
        raise ValueError(
            f"{field_name}: the grammar has {rules} rules (at most {MAX_GRAMMAR_RULES})"
        )
    total = sum(regex_expansion(m.group(1), field_name) for m in _LARK_REGEX.finditer(grammar))
    for m in _LARK_REPEAT.finditer(grammar):
        total += max(_count(m.group(1), field_name), _count(m.group(2), field_name))
    _check_total(total, field_name)


def _check_schema(schema: Any, field_name: str) -> None:
    definitions = 0
    total = 0
    for node in _schema_nodes(schema, field_name):
        for key in ("$defs", "definitions"):
            if isinstance(node.get(key), dict):
                definitions += len(node[key])
        if isinstance(node.get("pattern"), str):
            total += regex_expansion(node["pattern"], field_name)
        if isinstance(node.get("patternProperties"), dict):
            total += sum(regex_expansion(k, field_name) for k in node["patternProperties"])
        for key in _STRING_LENGTHS:
            if isinstance(node.get(key), int) and not isinstance(node.get(key), bool):
                total += min(node[key], MAX_TOTAL_EXPANSION + 1)
    if definitions > MAX_GRAMMAR_RULES:
        raise ValueError(
            f"{field_name}: the schema has {definitions} definitions (at most {MAX_GRAMMAR_RULES})"
        )
    _check_total(total, field_name)
    _check_ref_depth(schema, field_name)


def _schema_nodes(schema: Any, field_name: str) -> Iterator[dict]:
    """Every object of the schema document, without recursion; ValueError past
    MAX_SCHEMA_DEPTH."""
    pending: list[tuple[Any, int]] = [(schema, 1)]
    while pending:
        value, depth = pending.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"{field_name}: the schema nests deeper than {MAX_SCHEMA_DEPTH}")
        children = value.values() if isinstance(value, dict) else value
        if isinstance(value, dict):
            yield value
        if isinstance(value, (dict, list)):
            pending.extend((child, depth + 1) for child in children)


def _check_ref_depth(schema: Any, field_name: str) -> None:
    """The longest chain of local `$ref`s, each entered inside the last, must stay within
    MAX_SCHEMA_DEPTH. A cycle is cut where it repeats: a recursive schema is as deep as one
    unrolling. Iterative, since the chain itself is what must not recurse."""
    if not isinstance(schema, dict):
        return
    targets = _local_definitions(schema)
    depth_of: dict[str, int] = {}
    for start in targets:
        if start in depth_of:
            continue
        stack: list[tuple[str, list[str]]] = [(start, list(_refs_in(targets[start])))]
        on_path = {start}
        while stack:
            name, refs = stack[-1]
            while refs and (refs[-1] not in targets or refs[-1] in on_path or refs[-1] in depth_of):
                refs.pop()
            if refs:
                child = refs.pop()
                stack.append((child, list(_refs_in(targets[child]))))
                on_path.add(child)
                if len(stack) > MAX_SCHEMA_DEPTH:
                    raise ValueError(
                        f"{field_name}: the schema's $ref chain is deeper than {MAX_SCHEMA_DEPTH}"
                    )
                continue
            stack.pop()
            on_path.discard(name)
            children = [depth_of.get(r, 0) for r in _refs_in(targets[name]) if r in targets]
            depth_of[name] = 1 + max(children, default=0)
            if depth_of[name] > MAX_SCHEMA_DEPTH:
                raise ValueError(
                    f"{field_name}: the schema's $ref chain is deeper than {MAX_SCHEMA_DEPTH}"
                )


def _local_definitions(schema: dict) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key in ("$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            found.update({f"#/{key}/{name}": sub for name, sub in schema[key].items()})
    return found


def _refs_in(node: Any) -> Iterator[str]:
    pending = [node]
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            ref = value.get("$ref")
            if isinstance(ref, str):
                yield ref
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
