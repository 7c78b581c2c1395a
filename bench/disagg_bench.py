"""Prefill/decode disaggregation's mechanics: what moving a prompt's KV costs, not its benefit (on a
2-core machine both phases share the cores; the simulator shows the benefit).

Default (this machine, CPU): a colocated engine, a prefill engine and a decode engine of the
embedded SmolLM2-135M (or --model) in this process run the same prompts in alternation:
- TTFT colocated, and TTFT disaggregated = the prefill's first token plus its export (the blocks
  read off the pool and sent), which the client waits for before the decode starts;
- the second token's delay: colocated one decode step; disaggregated the transfer's fetch, the
  load into the decode pool and the decode engine's first step;
- the object store (Ray): the same payloads `ray.put` here and `ray.get` in another process, per
  KV block and per byte (--no-ray skips it).

    python bench/disagg_bench.py [--prompt-tokens 128 512 1024] [--repeats 5] [--no-ray]
    python bench/disagg_bench.py --object-store-only --prompt-tokens 8 32 64   (blocks, no model)

`--ranks 1 2` (CPU, Ray): the transfer per KV block by tensor-parallel size, both phases over Ray
workers and the object store (TP=1 too, on one worker, so only the rank count differs), on a
random Llama with SmolLM2-135M's KV per token but 4 KV heads (SmolLM2's 3 do not split in two):
the prefill's export (every rank reads and puts its shard) and the decode's load (every rank gets,
checks and copies its own; the slowest rank's seconds), per block.

    python bench/disagg_bench.py --ranks 1 2 [--prompt-tokens 256 1024] [--repeats 5]

GPU (`--device cuda`, no Ray needed): block transfer bandwidth between two processes on one GPU,
against the device copy bandwidth in one process: the parent holds --blocks blocks of --block-kib
KiB on the device; a child process (torch.multiprocessing, spawn) receives them
- over CUDA IPC (the child copies device to device from the parent's memory: what a
  torch.distributed/NCCL or IPC transport would do), and
- through host staging (the parent copies to shared, pageable host memory, the child to its
  device: what the object-store transport does, less the store's own copy),
each one batched copy and block by block (the receiver copies block by block).
`--smoke` runs the same two-process code on CPU with small sizes.

    python bench/disagg_bench.py --device cuda [--blocks 256] [--block-kib 2048] [--iters 20]
    python bench/disagg_bench.py --smoke
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import torch
import torch.multiprocessing as mp

MiB = 1 << 20


# ---- two processes, one device (--device cuda, --smoke) --------------------------------------
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _timed(fn, device: str, iters: int) -> float:
    """Median seconds of fn() over iters runs (after one warm-up)."""
    fn()
    _sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _receiver(device: str, src: torch.Tensor, host: torch.Tensor, iters: int, out) -> None:
    """The child: copy the parent's blocks into a pool of its own, over IPC and from host."""
    if device == "cpu":  # a copy this small is one thread's job; a pool only spins on 2 cores
        torch.set_num_threads(1)
    pool = torch.empty_like(src, device=device)

    def ipc_whole() -> None:
        pool.copy_(src, non_blocking=True)

    def ipc_blocks() -> None:
        for i in range(src.shape[0]):
            pool[i].copy_(src[i], non_blocking=True)

    def host_whole() -> None:
        pool.copy_(host, non_blocking=True)

    def host_blocks() -> None:
        for i in range(host.shape[0]):
            pool[i].copy_(host[i], non_blocking=True)

    out.put(
        {
            "ipc_whole": _timed(ipc_whole, device, iters),
            "ipc_blocks": _timed(ipc_blocks, device, iters),
            "h2d_whole": _timed(host_whole, device, iters),
            "h2d_blocks": _timed(host_blocks, device, iters),
        }
    )


def ipc_bench(device: str, blocks: int, block_kib: int, iters: int) -> dict[str, float]:
    """Seconds per whole transfer of `blocks` blocks, by path."""
    ctx = mp.get_context("spawn")
    elems = block_kib * 1024 // 2  # bfloat16
    src = torch.randn(blocks, elems, device=device).to(torch.bfloat16)
    # Shared, pageable host memory: what the object store holds (its pages are not pinned).
    host = torch.empty(blocks, elems, dtype=torch.bfloat16).share_memory_()
    dst = torch.empty_like(src)
    results = {
        "device_copy": _timed(lambda: dst.copy_(src), device, iters),
        "d2h_whole": _timed(lambda: host.copy_(src), device, iters),
    }
    out = ctx.SimpleQueue()
    child = ctx.Process(target=_receiver, args=(device, src, host, iters, out))
    child.start()
    results.update(out.get())
    child.join(timeout=120)
    results["staged_whole"] = results["d2h_whole"] + results["h2d_whole"]
    return results


