"""Weight updates and sleep of one engine (docs/rl.md): how long an update takes from a path and
over a weight group, and how much memory sleep frees and how long wake takes, against a reload.

The model is the embedded SmolLM2-135M de-quantised to fp32 (quantization none: a quantized layer
takes no update), or with --random-shape a random SmolLM2-shaped checkpoint written here. The
bench writes the fp32 checkpoint it updates from; the weight group's trainer is a thread of this
process (rank 0) sending the same tensors (gloo over loopback on CPU; on CUDA NCCL would need a
second GPU, so the group figure is CPU only).

  python bench/weight_update.py                      # CPU, 5 repetitions of each update
  python bench/weight_update.py --device cuda        # path updates and sleep on the GPU
  python bench/weight_update.py --random-shape

Prints figures and ratios; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rss_mib() -> float:
    """This process's resident memory now."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def memory(device: str) -> str:
    text = f"RSS {rss_mib():8.0f} MiB"
    if device.startswith("cuda"):
        text += f", cuda allocated {torch.cuda.memory_allocated() / 2**20:8.0f} MiB"
    return text


def fp32_checkpoint(random_shape: bool, out: Path) -> str:
    """An fp32 safetensors directory of the model, with its tokenizer."""
    from safetensors.torch import load_file, save_file

    from workers.loader import safetensors_files
    from workers.model_files import resolve_model

    if random_shape:
        from tests.random_checkpoint import SHAPES, write_random_checkpoint

        spec = SHAPES["smollm2-135m"]
        spec = type(spec)(spec.config_class, spec.fields, head_std=spec.head_std)  # fp32
        return write_random_checkpoint(spec, str(out)).path
    src = resolve_model("default")
    tensors: dict[str, torch.Tensor] = {}
    for f in safetensors_files(src):
        tensors.update({k: v.float() for k, v in load_file(str(f)).items()})
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    for f in Path(src).iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json" and f.is_file():
            (out / f.name).write_bytes(f.read_bytes())
    return str(out)


def timed(fn, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def show(name: str, times: list[float]) -> float:
    med = statistics.median(times)
    print(f"{name:34s} median {med * 1000:9.1f} ms  (min {min(times) * 1000:.1f}, n={len(times)})")
    return med


def group_updates(llm, ckpt: str, reps: int) -> list[float]:
    """reps updates over a gloo group whose trainer (a thread, rank 0) sends ckpt's tensors."""
    from safetensors.torch import load_file

    from workers.distributed import free_port
    from workers.loader import safetensors_files
    from workers.weight_transfer import WeightGroupSpec, open_group, send_weights

    tensors = sorted((k, v) for f in safetensors_files(ckpt) for k, v in load_file(str(f)).items())
    spec = WeightGroupSpec(f"tcp://127.0.0.1:{free_port()}", 2, 0, timeout_s=600)

    def trainer() -> None:
        group = open_group(spec, torch.device("cpu"))
        for _ in range(reps):
            send_weights(group, tensors)

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    llm.init_weight_group(spec.init_method, 2, 1, timeout_s=600)
    times = timed(lambda: llm.update_weights(from_group=True), reps)
    thread.join()
    llm.destroy_weight_group()
    return times


def sleep_figures(llm, device: str, build) -> None:
    from scheduler.sampling_params import SamplingParams

    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    prompt = ["The capital of France is"]
    want = llm.generate(prompt, greedy, use_tqdm=False)[0].token_ids
    # Fill part of the pool: the CPU pool's pages count in RSS once written, not at allocation.
    fill = [[100 + (i * 7 + j) % 40000 for j in range(256)] for i in range(32)]
    llm.generate(fill, SamplingParams(max_tokens=1), use_tqdm=False)
    engine = llm.engine
    spec = engine.executor.call_ranks(lambda runner: runner.kv_spec)[0]
    pool = engine.num_gpu_blocks * spec.block_bytes / 2**20
    print(f"KV pool: {engine.num_gpu_blocks} blocks, {pool:.0f} MiB; 32 x 256 prompt tokens in")
    gc.collect()
    print(f"awake                              {memory(device)}")
    for level, discard in ((1, False), (2, False), (2, True)):
        llm.sleep(level, discard_weights=discard)
        print(
            f"asleep level {level}{' discard' if discard else '        '}             "
            f"{memory(device)}"
        )
        t0 = time.perf_counter()
        llm.wake_up()
        wake = time.perf_counter() - t0
        if discard:
            continue  # wakes without weights: the update after it is timed above
        same = llm.generate(prompt, greedy, use_tqdm=False)[0].token_ids == want
        print(f"  wake_up {wake * 1000:8.1f} ms, identical greedy tokens: {same}")
    t0 = time.perf_counter()
    build().shutdown()
    reload = time.perf_counter() - t0
    print(f"reload (a new LLM) {reload * 1000:.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--random-shape", action="store_true")
    parser.add_argument("--kv-gb", type=float, default=1.0, help="CPU KV pool, GiB")
    args = parser.parse_args()

    from engine.llm import LLM

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = fp32_checkpoint(args.random_shape, Path(tmp) / "fp32")
        size = sum(f.stat().st_size for f in Path(ckpt).glob("*.safetensors")) / 2**20
        print(f"model: {ckpt} ({size:.0f} MiB of fp32 safetensors), device {args.device}")

        def build() -> LLM:
            return LLM(
                ckpt,
                device=args.device,
                load_progress=False,
                quantization="none",
                kv_cache_memory_gb=args.kv_gb,
                gpu_memory_utilization=0.3,
            )

        llm = build()
        path = show("update from a path", timed(lambda: llm.update_weights(ckpt), args.reps))
        print(f"{'':34s} {size / path:9.0f} MiB/s")
        if not args.device.startswith("cuda"):
            gloo = show("update over gloo (loopback)", group_updates(llm, ckpt, args.reps))
            print(f"{'':34s} {size / gloo:9.0f} MiB/s, {gloo / path:.2f}x the path's time")
        sleep_figures(llm, args.device, build)
        llm.shutdown()


if __name__ == "__main__":
    main()
