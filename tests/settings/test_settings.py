"""Settings declared once: a config tree is built from a mapping, and every unknown key or bad value
is refused with its path."""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.config import RoutingConfig
from scheduler.config import SchedulerConfig
from settings import build, check_settings, declared_settings, nest, setting


@dataclass(slots=True)
class Leaf:
    size: int = setting(4, "a size", ge=1)
    ratio: float = setting(0.5, "a ratio", ge=0, le=1)
    mode: str = setting("a", "a mode", choices=("a", "b"))
    name: str | None = setting(None, "a name")

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(slots=True)
class Profile:
    owner: str = setting(MISSING, "who")
    level: int = setting(0, "how high", ge=0, le=9)

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(slots=True)
class Middle:
    depth: int = setting(1, "a depth", ge=0)
    leaf: Leaf = field(default_factory=Leaf)

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(slots=True)
class Root:
    middle: Middle = field(default_factory=Middle)
    label: str = setting("root", "a label")
    extra: Leaf | None = setting(None, "an optional section, never filled by flat keys")
    profiles: dict[str, Profile] | None = setting(None, "named profiles")

    def __post_init__(self) -> None:
        check_settings(self)


def test_a_mapping_builds_the_whole_tree():
    root = build(Root, {"label": "x", "middle": {"depth": 3, "leaf": {"size": 7, "ratio": 1}}})
    assert root.middle == Middle(depth=3, leaf=Leaf(size=7, ratio=1.0))
    assert isinstance(root.middle.leaf.ratio, float)  # an int given for a float becomes one
    assert build(Root, None) == Root()
    assert build(Root, root) is root


@pytest.mark.parametrize(
    "data, message",
    [
        ({"middle": {"leaf": {"size": 0}}}, r"^middle\.leaf\.size: must be >= 1, got 0$"),
        ({"middle": {"leaf": {"sise": 2}}}, r"^middle\.leaf\.sise: unknown setting; known: \["),
        ({"middle": {"leaf": {"mode": "c"}}}, r"^middle\.leaf\.mode: must be one of \['a', 'b'\]"),
        ({"middle": {"leaf": {"ratio": math.nan}}}, r"^middle\.leaf\.ratio: must be finite"),
        ({"middle": {"leaf": {"ratio": 10**400}}}, r"^middle\.leaf\.ratio: must be finite"),
        ({"middle": {"leaf": {"size": 2**64}}}, r"^middle\.leaf\.size: must fit in 64 bits"),
        ({"middle": {"leaf": {"size": 2.0}}}, r"^middle\.leaf\.size: must be an integer"),
        ({"middle": {"leaf": {"size": True}}}, r"^middle\.leaf\.size: must be an integer"),
        ({"middle": {"leaf": 3}}, r"^middle\.leaf: must be a mapping, got 3$"),
        ({"middle": "deep"}, r"^middle: must be a mapping"),
        ({"label": 5}, r"^label: must be a string, got 5$"),
        ({"extra": {"size": -1}}, r"^extra\.size: must be >= 1"),
        ({"profiles": {"secret-key": {"level": 1}}}, r"^profiles\[0\]\.owner: required$"),
        ({"profiles": {"k": {"owner": "o", "level": 10}}}, r"^profiles\[0\]\.level: must be <= 9"),
        ({"profiles": {1: {"owner": "o"}}}, r"^profiles: keys must be strings$"),
        ({"profiles": ["o"]}, r"^profiles: must be a mapping"),
    ],
)
def test_a_bad_key_or_value_is_named_by_its_path(data, message):
    with pytest.raises(ValueError, match=message) as raised:
        build(Root, data)
    assert "secret-key" not in str(raised.value)  # entries are named by position, keys may be keys


def test_a_huge_value_is_quoted_short():
    with pytest.raises(ValueError) as raised:
        build(Root, {"middle": {"leaf": {"mode": "x" * 10_000_000}}})
    assert len(str(raised.value)) < 200
    with pytest.raises(ValueError, match="unknown setting") as raised:
        build(Root, {"y" * 10_000_000: 1})
    assert len(str(raised.value)) < 300


