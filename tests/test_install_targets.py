"""What `make` installs, read from make's own dry run into a venv that does not exist yet: `make
serve` only what serving needs, `make test` and `make lint` the test, bench and lint extras on
top, torch pinned and first (so that raylm's `torch>=2.5` finds it installed)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEV_EXTRAS = "-e '.[test,bench,lint]'"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def dry_run(target: str, venv: Path) -> list[str]:
    """The pip installs `make <target>` would run on a fresh machine, in order."""
    done = subprocess.run(
        ["make", "-n", target, f"VENV={venv}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return [line.strip() for line in done.stdout.splitlines() if "pip install" in line]


def test_make_serve_installs_no_test_bench_or_lint_extra(tmp_path):
    installs = dry_run("serve", tmp_path / "venv")
    assert any(line.endswith("pip install -q -e .") for line in installs), installs
    assert not [line for line in installs if re.search(r"\[[^]]*(test|bench|lint)", line)]


@pytest.mark.parametrize("target", ["test", "test-fast", "lint", "bench", "test-cluster-launch"])
def test_targets_that_run_tests_or_tools_add_the_dev_extras(tmp_path, target):
    installs = dry_run(target, tmp_path / "venv")
    assert any(line.endswith(DEV_EXTRAS) for line in installs), installs


def test_torch_is_pinned_and_installed_before_raylm(tmp_path):
    installs = dry_run("serve", tmp_path / "venv")
    torch = [i for i, line in enumerate(installs) if re.search(r"torch==\d+\.\d+\.\d+", line)]
    raylm = next(i for i, line in enumerate(installs) if line.endswith("-e ."))
    assert torch and max(torch) < raylm, installs
    # The CPU index is tried, and the same pin from the default index is the fallback.
    pins = {re.search(r"torch==[0-9.]+", installs[i])[0] for i in torch}
    assert len(pins) == 1
    assert any("--index-url" in installs[i] for i in torch)
    assert any("--index-url" not in installs[i] for i in torch)
