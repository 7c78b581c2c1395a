"""Issue 47's GPU lines on one GPU, without Ray (torch.multiprocessing and torch.distributed only).

1. PP=2 as two processes on one GPU against TP=1: greedy tokens (parity) and decode step times.
   The engine's mp executor gives each rank a GPU of its own; here (a bench's patch, like
   bench/pipeline_bubble.py's) both ranks take the configured device, so the stages' hand-offs are
   an NCCL group of two ranks on one device, which NCCL may refuse: then the refusal is the
   figure.
2. KV blocks between two processes on one GPU: the library's pull over a two-rank NCCL pair
   (workers/kv_pairs.py, what workers/kv_collective.py moves KV with), and CUDA IPC (a tensor
   handed through a torch.multiprocessing queue, copied device to device by the receiver), per
   block and batched.

The checkpoint is written here with random weights (tests/random_checkpoint.py: a
Llama-3.2-1B shape, run in float32 so that parity is exact), or `--model` names one. `--smoke`
runs the same code on CPU with a tiny model, gloo for the collectives and shared memory for the
IPC path, in about a minute.

    python bench/pipeline_gpu.py [--smoke] [--model DIR] [--requests 8] [--steps 32]
        [--blocks 1,16,64] [--repeats 5] [--init-timeout 90] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import queue
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import torch
import torch.multiprocessing as mp


@dataclass(slots=True)
class EngineRun:
    """One engine's greedy tokens and decode step times (None where it could not run)."""

    layout: str
    tokens: dict[str, list[int]] = field(default_factory=dict)
    step_ms: list[float] = field(default_factory=list)  # steps once every prompt is prefilled
    decoded: int = 0  # tokens those steps made
    error: str | None = None

    def summary(self) -> str:
        if self.error is not None:
            return f"{self.layout}: did not run: {self.error}"
        if not self.step_ms:
            return f"{self.layout}: no decode step timed"
        median = statistics.median(self.step_ms)
        return (
            f"{self.layout}: {len(self.step_ms)} decode steps, median {median:.2f} ms an engine "
            f"step, {self.decoded / (sum(self.step_ms) / 1e3):.1f} tokens/s"
        )


def one_device_ranks(init_timeout_s: float) -> None:
    """Every rank of the mp executor on the configured device (one GPU for all): a bench's
    patch of the executor's placement, in this process (ranks' configs are made here), with a
    shorter start-up bound than the executor's 600 s (NCCL may hang rather than refuse)."""
    import engine.backends
    import engine.mp_executor as mp_executor

    def same_device(config: Any, rank: int) -> Any:
        return config

    def executor(config: Any, world_size: int, step_timeout_s: float) -> Any:
        return mp_executor.MPExecutor(
            config, world_size, step_timeout_s=step_timeout_s, init_timeout_s=init_timeout_s
        )

    mp_executor.rank_config = same_device
    engine.backends.mp_executor_for = executor


def run_engine(args: argparse.Namespace, path: str, layout: str, pp: int) -> EngineRun:
    """Greedy decoding of --requests prompts, --steps tokens each, stepping the engine by hand
    so each step is timed (the prefill steps are not)."""
    from engine.llm import LLM
    from scheduler import EngineRequest, SamplingParams

    run = EngineRun(layout)
    # One thread a rank on CPU: TP=1 against two single-threaded stages.
    kwargs: dict[str, Any] = dict(pipeline_parallel_size=pp, cpu_threads=1)
    if pp > 1:
        kwargs["distributed_executor_backend"] = "mp"
    try:
        llm = LLM(
            model=path,
            device=args.device,
            dtype="float32",
            quantization="none",
            load_progress=False,
            max_model_len=args.prompt_len + args.steps + 16,
            **kwargs,
        )
    except Exception as e:  # the refusal is the figure (NCCL, two ranks, one GPU)
        run.error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        return run
    try:
        _decode(llm.engine, args, run, EngineRequest, SamplingParams)
    except Exception as e:
        run.error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    finally:
        llm.shutdown()
    return run