def test_direct_construction_checks_the_same_way():
    with pytest.raises(ValueError, match=r"^leaf\.size: must be >= 1"):
        Middle(leaf={"size": 0})  # type: ignore[arg-type]
    assert Middle(leaf={"size": 2}).leaf == Leaf(size=2)  # type: ignore[arg-type]


def test_flat_keys_land_in_the_section_that_declares_them():
    assert nest(Root, {"size": 2, "depth": 5, "label": "x"}) == {
        "label": "x",
        "middle": {"depth": 5, "leaf": {"size": 2}},
    }
    # A section named flat merges with flat keys; flat keys win.
    tree = nest(Root, {"leaf": {"size": 3, "mode": "b"}, "size": 9, "middle": {"depth": 2}})
    assert build(Root, tree).middle == Middle(depth=2, leaf=Leaf(size=9, mode="b"))
    # A config instance counts as its fields; an optional section takes no flat keys.
    tree = nest(Root, {"middle": Middle(depth=4), "depth": 6})
    assert build(Root, tree).middle == Middle(depth=6)
    assert "extra" not in nest(Root, {"size": 2})
    # Unknown keys stay where build names them.
    with pytest.raises(ValueError, match="^sise: unknown setting"):
        build(Root, nest(Root, {"sise": 2}))


def test_a_name_declared_twice_in_a_tree_is_refused():
    @dataclass(slots=True)
    class Twice:
        size: int = setting(1, "clashes with Leaf.size")
        leaf: Leaf = field(default_factory=Leaf)

    with pytest.raises(TypeError, match="size: declared twice"):
        nest(Twice, {})


HOSTILE = [2**64, -(2**64), -1, 0, math.nan, math.inf, -math.inf, 10**400, 1e308, "x" * 10_000_000]


@given(
    st.sampled_from([SchedulerConfig, RoutingConfig]).flatmap(
        lambda cls: st.tuples(
            st.just(cls),
            st.sampled_from([f.name for f in declared_settings(cls)]),
            st.one_of(st.sampled_from(HOSTILE), st.integers(), st.floats(), st.text(max_size=8)),
        )
    )
)
def test_any_value_of_any_setting_is_taken_or_refused_by_name(case):
    cls, name, value = case
    try:
        config = build(cls, {name: value}, "at.")
    except ValueError as exc:
        assert str(exc).startswith(f"at.{name}: ")
        assert len(str(exc)) < 1000
        return
    kept = getattr(config, name)
    assert type(kept) in (int, float, bool, str, type(None))
    assert kept == (float(value) if isinstance(kept, float) else value)  # an int given for a float


@dataclass(frozen=True, slots=True)
class Frozen:
    rate: float = setting(1.0, "a rate", gt=0)
    where: str | None = setting(None, "a file", path=True)

    def __post_init__(self) -> None:
        check_settings(self)


def test_a_frozen_config_takes_an_int_for_a_float_as_a_float():
    made = Frozen(rate=2)
    assert made.rate == 2.0 and type(made.rate) is float


@pytest.mark.parametrize(
    "where", ["", "a\0b", "x" * 4097, "x" * 10_000_000], ids=["empty", "nul", "long", "huge"]
)
def test_a_path_setting_refuses_what_names_no_file(where):
    with pytest.raises(
        ValueError, match=r"^where: must be a path of 1 to 4096 characters without NUL, got"
    ) as raised:
        Frozen(where=where)
    assert len(str(raised.value)) < 200


def test_a_path_setting_takes_a_path():
    assert Frozen(where="/tmp/x" + "y" * 4000).where == "/tmp/x" + "y" * 4000
    with pytest.raises(ValueError, match="^where: must be a string"):
        Frozen(where=2**64)  # type: ignore[arg-type]
