"""The package contract: which package may import which, and which stay free of Ray and torch.

Every package is Ray-free or a Ray adapter, and imports point down the table of
docs/architecture.md. Every import counts, including those inside functions (a lazy `import ray`
in a Ray-free package is still a dependency on Ray).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> the project packages it may import (besides itself).
# settings/ (the declared-settings machinery) is stdlib only, and every package may use it.
MAY_IMPORT: dict[str, set[str]] = {
    "settings": set(),
    "scheduler": {"settings"},
    "router": {"settings", "scheduler"},
    "workers": {"settings", "scheduler"},
    "frontend": {"settings", "scheduler", "workers"},
    "engine": {"settings", "scheduler", "frontend", "workers"},
    "sim": {"settings", "scheduler", "router"},
    "cluster": {"settings", "scheduler", "router", "frontend", "engine", "workers"},
    "deploy": {"settings", "scheduler", "router", "frontend", "engine", "workers", "cluster"},
}
RAY_ADAPTERS = {"cluster", "deploy"}
# Third-party modules a package must never import.
NEVER: dict[str, set[str]] = {
    "settings": {"ray", "torch", "transformers", "fastapi", "starlette", "pydantic"},
    "scheduler": {"ray", "torch", "transformers", "fastapi", "starlette"},
    "router": {"ray", "torch", "transformers", "fastapi", "starlette", "pydantic"},
    "sim": {"ray", "torch", "transformers", "fastapi", "starlette", "pydantic"},
    "frontend": {"ray", "torch", "fastapi", "starlette"},
    # The GPU machines run the offline engine without the serving stack.
    "engine": {"ray", "fastapi", "starlette", "pydantic"},
    "workers": {"ray", "fastapi", "starlette", "pydantic"},
}
PROJECT = set(MAY_IMPORT) | {"tests", "bench"}


def imported_modules(path: Path) -> set[str]:
    """Top-level names of every module the file imports, at any depth of the code."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def package_files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_each_package_imports_only_what_the_contract_allows(package):
    allowed = MAY_IMPORT[package] | {package}
    never = NEVER.get(package, set())
    problems = []
    for path in package_files(package):
        for name in sorted(imported_modules(path)):
            if name in PROJECT and name not in allowed:
                problems.append(f"{path.relative_to(ROOT)} imports {name}")
            if name in never:
                problems.append(
                    f"{path.relative_to(ROOT)} imports {name}, which {package}/ must not"
                )
    assert not problems, "\n".join(problems)


def test_every_package_is_either_ray_free_or_a_ray_adapter():
    for package in MAY_IMPORT:
        uses_ray = any("ray" in imported_modules(p) for p in package_files(package))
        if package in RAY_ADAPTERS:
            assert uses_ray, f"{package}/ is listed as a Ray adapter but imports no Ray"
        else:
            assert not uses_ray, f"{package}/ is Ray-free by contract"
            assert package in NEVER and "ray" in NEVER[package]


def test_the_contract_names_every_package_of_the_project():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert packages == set(MAY_IMPORT), (
        "a new package needs its line in MAY_IMPORT (and docs/architecture.md)"
    )


def test_the_checker_sees_imports_inside_functions(tmp_path):
    module = tmp_path / "lazy.py"
    module.write_text("def f():\n    import ray.serve\n    from torch import nn\n")
    assert imported_modules(module) == {"ray", "torch"}