def _decode(core: Any, args: argparse.Namespace, run: EngineRun, request: Any, params: Any) -> None:
    sampling = params(max_tokens=args.steps, temperature=0.0, ignore_eos=True)
    for i in range(args.requests):
        prompt = [10 + (7 * i + 13 * j) % 200 for j in range(args.prompt_len)]
        core.add_request(request(f"r{i}", prompt, sampling))
        run.tokens[f"r{i}"] = []
    while core.has_unfinished_requests():
        prefilled = all(run.tokens.values())
        t0 = time.perf_counter()
        outs = core.step()
        elapsed = time.perf_counter() - t0
        for out in outs:
            run.tokens[out.request_id] += out.new_token_ids
        if prefilled and outs:
            run.step_ms.append(elapsed * 1e3)
            run.decoded += sum(len(out.new_token_ids) for out in outs)


def parity(reference: EngineRun, other: EngineRun) -> str:
    if other.error is not None or reference.error is not None:
        return "parity: not checked (a run did not complete)"
    for rid, tokens in reference.tokens.items():
        if other.tokens.get(rid) != tokens:
            return f"parity: DIFFERS at {rid}: {tokens[:8]} vs {other.tokens.get(rid, [])[:8]}"
    return f"parity: identical greedy tokens ({len(reference.tokens)} requests)"


# ---- KV between two processes --------------------------------------------------------------
def _sender(kind: str, device: str, sizes: list[int], repeats: int, peer: Any, back: Any) -> None:
    """Hands each payload to the receiver: offered on this process's pair server (NCCL for a
    CUDA tensor, gloo for a host one), or put on the queue itself (CUDA IPC; shared memory on
    CPU). Waits for the receiver between payloads, so it never holds more than one."""
    from workers.kv_pairs import server

    torch.manual_seed(0)
    outbox = server("127.0.0.1", hold_s=600.0, max_bytes=2 * max(sizes))
    for nbytes in sizes:
        for _ in range(repeats):
            wire = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
            if kind == "pair":
                peer.put(outbox.offer(uuid.uuid4().hex, {}, wire))
            else:
                peer.put(wire if device != "cpu" else wire.share_memory_())
            if back.get() != "ok":
                return
    peer.put(None)


def _receiver(kind: str, device: str, timeout_s: float, peer: Any, back: Any, out: Any) -> None:
    """Times each payload from having its reference to holding its bytes on `device`."""
    times: list[tuple[int, float]] = []
    error = None
    while (item := peer.get()) is not None:
        t0 = time.perf_counter()
        try:
            got = _take(kind, item, timeout_s)
            if device != "cpu":
                torch.cuda.synchronize()
            times.append((got.numel(), time.perf_counter() - t0))
        except Exception as e:  # NCCL refusing two ranks on one GPU is a result
            error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            back.put("stop")
            break
        back.put("ok")
    out.put((times, error))


def _take(kind: str, item: Any, timeout_s: float) -> torch.Tensor:
    from workers.kv_pairs import pull

    if kind == "pair":
        got = pull(item, 1, timeout_s, item.nbytes)
        if got is None:
            raise RuntimeError("the pull came back empty (the pair did not form or timed out)")
        return got
    return item.clone()  # device to device over the IPC mapping (a host copy on CPU)


def kv_transfer(args: argparse.Namespace, kind: str, block_bytes: int) -> dict[str, Any]:
    """Payloads of --blocks blocks of block_bytes, --repeats each, over `kind` ("pair" or
    "ipc"), between two fresh processes (a pair that NCCL refuses cannot take the other down)."""
    ctx = mp.get_context("spawn")
    sizes = [n * block_bytes for n in args.blocks]
    peer, back, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=_sender, args=(kind, args.device, sizes, args.repeats, peer, back)),
        ctx.Process(target=_receiver, args=(kind, args.device, args.timeout, peer, back, out)),
    ]
    for p in procs:
        p.start()
    try:  # a pair that hangs rather than refuses ends at its own timeout, then this one
        times, error = out.get(timeout=2 * args.timeout + 2 * len(sizes) * args.repeats + 30)
    except queue.Empty:
        times, error = [], f"no answer; exit codes {[p.exitcode for p in procs]}"
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return {"kind": kind, "block_bytes": block_bytes, "times": times, "error": error}


