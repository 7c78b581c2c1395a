"""bench/gpu_session.sh's summary: every command's status and the figures its scripts wrote, as one
JSON file, and the few lines a reader needs first on the console.

    python bench/gpu_session_summary.py --status STATUS.tsv --json-dir DIR --out summary.json
    python bench/gpu_session_summary.py --machine machine.json    # what the session runs on

STATUS.tsv has one line per command: id, exit status (or `skipped` / `SLOT EMPTY`), seconds, the
last line of its log (or why it did not run). DIR holds the JSON the scripts wrote (step_floor,
quantized, families, spec, pipeline, machine).
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

TARGETS = {  # issue 54's bars, printed beside the figures
    "step_over_replay": 1.15,
    "floor_share_of_replay": 0.70,
    "fp8_over_bf16": 0.6,
    "int4_over_bf16": 0.4,
}


def machine() -> dict:
    import torch
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__}
    info["transformers"] = transformers.__version__
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    info["cuda"] = torch.cuda.is_available()
    if info["cuda"]:
        props = torch.cuda.get_device_properties(0)
        info |= {"gpu": props.name, "memory_gib": round(props.total_memory / (1 << 30), 1)}
    return info


def read_status(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        cmd, status, seconds, last = (line.split("\t") + ["", "", ""])[:4]
        rows.append(dict(id=cmd, status=status, seconds=int(seconds or 0), last_line=last))
    return rows


def step_lines(name: str, data: dict) -> list[str]:
    """One line per row of bench/step_floor_gpu.py's JSON, then its ratios and parity."""
    lines = []
    for r in data["rows"]:
        replay = "-" if r["replay_ms"] is None else f"{r['replay_ms']:.3f}"
        ratio = (
            "" if r["step_over_replay"] is None else f", step/replay {r['step_over_replay']:.2f}"
        )
        share = r["floor_share_of_replay"]
        lines.append(
            f"{name}: {r['format']} async {'on' if r['async_scheduling'] else 'off'} batch "
            f"{r['batch']}: step {r['step_ms']:.3f} ms, replay {replay} ms, floor "
            f"{r['floor_ms']:.3f} ms{ratio}"
            + ("" if share is None else f", floor/replay {share:.0%}")
        )
    lines += [
        f"{name}: FAILED {k}: {e.splitlines()[-1]}" for k, e in data.get("errors", {}).items()
    ]
    lines += [f"{name}: {k} {v:.2f}x" for k, v in data["ratios"].items()]
    lines.append(
        f"{name}: greedy tokens identical async off/on: {data['tokens_identical_across_async']}"
    )
    return lines


def family_lines(data: list[dict]) -> list[str]:
    lines = []
    for fam in data:
        if fam["error"]:
            lines.append(f"families: {fam['name']}: FAILED {fam['error'].splitlines()[-1]}")
        for e in fam["engines"]:
            if e["error"]:
                lines.append(
                    f"families: {fam['name']} {e['dtype']}: FAILED {e['error'].splitlines()[-1]}"
                )
                continue
            same = sum(v == "identical" for v in e["verdicts"])
            bad = sum(v.startswith("MISMATCH") for v in e["verdicts"])
            steps = ", ".join(f"b{b} {ms:.3f} ms" for b, ms in e["step_ms"].items())
            lines.append(
                f"families: {fam['name']} {e['dtype']} ({'graphs' if e['graphs'] else 'eager'}, "
                f"vs {fam['reference']}): {same}/{len(e['verdicts'])} identical, {bad} mismatches"
                + (f"; step {steps}" if steps else "")
            )
    return lines


def headline(results: dict) -> list[str]:
    lines = []
    if "machine" in results:
        lines.append(f"machine: {results['machine']}")
    for name in ("step_floor", "quantized"):
        if name in results:
            lines += step_lines(name, results[name])
    if "families" in results:
        lines += family_lines(results["families"])
    for r in results.get("moe_kernel", {}).get("rows", []):
        lines.append(
            f"moe_kernel: {r['shape']} batch {r['batch']}: torch path {r['torch_ms']:.3f} ms, "
            f"Triton {r['triton_ms']:.3f} ms ({r['speedup']:.2f}x), floor {r['floor_ms']:.3f} ms, "
            f"max rel diff {r['max_rel_diff']:.1e}"
        )
    for r in results.get("lora", {}).get("rows", []):
        lines.append(
            f"lora: batch {r['batch']}: base {r['base_ms']:.3f} ms, adapters {r['lora_ms']:.3f} ms "
            f"({r['lora_over_base']:.2f}x), graph replays per step {r['replays_per_step']}"
        )
    shown = {"machine", "step_floor", "quantized", "families", "moe_kernel", "lora"}
    lines += [f"{name}: figures in summary.json, results.{name}" for name in results.keys() - shown]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--machine", default=None, help="write the machine's description here")
    parser.add_argument("--status", default=None)
    parser.add_argument("--json-dir", default=None)
    parser.add_argument("--smoke", default="0")
    parser.add_argument("--out", default=None)
    parser.add_argument("--quiet", action="store_true", help="write the file, print nothing")
    args = parser.parse_args()
    if args.machine:
        info = machine()
        Path(args.machine).write_text(json.dumps(info))
        print(info)
        return
    results = {
        p.stem: json.loads(p.read_text()) for p in sorted(Path(args.json_dir).glob("*.json"))
    }
    summary = {
        "cpu_smoke": args.smoke == "1",
        "targets": TARGETS,
        "commands": read_status(Path(args.status)),
        "results": results,
    }
    Path(args.out).write_text(json.dumps(summary, indent=1))
    if args.quiet:
        return
    print("\n== summary (full figures in summary.json, logs beside it)")
    for c in summary["commands"]:
        print(f"  {c['id']:>3} {c['status']:>10} {c['seconds']:4d} s  {c['last_line'][:110]}")
    for line in headline(results):
        print(f"  {line}")
    print(f"  targets: {TARGETS}")


if __name__ == "__main__":
    main()
