"""A replica's own cold start on a GPU, by phase, for a Llama-3.2-1B shape: the offline engine only.

The GPU machine has CUDA torch, transformers and safetensors, but no Ray, flash-attn, gguf or
FastAPI: this builds the engine in fresh processes (TP=1, the local executor), as a replica's
process would, and times what the replica does between its process start and its first token:

- `imports`: torch and the engine's modules (what a replica's process imports);
- `model_config`: config, tokenizer and end-of-turn ids read;
- `weights`: the model built and its bf16 weights loaded from the memory-mapped safetensors;
- `kv_profile`: the profiling forward that sizes the KV cache from free memory;
- `kv_allocation`: the KV pool allocated and bound;
- `graph_capture`: the decode CUDA graphs captured (warm-up included; part of the engine's
  kv_allocation phase, timed apart here);
- `first_token`: one 16-token prompt's prefill, from add_request to its first token.

The checkpoint is written on the fly: random weights in the Llama-3.2-1B shape (16 layers, hidden
2048, GQA 32/8, vocabulary 128,256, tied embeddings; 1.24 B parameters, 2.5 GB in bf16), drawn on
the device and saved into a temporary directory. Placement and Ray's worker start are not here
(bench/cold_start.py times them on a Ray cluster); the first run after the checkpoint is written
reads it from the page cache, as every run does (a node's first start from a cold disk is slower).

    python bench/cold_start_gpu.py                 # on a GPU: 2 cold starts of the 1B shape
    python bench/cold_start_gpu.py --smoke         # on CPU, a tiny shape: checks the script

Prints a table by phase (seconds) per run; never asserts on timings.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Run as a script from anywhere (the GPU machine has the tree, not an install).
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PHASES = (
    "imports",
    "model_config",
    "weights",
    "kv_profile",
    "kv_allocation",
    "graph_capture",
    "first_token",
    "total",
)
PROMPT = list(range(3, 19))  # 16 ids (0-2 are pad, bos and eos in the random checkpoints)


def child(model: str, device: str, dtype: str, max_model_len: int, max_num_seqs: int) -> None:
    """In a fresh process: imports, engine build and first token, timed, as JSON on stdout."""
    started = time.perf_counter()
    import torch

    from engine.config import EngineConfig
    from engine.core import EngineCore
    from scheduler import EngineRequest, SamplingParams, SchedulerConfig
    from workers import cuda_graphs

    row: dict[str, float | str] = {"imports": time.perf_counter() - started}
    # The engine times graph capture inside kv_allocation; time it apart (a wrapper of this
    # process's class, so production code keeps one phase).
    capture = cuda_graphs.DecodeGraphs.capture
    captured: list[float] = []

    def timed_capture(self: cuda_graphs.DecodeGraphs) -> None:
        t0 = time.perf_counter()
        capture(self)
        captured.append(time.perf_counter() - t0)

    cuda_graphs.DecodeGraphs.capture = timed_capture  # type: ignore[method-assign]
    engine = EngineCore(
        EngineConfig(
            model=model,
            dtype=dtype,
            device=device,
            load_progress=False,
            scheduler=SchedulerConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs),
        )
    )
    row.update(engine.startup)
    row["graph_capture"] = sum(captured)
    row["kv_allocation"] = float(row.get("kv_allocation", 0.0)) - sum(captured)
    arrival = time.perf_counter()
    engine.add_request(EngineRequest("cold", PROMPT, SamplingParams(max_tokens=2, temperature=0)))
    while not any(o.new_token_ids for o in engine.step()):
        pass
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    row["first_token"] = time.perf_counter() - arrival
    row["total"] = time.perf_counter() - started
    row["kv_blocks"] = engine.num_gpu_blocks
    row["device_name"] = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    print(json.dumps(row))


def write_checkpoint(path: str, smoke: bool, device: str) -> tuple[str, float]:
    """The random checkpoint (the 1B shape, or a tiny one for --smoke), and seconds to write it."""
    from tests.random_checkpoint import SHAPES, TINY_SERVED_LLAMA, write_random_checkpoint

    t0 = time.perf_counter()
    spec = TINY_SERVED_LLAMA if smoke else SHAPES["llama3-1b"]
    ckpt = write_random_checkpoint(spec, path, device="cpu" if smoke else device)
    return ckpt.path, time.perf_counter() - t0


def run(a: argparse.Namespace, model: str) -> list[dict]:
    rows = []
    for i in range(a.runs):
        command = [sys.executable, __file__, "--child", model, "--device", a.device]
        command += ["--dtype", a.dtype, "--max-model-len", str(a.max_model_len)]
        command += ["--max-num-seqs", str(a.max_num_seqs)]
        wall = time.perf_counter()
        out = subprocess.run(command, capture_output=True, text=True, timeout=a.timeout)
        if out.returncode != 0:
            sys.exit(f"run {i + 1} failed:\n{out.stderr[-4000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        rows[-1]["exec_to_exit"] = time.perf_counter() - wall
        print(
            f"run {i + 1}: first token {rows[-1]['total']:.2f} s after the process's imports "
            f"began ({rows[-1]['exec_to_exit']:.2f} s from exec to exit)",
            flush=True,
        )
    return rows


def print_table(rows: list[dict]) -> None:
    print("| phase (s) | " + " | ".join(f"run {i + 1}" for i in range(len(rows))) + " |")
    print("| --- |" + " ---: |" * len(rows))
    for name in (*PHASES, "exec_to_exit"):
        print(f"| {name} | " + " | ".join(f"{r.get(name, 0.0):.2f}" for r in rows) + " |")
    print(f"KV blocks: {rows[0]['kv_blocks']}; device: {rows[0]['device_name']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, a tiny shape, float32, one run")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--timeout", type=float, default=300, help="seconds per run")
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child is not None:
        child(a.child, a.device, a.dtype, a.max_model_len, a.max_num_seqs)
        return
    if a.smoke:
        a.device, a.dtype, a.runs, a.max_model_len, a.max_num_seqs = "cpu", "float32", 1, 256, 8
    if not 1 <= a.runs <= 100:
        sys.exit(f"runs: 1 to 100, got {a.runs}")
    with tempfile.TemporaryDirectory(prefix="cold-start-gpu-") as tmp:
        model, wrote = write_checkpoint(str(Path(tmp) / "llama3-1b"), a.smoke, a.device)
        size = sum(f.stat().st_size for f in Path(model).glob("*.safetensors")) / 2**30
        print(f"checkpoint: {size:.2f} GiB of safetensors written in {wrote:.1f} s", flush=True)
        rows = run(a, model)
    print_table(rows)
    if a.json is not None:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
