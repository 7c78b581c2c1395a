"""Soak: does a replica's memory stay flat over thousands of requests?

Drives a steady, varied load and samples resident memory as it goes; prints a table and the growth
after warm-up. A tiny random Llama (tests/random_checkpoint.py, SmolLM2's tokenizer) keeps the
model's own memory out of the picture, so what grows is the serving path's.

  inproc  the replica's engine path without Ray: an EngineCore built on a passing thread and
          stepped by cluster.engine_loop.EngineLoop, as LLMReplica does. Fast to iterate on; it
          samples its own RSS and glibc's heap figures (mallinfo2).
  served  the real Serve app (ingress + one LLMReplica) on 127.0.0.1: streamed chat completions
          with n=2, a share cancelled mid-stream, at a fixed concurrency; samples the replica
          actor's RSS (its pid from LLMReplica.stats) and the ingress's.

Both bound themselves by --requests (HTTP-equivalent requests: each is n engine requests).

  python bench/soak.py inproc --requests 4000
  python bench/soak.py inproc --requests 4000 --env MALLOC_ARENA_MAX=2   # a variant, re-exec'd
  flock /tmp/raylm-ray.lock timeout 3600 python bench/soak.py served --requests 9000
Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import random
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages first
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
SERVED_NAME = "tiny-soak"


# ---- memory figures ------------------------------------------------------------------------------
def proc_status_mib(pid: int | str = "self") -> dict[str, float]:
    """VmRSS, RssAnon and RssFile of a process, in MiB (anonymous memory is what a leak grows)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) / 1024
    return out


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        return libc
    except (OSError, AttributeError):
        return None


def heap_mib() -> dict[str, float]:
    """glibc's view of this process's malloc heap (all arenas): bytes in use and bytes free but
    kept, and the number of arenas. Free-but-kept growing while in-use stays flat is fragmentation
    or an untrimmed heap; each arena keeps its own free memory."""
    libc = _libc()
    if libc is None:
        return {}
    m = libc.mallinfo2()
    return {
        "heap_used": m.uordblks / MiB,
        "heap_free": m.fordblks / MiB,
        "mmapped": m.hblkhd / MiB,
        "arenas": _arenas(libc),
    }


def _arenas(libc: ctypes.CDLL) -> float:
    """How many malloc arenas the process has (from malloc_info's XML)."""
    with tempfile.NamedTemporaryFile("r") as f:
        libc.fopen.restype = ctypes.c_void_p
        fp = libc.fopen(f.name.encode(), b"w")
        if not fp:
            return float("nan")
        libc.malloc_info(0, ctypes.c_void_p(fp))
        libc.fclose(ctypes.c_void_p(fp))
        return float(f.read().count("<heap nr="))


# ---- the workload --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Job:
    """One HTTP-equivalent request: a prompt, its n choices' parameters, and where (if at all) the
    client walks away."""

    index: int
    prompt_len: int
    max_tokens: int
    cancel_after: int | None  # output tokens (per choice) after which the client cancels
    seeded: bool
    penalised: bool
    logprobs: int | None


def make_jobs(args: argparse.Namespace) -> list[Job]:
    rng = random.Random(args.seed)
    jobs = []
    for i in range(args.requests):
        max_tokens = rng.randint(args.min_tokens, args.max_tokens)
        cancel = rng.random() < args.cancel_frac
        jobs.append(
            Job(
                index=i,
                prompt_len=rng.randint(args.min_prompt, args.max_prompt),
                max_tokens=max_tokens,
                cancel_after=rng.randint(1, max(1, max_tokens - 1)) if cancel else None,
                seeded=rng.random() < 0.5,
                penalised=rng.random() < 0.25,
                logprobs=rng.choice([None, None, None, 0, 2]),
            )
        )
    return jobs


