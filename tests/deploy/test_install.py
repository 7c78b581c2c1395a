"""The GPU install path needs no compiler: what `ray up ray_config.yaml` installs, read from its
setup commands and pyproject.toml, holds no package that builds from source."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "raylm"
# Packages the index has no wheels for: pip compiles them (CUDA code, an hour or a failure).
SOURCE_ONLY = ("flash-attn", "mamba-ssm", "causal-conv1d", "deepspeed")
SETUP_KEYS = (
    "initialization_commands",
    "setup_commands",
    "head_setup_commands",
    "worker_setup_commands",
)
# pip install options that take a value (their value is not a requirement).
VALUE_OPTIONS = {"-r", "-c", "-i", "--index-url", "--extra-index-url", "-f", "--find-links"}
VALUE_OPTIONS |= {"--only-binary", "--no-binary", "-t", "--target", "--prefix", "--root"}


def pip_installs(commands: list[str]) -> list[list[str]]:
    """The arguments after `pip install` of each such command (`cd x && pip install ...` too)."""
    found = []
    for command in commands:
        for part in command.split("&&"):
            words = shlex.split(part)
            for i in range(1, len(words)):
                if words[i] == "install" and words[i - 1].rsplit("/", 1)[-1] in ("pip", "pip3"):
                    found.append(words[i + 1 :])
                    break
    return found


def requirements(args: list[str]) -> list[str]:
    """The requirement strings of one `pip install`'s arguments (`-e X` gives X)."""
    reqs, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in VALUE_OPTIONS:
            skip = True
        elif arg in ("-e", "--editable"):
            continue
        elif not arg.startswith("-"):
            reqs.append(arg)
    return reqs


def project_names(extras: set[str], pyproject: dict) -> set[str]:
    """Every distribution the project pulls with these extras (self-references followed)."""
    optional = pyproject["project"].get("optional-dependencies", {})
    names, todo, seen = set(), [*pyproject["project"]["dependencies"]], set()
    todo += [r for extra in extras for r in optional.get(extra, [])]
    while todo:
        req = Requirement(todo.pop())
        name = canonicalize_name(req.name)
        if name != PROJECT:
            names.add(name)
        for extra in req.extras - seen if name == PROJECT else ():
            seen.add(extra)
            todo += optional.get(extra, [])
    return names


def installed_names(config: dict, pyproject: dict) -> set[str]:
    """Every distribution the cluster's setup commands name, the project expanded by its extras.
    Markers are ignored: a source-only package counts whatever platform it is marked for."""
    commands = [c for key in SETUP_KEYS for c in config.get(key) or []]
    names = set()
    for args in pip_installs(commands):
        for spec in requirements(args):
            if spec.startswith(".") or spec.startswith("/") or spec.startswith("~"):
                extras = {e.strip() for e in spec.partition("[")[2].rstrip("]").split(",")}
                names |= project_names(extras - {""}, pyproject)
            else:
                names.add(canonicalize_name(Requirement(spec).name))
    return names


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def ray_config() -> dict:
    return yaml.safe_load((ROOT / "ray_config.yaml").read_text())


def test_the_cluster_setup_installs_no_source_only_package(ray_config, pyproject):
    names = installed_names(ray_config, pyproject)
    assert {"torch", "ray", "triton"} <= names  # the parse found the GPU path
    assert not names & set(SOURCE_ONLY)


def test_every_pip_install_of_the_cluster_setup_takes_wheels_only(ray_config):
    installs = pip_installs([c for key in SETUP_KEYS for c in ray_config.get(key) or []])
    assert installs
    for args in installs:
        assert "--only-binary=:all:" in args, args


def test_an_extra_that_builds_from_source_says_so_in_its_name(pyproject):
    for extra in pyproject["project"]["optional-dependencies"]:
        pulls = project_names({extra}, pyproject) - project_names(set(), pyproject)
        if pulls & set(SOURCE_ONLY):
            assert "source-build" in extra, (extra, sorted(pulls & set(SOURCE_ONLY)))


def test_the_check_catches_flash_attn_on_the_setup_path(pyproject):
    """The parse is not vacuous: the source-build extra, or flash-attn named directly, is caught."""
    for command in (
        "cd ~/raylm && python3 -m pip install -q -e '.[gpu,gpu-flash-attn-source-build]'",
        "pip install --no-build-isolation flash-attn==2.8.3",
    ):
        names = installed_names({"setup_commands": [command]}, pyproject)
        assert "flash-attn" in names, command