def report_ipc(args: argparse.Namespace) -> None:
    device = "cpu" if args.smoke else args.device
    if device == "cpu":
        torch.set_num_threads(1)
    blocks, kib, iters = (16, 64, 3) if args.smoke else (args.blocks, args.block_kib, args.iters)
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "CPU"
    total = blocks * kib * 1024
    print(f"device {name}: {blocks} blocks x {kib} KiB = {total / MiB:.1f} MiB, median of {iters}")
    res = ipc_bench(device, blocks, kib, iters)
    rows = [
        ("device copy, one process", "device_copy"),
        ("CUDA IPC, batched", "ipc_whole"),
        ("CUDA IPC, block by block", "ipc_blocks"),
        ("host staging (d2h + h2d), batched", "staged_whole"),
        ("  of which device -> shared host", "d2h_whole"),
        ("  of which host -> device, batched", "h2d_whole"),
        ("host -> device, block by block", "h2d_blocks"),
    ]
    base = total / res["device_copy"]
    print("| path | ms | GB/s | us per block | vs device copy |")
    print("| --- | --- | --- | --- | --- |")
    for label, key in rows:
        s = res[key]
        bw = total / s
        per_block = s / blocks * 1e6
        print(f"| {label} | {s * 1e3:.2f} | {bw / 1e9:.1f} | {per_block:.1f} | {bw / base:.2f} |")
    if device == "cpu":
        print("(--smoke: CPU shared memory stands in for CUDA IPC; figures are not a GPU's)")


# ---- engines on this machine (default) --------------------------------------------------------
def engines(args: argparse.Namespace):
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.disagg import DecodeSide, PrefillSide
    from workers.kv_transfer import InProcessTransport

    def make() -> EngineCore:
        return EngineCore(
            EngineConfig.from_kwargs(
                model=args.model,
                device="cpu",
                load_progress=False,
                quantization="none",  # the recorded figures are the fp32 path's
                max_model_len=2048,
                num_gpu_blocks=args.pool_blocks,
                cpu_threads=args.threads,
            )
        )

    transport = InProcessTransport()
    colocated, prefill, decode = make(), make(), make()
    return colocated, PrefillSide(prefill, transport), DecodeSide(decode, transport)


def first_tokens(engine, request, n: int = 2, add=None) -> list[float]:
    """Seconds from adding the request (with add, else engine.add_request) to each of its first
    n tokens."""
    start = time.perf_counter()
    (add or engine.add_request)(request)
    times: list[float] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            times += [time.perf_counter() - start] * len(out.new_token_ids)
    return times[:n]


def one_round(colocated, prefill, decode, prompt: list[int], tag: str) -> dict[str, float]:
    from engine.disagg import decode_request, prefill_request
    from scheduler import EngineRequest, SamplingParams

    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    c = first_tokens(colocated, EngineRequest(f"c-{tag}", prompt, params))
    request = EngineRequest(f"d-{tag}", prompt, params)
    start = time.perf_counter()
    prefill.engine.add_request(prefill_request(request))
    first: list[int] = []
    while prefill.engine.has_unfinished_requests():
        for out in prefill.engine.step():
            first += out.new_token_ids
    t_prefill = time.perf_counter() - start
    payload = prefill.payload(request)
    t_read = time.perf_counter() - start - t_prefill
    handle = prefill.transport.send(payload) if payload is not None else None
    t_first = time.perf_counter() - start  # what the client waits for its first token
    receiver = decode.receiver
    inner, load_s = receiver.load, [0.0]

    def timed_load(cache, loads):
        t0 = time.perf_counter()
        try:
            return inner(cache, loads)
        finally:
            load_s[0] += time.perf_counter() - t0

    receiver.load = timed_load  # type: ignore[method-assign]
    second = first_tokens(
        decode.engine, decode_request(request, first), 1, lambda r: decode.add(r, handle)
    )
    receiver.load = inner  # type: ignore[method-assign]
    return {
        "ttft_colocated": c[0],
        "second_colocated": c[1] - c[0],
        "ttft_prefill": t_prefill,
        "export": t_read,
        "ttft_disagg": t_first,
        "second_disagg": second[0],
        "load": load_s[0],
        "blocks": len(handle.hashes) if handle is not None else 0,
        "bytes": payload.nbytes if payload is not None else 0,
    }