def prompt_words(job: Job, vocab_size: int) -> list[int]:
    """Token ids of a job's prompt: mostly random, sometimes sharing a prefix with earlier jobs
    (the prefix cache fills and evicts, as under real traffic)."""
    rng = random.Random(job.index)
    shared = [3 + (7 * k) % (vocab_size - 3) for k in range(job.prompt_len // 2)]
    own = [rng.randrange(3, vocab_size) for _ in range(job.prompt_len)]
    return (shared + own)[: job.prompt_len] if job.index % 3 == 0 else own


# ---- the memory table ----------------------------------------------------------------------------
class Samples:
    """RSS (and other figures) at request counts; prints a row per sample."""

    def __init__(self, columns: list[str]) -> None:
        self.columns = columns
        self.rows: list[tuple[int, float, dict[str, float]]] = []
        self.start = time.perf_counter()
        print("| requests | elapsed s | " + " | ".join(columns) + " |")
        print("| --- | --- | " + " | ".join("---" for _ in columns) + " |", flush=True)

    def add(self, done: int, figures: dict[str, float]) -> None:
        elapsed = time.perf_counter() - self.start
        self.rows.append((done, elapsed, figures))
        cells = " | ".join(f"{figures.get(c, float('nan')):.1f}" for c in self.columns)
        print(f"| {done} | {elapsed:.0f} | {cells} |", flush=True)

    def summary(self, warmup: int, key: str) -> None:
        after = [r for r in self.rows if r[0] >= warmup]
        if len(after) < 2:
            print(f"too few samples after the warm-up of {warmup} requests")
            return
        (n0, t0, f0), (n1, t1, f1) = after[0], after[-1]
        a, b = f0[key], f1[key]
        rate = (n1 - n0) / (t1 - t0) if t1 > t0 else float("nan")
        print(
            f"\n{key} after warm-up: {a:.0f} MiB at {n0} requests -> {b:.0f} MiB at {n1} "
            f"({b - a:+.0f} MiB, {100 * (b - a) / a:+.1f}%); {rate:.2f} requests/s"
        )
        for c in self.columns:
            if c != key and c in f0 and c in f1:
                print(f"  {c}: {f0[c]:.1f} -> {f1[c]:.1f} ({f1[c] - f0[c]:+.1f})")


# ---- the model -----------------------------------------------------------------------------------
def tiny_model(path: str | None) -> str:
    """The served tiny Llama of the tests (256 positions, SmolLM2's tokenizer without its chat
    template), written once into `path` (a temporary directory when None)."""
    from transformers import AutoTokenizer

    from tests.random_checkpoint import TINY_SERVED_LLAMA, write_random_checkpoint
    from workers.model_files import resolve_model

    path = path or tempfile.mkdtemp(prefix="raylm-soak-")
    if (Path(path) / "config.json").exists():
        return path
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("default"))
    tokenizer.chat_template = None
    spec = TINY_SERVED_LLAMA.with_fields(max_position_embeddings=256)
    return write_random_checkpoint(spec, path, tokenizer=tokenizer).path


def engine_kwargs(model_dir: str) -> dict:
    return dict(
        model=model_dir,
        max_model_len=256,
        kv_cache_memory_gb=0.1,
        load_progress=False,
    )


# ---- in-process ----------------------------------------------------------------------------------
def sampling_params(job: Job, choice: int):
    from scheduler import SamplingParams

    return SamplingParams(
        max_tokens=job.max_tokens,
        temperature=0.8,
        top_p=0.95,
        seed=job.index * 2 + choice if job.seeded else None,
        frequency_penalty=0.5 if job.penalised else 0.0,
        presence_penalty=0.3 if job.penalised else 0.0,
        logprobs=job.logprobs,
        ignore_eos=True,
    )


async def run_inproc(args: argparse.Namespace) -> None:
    from cluster.engine_build import on_passing_thread
    from cluster.engine_loop import EngineLoop
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from scheduler import EngineRequest

    model_dir = tiny_model(args.model_dir)
    config = EngineConfig.from_kwargs(**engine_kwargs(model_dir))
    engine = on_passing_thread(lambda: EngineCore(config))
    vocab = engine.vocab_size
    done_events: dict[str, asyncio.Event] = {}
    tokens: dict[str, int] = {}
    cancel_at: dict[str, int] = {}
    loop_ref: list[EngineLoop] = []

    def on_step(outputs, stats) -> None:
        for out in outputs:
            rid = out.request_id
            if rid not in done_events:
                continue
            tokens[rid] = tokens.get(rid, 0) + len(out.new_token_ids)
            if out.finished:
                done_events[rid].set()
            elif rid in cancel_at and tokens[rid] >= cancel_at[rid]:
                loop_ref[0].abort([rid])  # the client walked away: the replica aborts
                done_events[rid].set()

    def on_error(rid, exc) -> None:
        print(f"error {rid}: {exc!r}", file=sys.stderr)
        for event in done_events.values() if rid is None else [done_events.get(rid)]:
            if event is not None:
                event.set()

    loop = EngineLoop(engine, asyncio.get_running_loop(), on_step, on_error)
    loop_ref.append(loop)
    jobs = make_jobs(args)
    columns = ["VmRSS", "RssAnon", "RssFile", "heap_used", "heap_free", "mmapped", "arenas"]
    if args.tracemalloc:
        tracemalloc.start()
        columns.append("py_heap")
    samples = Samples(columns)
    done = 0

    def sample() -> None:
        figures = {**proc_status_mib(), **heap_mib()}
        if args.tracemalloc:
            figures["py_heap"] = tracemalloc.get_traced_memory()[0] / MiB
        samples.add(done, figures)

    async def one(job: Job) -> None:
        nonlocal done
        prompt = prompt_words(job, vocab)
        rids = [f"soak-{job.index}-{c}" for c in range(args.n)]
        for c, rid in enumerate(rids):
            done_events[rid] = asyncio.Event()
            if job.cancel_after is not None:
                cancel_at[rid] = job.cancel_after
            loop.add(EngineRequest(rid, prompt, sampling_params(job, c)))
        for rid in rids:
            await done_events[rid].wait()
        for rid in rids:  # only now: on_step skips ids it no longer knows
            del done_events[rid]
            tokens.pop(rid, None)
            cancel_at.pop(rid, None)
        done += 1
        if done % args.sample_every == 0:
            sample()

    sample()
    queue = iter(jobs)

    async def worker() -> None:
        for job in queue:
            await one(job)

    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    loop.stop(shutdown_engine=True)
    samples.summary(args.warmup, "VmRSS")


# ---- served --------------------------------------------------------------------------------------
def replica_pids(app: str) -> tuple[int, int | None]:
    """(LLMReplica's pid, the ingress's pid) of the app: the replica names its own process in its
    stats (model_pids: TP=1 runs the model in the replica actor)."""
    import psutil
    from ray import serve

    stats = serve.get_deployment_handle("LLMReplica", app_name=app).stats.remote().result()
    ingress = None
    for proc in psutil.process_iter(["cmdline"]):
        if any(f"{app}:OpenAIIngress" in part for part in proc.info["cmdline"] or ()):
            ingress = proc.pid
    return stats["model_pids"][0], ingress


_seen_errors: set[int] = set()
_WORDS = (  # noqa: SIM905 (a word list reads better as words)
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there one all we their can has more will would time been"
).split()


async def served_one(client, job: Job, args: argparse.Namespace, vocab: int) -> str:
    """One streamed chat completion with n choices; returns its outcome ("ok", "cancelled", or an
    error). A cancelled one closes the stream after `cancel_after` content chunks."""
    # Common English words are one token each in SmolLM2's tokenizer: about prompt_len tokens.
    words = " ".join(_WORDS[t % len(_WORDS)] for t in prompt_words(job, vocab))
    body = {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": words}],
        "n": args.n,
        "max_tokens": job.max_tokens,
        "temperature": 0.8,
        "top_p": 0.95,
        "stream": True,
        "ignore_eos": True,
    }
    if job.seeded:
        body["seed"] = job.index
    if job.penalised:
        body.update(frequency_penalty=0.5, presence_penalty=0.3)
    if job.logprobs is not None:
        body.update(logprobs=True, top_logprobs=job.logprobs)
    chunks = 0
    try:
        async with client.stream("POST", "/chat/completions", json=body) as r:
            if r.status_code != 200:
                body = (await r.aread())[:300].decode(errors="replace")
                if r.status_code not in _seen_errors:
                    _seen_errors.add(r.status_code)
                    print(f"first HTTP {r.status_code}: {body}", flush=True)
                return f"http {r.status_code}"
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    if job.cancel_after is not None and chunks >= job.cancel_after:
                        return "cancelled"  # leaving the block closes the connection mid-stream
        return "ok"
    except Exception as exc:
        return f"error {type(exc).__name__}"


async def served_load(
    args: argparse.Namespace, url: str, pids: tuple[int, int | None], vocab: int
) -> None:
    import httpx

    replica_pid, ingress_pid = pids
    print(f"replica pid {replica_pid}, ingress pid {ingress_pid}")
    samples = Samples(["VmRSS", "RssAnon", "RssFile", "ingress_VmRSS"])
    outcomes: dict[str, int] = {}
    done = 0

    def sample() -> None:
        figures = proc_status_mib(replica_pid)
        if ingress_pid is not None:
            figures["ingress_VmRSS"] = proc_status_mib(ingress_pid)["VmRSS"]
        samples.add(done, figures)

    jobs = iter(make_jobs(args))
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        sample()

        async def worker() -> None:
            nonlocal done
            for job in jobs:
                outcome = await served_one(client, job, args, vocab)
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
                done += 1
                if done % args.sample_every == 0:
                    sample()

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    print(f"\noutcomes: {dict(sorted(outcomes.items()))}")
    samples.summary(args.warmup, "VmRSS")


def run_served(args: argparse.Namespace) -> None:
    import ray
    from ray import serve

    from deploy.app import build_app
    from workers.distributed import free_port

    model_dir = tiny_model(args.model_dir)
    ray.init(
        num_cpus=8,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
    )
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app_args = {
            **engine_kwargs(model_dir),
            "served_model_name": SERVED_NAME,
            "num_replicas": 1,
            "max_ongoing_requests": args.concurrency * args.n,
            "replica_num_cpus": 2,  # cpu_threads 2: both cores of the box, as inproc
            "ingress_num_cpus": 0.5,
        }
        serve.run(build_app(app_args), name="soak", route_prefix="/")
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model_dir).vocab_size
        pids = replica_pids("soak")  # outside the event loop: a sync handle call
        asyncio.run(served_load(args, f"http://127.0.0.1:{port}/v1", pids, vocab))
    finally:
        serve.shutdown()
        ray.shutdown()


