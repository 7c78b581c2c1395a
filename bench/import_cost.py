"""Import cost of the modules a cold start imports: the ingress (deploy.ingress, what Serve's
ingress replica imports; deploy.app, what building the app imports), the replica (cluster.replica)
and the TP worker actors (cluster.ray_executor), each in a fresh interpreter.

Every run imports each module once per tree, interleaved (A, B, A, B ...), so a machine whose load
drifts charges both alike; CPU seconds (user + sys of the child) are the figure that load moves
least. With --baseline DIR (a checkout of another commit, e.g. `git archive <rev> | tar -x -C DIR`)
it prints this tree's medians over the baseline's. Bytecode is cached under --pycache (outside the
trees) and warmed first, as a replica finds it after its node's first start. With --model-config
each child also reads the default model's config and tokenizer (frontend ModelInfo.load), as the
ingress and the replica do next: transformers' config classes import its modeling code, so part
of what an import no longer loads is loaded there.

  python bench/import_cost.py --runs 5 --baseline /tmp/before [--model-config]

Prints medians and ratios; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = ("deploy.ingress", "deploy.app", "cluster.replica", "cluster.ray_executor")
PROBE = (
    "import importlib, sys; importlib.import_module(sys.argv[1])\n"
    "if sys.argv[2:]:\n"
    "    from engine.config import EngineConfig; from frontend.frontend import ModelInfo\n"
    "    ModelInfo.load(EngineConfig().model, EngineConfig().cache_dir)\n"
    "print(sum(m.split('.')[0] == 'torch' for m in sys.modules), "
    "sum(m.startswith('workers.models.') for m in sys.modules))"
)


def child_env(pycache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(pycache)
    return env


def import_once(
    tree: Path, module: str, env: dict[str, str], model_config: bool
) -> tuple[float, float, str]:
    """(CPU s, wall s, "torch modules / family modules") of importing module in a fresh process
    whose first sys.path entry is tree (python -c puts the working directory first)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", PROBE, module, *(["config"] if model_config else [])],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    torch_count, families = out.stdout.split()
    return cpu, wall, f"{torch_count} / {families}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--modules", nargs="+", default=list(MODULES))
    parser.add_argument("--baseline", type=Path, help="another checkout to compare against")
    parser.add_argument("--model-config", action="store_true", help="then ModelInfo.load")
    parser.add_argument("--pycache", type=Path, default=Path("/tmp/raylm-import-cost-pycache"))
    args = parser.parse_args()
    trees = {"this": ROOT} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    env = child_env(args.pycache)
    print(f"load average before: {os.getloadavg()}")
    for tree in trees.values():  # warm the bytecode cache
        for module in args.modules:
            import_once(tree, module, env, args.model_config)
    samples: dict[tuple[str, str], list[tuple[float, float, str]]] = {}
    for _ in range(args.runs):
        for module in args.modules:
            for name, tree in trees.items():
                samples.setdefault((name, module), []).append(
                    import_once(tree, module, env, args.model_config)
                )
    print(f"load average after: {os.getloadavg()}")
    report(samples, list(trees), args.modules)


def report(samples: dict, trees: list[str], modules: list[str]) -> None:
    header = "module | tree | CPU s (median) | CPU s (all) | wall s (median) | torch / families"
    print(f"| {header} |")
    print("| --- | --- | --- | --- | --- | --- |")
    for module in modules:
        for name in trees:
            rows = samples[(name, module)]
            cpus = [r[0] for r in rows]
            every = " ".join(f"{c:.2f}" for c in cpus)
            wall = statistics.median(r[1] for r in rows)
            print(
                f"| {module} | {name} | {statistics.median(cpus):.2f} | {every} | {wall:.2f} | "
                f"{rows[-1][2]} |"
            )
    if "baseline" not in trees:
        return
    for module in modules:
        this, base = (statistics.median(r[0] for r in samples[(t, module)]) for t in trees)
        print(f"{module}: CPU this / baseline = {this / base:.2f}")


if __name__ == "__main__":
    main()