def object_store(payloads: list) -> list[tuple[int, int, float, float]]:
    """(blocks, bytes, put s, get s in another process) for each payload."""
    import ray

    @ray.remote(num_cpus=0)
    def fetch(refs: list) -> float:
        start = time.perf_counter()
        ray.get(refs[0])
        return time.perf_counter() - start

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        ray.get(fetch.remote([ray.put(payloads[0])]))  # the worker starts
        rows = []
        for payload in payloads:
            start = time.perf_counter()
            ref = ray.put(payload)
            put_s = time.perf_counter() - start
            get_s = ray.get(fetch.remote([ref]))
            rows.append((len(payload.hashes), payload.nbytes, put_s, get_s))
            del ref
        return rows
    finally:
        ray.shutdown()


def report_object_store(payloads: list) -> None:
    print("\nRay object store (put here, get in a worker process), one payload each:")
    print("| blocks | MiB | put ms | get ms | put+get us/block | GB/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for blocks, nbytes, put_s, get_s in object_store(payloads):
        total = put_s + get_s
        print(
            f"| {blocks} | {nbytes / MiB:.1f} | {put_s * 1e3:.2f} | {get_s * 1e3:.2f} | "
            f"{total / blocks * 1e6:.0f} | {nbytes / total / 1e9:.2f} |",
            flush=True,
        )


def synthetic_payloads(block_bytes: int, counts: list[int]) -> list:
    """Payloads of random bytes in blocks of block_bytes (the object store alone, no model)."""
    import numpy as np

    from workers.kv_transfer import KVPayload, block_crc

    rng = np.random.default_rng(36)
    out = []
    for n in counts:
        data = rng.integers(0, 256, (n, block_bytes), dtype=np.uint8)
        out.append(
            KVPayload(list(range(n)), [block_crc(r) for r in data], "float32", (block_bytes,), data)
        )
    return out


def report_engines(args: argparse.Namespace) -> None:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    print(f"commit {commit}, model {args.model}, load average before {os.getloadavg()}", flush=True)
    colocated, prefill, decode = engines(args)
    vocab = colocated.vocab_size
    rng = random.Random(36)
    payloads = []
    for n in args.prompt_tokens:
        rows = []
        for r in range(args.repeats + 1):  # round 0 warms up
            prompt = [rng.randrange(3, vocab) for _ in range(n)]
            row = one_round(colocated, prefill, decode, prompt, f"{n}-{r}")
            if r:
                rows.append(row)
        if n == args.prompt_tokens[0]:
            block = rows[0]["bytes"] // max(1, rows[0]["blocks"])
            print(f"KV block: {block} bytes ({block / MiB:.2f} MiB), medians of {args.repeats}")
            print(
                "| prompt | blocks | MiB | TTFT colocated ms | TTFT disagg ms | added ms | of "
                "which export ms | 2nd token colocated ms | 2nd token disagg ms | of which load "
                "ms | load us/block |"
            )
            print("| --- " * 11 + "|", flush=True)
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(
            f"| {n} | {med['blocks']:.0f} | {med['bytes'] / MiB:.1f} | "
            f"{med['ttft_colocated'] * 1e3:.1f} | {med['ttft_disagg'] * 1e3:.1f} | "
            f"{(med['ttft_disagg'] - med['ttft_colocated']) * 1e3:+.1f} | "
            f"{med['export'] * 1e3:.2f} | {med['second_colocated'] * 1e3:.1f} | "
            f"{med['second_disagg'] * 1e3:.1f} | {med['load'] * 1e3:.2f} | "
            f"{med['load'] / max(med['blocks'], 1) * 1e6:.0f} |",
            flush=True,
        )
        payloads.append(_payload_of(prefill, [rng.randrange(3, vocab) for _ in range(n)]))
    if not args.no_ray:
        report_object_store(payloads)
    print(f"load average after {os.getloadavg()}")
    for engine in (colocated, prefill.engine, decode.engine):
        engine.shutdown()


def _payload_of(prefill, prompt: list[int]):
    """A prompt's payload on the prefill engine (prefilled here, untimed)."""
    from engine.disagg import prefill_request
    from scheduler import EngineRequest, SamplingParams

    request = EngineRequest(f"p-{len(prompt)}-{prompt[0]}", prompt, SamplingParams(max_tokens=1))
    prefill.engine.add_request(prefill_request(request))
    while prefill.engine.has_unfinished_requests():
        prefill.engine.step()
    return prefill.payload(request)


# ---- by tensor-parallel size, over Ray (--ranks) ------------------------------------------------
def tp_model(path: str) -> str:
    """A random Llama whose KV per token is SmolLM2-135M's (30 layers x 192 floats of K and of V)
    but in 4 heads of 48, so two ranks hold 2 each; small elsewhere (the transfer is the point)."""
    from tests.random_checkpoint import TINY_TP_LLAMA, write_random_checkpoint

    spec = TINY_TP_LLAMA.with_fields(
        hidden_size=192,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=48,
        num_hidden_layers=30,
        intermediate_size=256,
        vocab_size=1000,
        max_position_embeddings=4096,
    )
    return write_random_checkpoint(spec, path).path


def tp_round(prefill, decode, prompt: list[int], tag: str) -> dict[str, float]:
    """One prompt prefilled, exported and loaded: seconds of the export and of the load."""
    from engine.disagg import decode_request, prefill_request
    from scheduler import EngineRequest, SamplingParams

    request = EngineRequest(tag, prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    prefill.engine.add_request(prefill_request(request))
    first: list[int] = []
    while prefill.engine.has_unfinished_requests():
        for out in prefill.engine.step():
            first += out.new_token_ids
    start = time.perf_counter()
    handle = prefill.export(request)
    export_s = time.perf_counter() - start
    assert handle is not None
    _, load_before = decode.received()
    decode.add(decode_request(request, first), handle)
    while decode.engine.has_unfinished_requests():
        decode.engine.step()
    _, load_after = decode.received()
    return {"blocks": len(handle.hashes), "export": export_s, "load": load_after - load_before}


def report_ranks(args: argparse.Namespace) -> None:
    import tempfile

    import ray

    from cluster.disagg_transport import ObjectStoreTransport
    from cluster.ray_executor import ray_executor
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.disagg import DecodeSide, PrefillSide

    print(f"load average before {os.getloadavg()}", flush=True)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    model = tp_model(tempfile.mkdtemp(prefix="disagg-tp-"))
    sides = {}
    for tp in args.ranks:  # every size up at once: rounds alternate, so load drifts hit all alike
        config = EngineConfig.from_kwargs(
            model=model,
            device="cpu",
            load_progress=False,
            max_model_len=2048,
            num_gpu_blocks=args.pool_blocks,
            tensor_parallel_size=tp,
        )
        engines = [EngineCore(config, ray_executor) for _ in range(2)]
        transport = ObjectStoreTransport()
        sides[tp] = (PrefillSide(engines[0], transport), DecodeSide(engines[1], transport))
    print(
        f"medians of {args.repeats} rounds, sizes alternating\n"
        "| TP | prompt | blocks | KiB per block per rank | export us/block | load us/block | "
        "transfer us/block |"
    )
    print("| --- " * 7 + "|", flush=True)
    rng = random.Random(36)
    for n in args.prompt_tokens:
        rows: dict[int, list[dict[str, float]]] = {tp: [] for tp in args.ranks}
        for r in range(args.repeats + 1):  # round 0 warms up
            prompt = [rng.randrange(3, 1000) for _ in range(n)]
            for tp, (prefill, decode) in sides.items():
                row = tp_round(prefill, decode, prompt, f"tp{tp}-{n}-{r}")
                if r:
                    rows[tp].append(row)
        for tp in args.ranks:
            med = {k: statistics.median(row[k] for row in rows[tp]) for k in rows[tp][0]}
            blocks = med["blocks"]
            kib = 30 * 2 * 16 * 192 * 4 / tp / 1024
            print(
                f"| {tp} | {n} | {blocks:.0f} | {kib:.0f} | {med['export'] / blocks * 1e6:.0f} | "
                f"{med['load'] / blocks * 1e6:.0f} | "
                f"{(med['export'] + med['load']) / blocks * 1e6:.0f} |",
                flush=True,
            )
    for prefill, decode in sides.values():
        prefill.engine.shutdown()
        decode.engine.shutdown()
    print(f"load average after {os.getloadavg()}")
    ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cuda: the two-process GPU bench")
    parser.add_argument("--smoke", action="store_true", help="the two-process bench on CPU, small")
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pool-blocks", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-ray", action="store_true")
    parser.add_argument(
        "--ranks", type=int, nargs="+", help="tensor-parallel sizes: the transfer by rank count"
    )
    parser.add_argument(
        "--object-store-only",
        action="store_true",
        help="only the object store, on payloads of --prompt-tokens blocks each (no model)",
    )
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--block-kib", type=int, default=2048, help="2048: an 8B Llama's block")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if args.smoke or args.device.startswith("cuda"):
        report_ipc(args)
    elif args.ranks:
        report_ranks(args)
    elif args.object_store_only:
        print(f"load average before {os.getloadavg()}")
        # SmolLM2-135M's fp32 block: 30 layers x K/V x 16 tokens x 3 heads x 64 x 4 bytes
        report_object_store(synthetic_payloads(737_280, args.prompt_tokens))
        print(f"load average after {os.getloadavg()}")
    else:
        report_engines(args)


if __name__ == "__main__":
    main()