def _commit() -> str:
    import subprocess

    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# ---- entry ---------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["inproc", "served"])
    p.add_argument("--requests", type=int, default=9000, help="HTTP-equivalent requests")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--n", type=int, default=2, help="choices per request")
    p.add_argument("--cancel-frac", type=float, default=0.1)
    p.add_argument("--min-prompt", type=int, default=4)
    p.add_argument("--max-prompt", type=int, default=160)
    p.add_argument("--min-tokens", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--sample-every", type=int, default=500)
    p.add_argument("--warmup", type=int, default=1000, help="requests before growth is counted")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", help="where the tiny checkpoint is (written if absent)")
    p.add_argument("--tracemalloc", action="store_true", help="inproc: also the Python heap")
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="inproc: re-run this process with these set (allocator variants)",
    )
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.env and os.environ.get("RAYLM_SOAK_REEXEC") != "1":
        # glibc and libgomp read their variables at start-up: set them, then start again.
        env = dict(os.environ, RAYLM_SOAK_REEXEC="1")
        env.update(kv.split("=", 1) for kv in args.env)
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    print(f"soak {args.mode}: {vars(args)}", flush=True)
    print(f"code: {ROOT} at {_commit()}", flush=True)
    if args.mode == "inproc":
        asyncio.run(run_inproc(args))
    else:
        run_served(args)


if __name__ == "__main__":
    main()