def report_kv(result: dict[str, Any], name: str) -> list[str]:
    """Median time and rate per payload size; the first payload (forming the pair) not counted."""
    block = result["block_bytes"]
    by_size: dict[int, list[float]] = {}
    for nbytes, seconds in result["times"][1:]:
        by_size.setdefault(nbytes, []).append(seconds)
    lines = []
    for nbytes, secs in sorted(by_size.items()):
        median = statistics.median(secs)
        lines.append(
            f"  {name}: {nbytes // block:4d} blocks of {block / 1024:.0f} KiB  median "
            f"{median * 1e3:8.3f} ms  {nbytes / median / 1e9:8.2f} GB/s"
        )
    if result["error"] is not None:
        lines.append(f"  {name}: refused: {result['error']}")
    return lines


def kv_block_bytes(path: str) -> int:
    """One 16-token KV block of every layer, float32 (the engine's paged layout)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(path)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers * 2 * 16 * c.num_key_value_heads * head_dim * 4


def main() -> None:
    """Safe parts first: CUDA IPC and TP=1, then the two that put two NCCL ranks on one device
    (the KV pair, PP=2), which NCCL may refuse or hang on until their bounds. The JSON is
    rewritten after each part, so a run cut short by its caller's timeout keeps what finished."""
    args = parse_args()
    results: dict[str, Any] = {"device": args.device, "torch": torch.__version__, "kv": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or write_checkpoint(args, tmp)
        print(f"checkpoint {path} on {args.device}", flush=True)
        block = kv_block_bytes(path)
        kv_part(args, results, "ipc", block)
        runs = [engine_part(args, results, path, [], "TP=1", 1)]
        kv_part(args, results, "pair", block)
        if not args.smoke:
            one_device_ranks(args.init_timeout)
        engine_part(args, results, path, runs, "PP=2, one device", 2)
        results["parity"] = parity(*runs)
        print(results["parity"], flush=True)
        save(args, results)


def kv_part(args: argparse.Namespace, results: dict[str, Any], kind: str, block: int) -> None:
    name = {"ipc": "IPC queue", "pair": "gloo pair" if args.smoke else "NCCL pair"}[kind]
    results["kv"].append(kv_transfer(args, kind, block))
    print(f"KV blocks between two processes on one device, {name}:", flush=True)
    for line in report_kv(results["kv"][-1], name):
        print(line, flush=True)
    save(args, results)


def engine_part(
    args: argparse.Namespace,
    results: dict[str, Any],
    path: str,
    runs: list[EngineRun],
    layout: str,
    pp: int,
) -> EngineRun:
    runs.append(run_engine(args, path, layout, pp))
    print(runs[-1].summary(), flush=True)
    results["engines"] = [dataclasses.asdict(r) for r in runs]
    save(args, results)
    return runs[-1]


def write_checkpoint(args: argparse.Namespace, tmp: str) -> str:
    """A random checkpoint: the tiny 6-layer Llama for --smoke, else a Llama-3.2-1B shape (drawn
    on the GPU: seconds, not a minute)."""
    from tests.random_checkpoint import SHAPES, write_random_checkpoint
    from tests.workers.test_pipeline_split import TINY_PP_LLAMA

    spec = TINY_PP_LLAMA if args.smoke else SHAPES["llama3-1b"]
    return write_random_checkpoint(spec, tmp, device=args.device).path


def save(args: argparse.Namespace, results: dict[str, Any]) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, gloo")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--blocks", default=None, help="blocks per payload, e.g. 1,16,64")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds a pull may take")
    parser.add_argument("--model", default=None, help="an HF checkpoint (default: write one)")
    parser.add_argument(
        "--init-timeout", type=float, default=90.0, help="seconds PP=2's ranks may take to start"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or --smoke for the CPU run)")
    args.device = "cpu" if args.smoke else "cuda"
    args.requests = args.requests or (4 if args.smoke else 8)
    args.prompt_len = args.prompt_len or (12 if args.smoke else 64)
    args.steps = args.steps or (6 if args.smoke else 32)
    args.blocks = [int(b) for b in (args.blocks or ("1,4" if args.smoke else "1,16,64")).split(",")]
    args.repeats = args.repeats or (3 if args.smoke else 5)
    return args


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        raise
