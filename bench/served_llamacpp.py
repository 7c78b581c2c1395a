"""Served, same run: GuideLLM against `serve run deploy.yaml` (one or more `--set` variants) and
against llama.cpp's own OpenAI server on the same GGUF file, one after another on the same
GuideLLM settings (issue 31's served comparison).

GuideLLM and llama-cpp-python live in virtualenvs of their own (see bench/guidellm_serve.py for
GuideLLM's; llama-cpp-python with its `server` extra):

    python bench/served_llamacpp.py --guidellm /work/venvs/guidellm/bin/guidellm \\
        --llama-python /work/venvs/llamacpp/bin/python \\
        [--variant quantization=gguf --variant quantization=none] [--concurrency 1 8] \\
        [--requests 32] [--prompt-tokens 128] [--output-tokens 64] [--threads 2] \\
        [--max-seconds 240]   # GuideLLM ends a slow run there and reports what finished

llama.cpp runs first, then each raylm variant. Each system is started once, bound to 127.0.0.1
on a free port, warmed with one short request, then GuideLLM runs at each concurrency in turn
(completions, streamed, synthetic prompts). Each raylm variant is deploy.yaml with the variant's
app args replaced (`key=value[,key=value]`) and its port moved; after its runs the resident
memory of the app's Ray actor processes is read.
llama.cpp's server (`python -m llama_cpp.server`) loads the same GGUF file that deploy.yaml's
`model: default` names, with --threads threads for prompts and decode, serves it under raylm's
model name, and queues concurrent requests (`--interrupt_requests False`: by default a waiting
request cuts the streaming one short, so its requests would not all produce their tokens).

Every server runs in a session of its own and is stopped, with every process it started, when
its runs end or fail; each GuideLLM run and each start-up is bounded. Figures only: the targets
are printed beside the ratios, nothing passes or fails here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.request import Request, urlopen

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.guidellm_serve import (  # noqa: E402
    GUIDELLM_OVERRIDES,
    MODEL,
    deploy_file,
    guidellm_benchmark,
    wait_ready,
)

LLAMA_CPP = "llama.cpp"
# Issue 31's replica RSS before the quantized path (default 2 GiB KV pool included).
RSS_BEFORE_MIB = 3.6 * 1024
# Completions (GuideLLM's default is chat, whose template adds tokens each server counts its own
# way); readiness is checked on /v1/models first, as llama.cpp's server has no /health route.
BACKEND_OPTIONS = ("request_format=/v1/completions", "validate_backend=false")
TARGET_AGGREGATE = 2.0  # raylm's output tok/s at the highest concurrency / llama.cpp's
TARGET_ITL = 1.5  # raylm's ITL p50 at concurrency 1 / llama.cpp's
TARGET_RSS = 0.40  # the quantized default's replica RSS / RSS_BEFORE_MIB


@dataclass(slots=True)
class Result:
    """One system at one concurrency, from GuideLLM's JSON benchmark."""

    system: str
    concurrency: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    itl_p50_ms: float
    itl_p90_ms: float
    output_tok_s: float  # successful requests' output tokens / the benchmark's duration
    output_tokens_mean: float  # per successful request (64 unless a server stopped early)
    prompt_tokens_mean: float
    successful: int
    errored: int
    incomplete: int
    load_1m: float = float("nan")  # the machine's 1-minute load average as the run ended


@dataclass(slots=True)
class SystemRun:
    system: str
    results: list[Result] = field(default_factory=list)
    rss_mib: dict[str, float] = field(default_factory=dict)  # process title -> RSS after the runs
    error: str | None = None  # the server failed (start-up, warm-up)
    failed_runs: list[str] = field(default_factory=list)  # GuideLLM runs that failed or timed out


def parse_result(system: str, concurrency: int, bench: dict) -> Result:
    """The figures of one GuideLLM 0.8 JSON benchmark (`benchmarks[i]` of its output file)."""
    metrics = bench["metrics"]

    def ok(name: str) -> dict:
        return metrics[name]["successful"]

    totals = metrics["request_totals"]
    duration_s = bench["duration"]
    output_tokens = ok("output_token_count")
    return Result(
        system=system,
        concurrency=concurrency,
        ttft_p50_ms=ok("time_to_first_token_ms")["median"],
        ttft_p90_ms=ok("time_to_first_token_ms")["percentiles"]["p90"],
        itl_p50_ms=ok("inter_token_latency_ms")["median"],
        itl_p90_ms=ok("inter_token_latency_ms")["percentiles"]["p90"],
        output_tok_s=output_tokens["total_sum"] / duration_s if duration_s > 0 else float("nan"),
        output_tokens_mean=output_tokens["mean"],
        prompt_tokens_mean=ok("prompt_token_count")["mean"],
        successful=int(totals["successful"]),
        errored=int(totals["errored"]),
        incomplete=int(totals["incomplete"]),
    )


def replica_rss_mib(rss: dict[str, float]) -> float:
    """The engine's resident memory: the LLMReplica process and any engine worker actors."""
    return sum(v for k, v in rss.items() if "LLMReplica" in k or "RayWorker" in k)


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def render(runs: list[SystemRun], concurrencies: list[int]) -> str:
    """The Markdown tables: every system at every concurrency, then raylm against llama.cpp."""
    lines = [
        "| system | concurrency | prompt / output tokens | TTFT p50 | TTFT p90 | ITL p50 | "
        "ITL p90 | output tok/s | ok / errored / incomplete | load (1 min) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in runs:
        for failure in ([run.error] if run.error else []) + run.failed_runs:
            lines.append(f"| {run.system} | | failed: {failure} | | | | | | | |")
        for r in run.results:
            lines.append(
                f"| {r.system} | {r.concurrency} | {r.prompt_tokens_mean:.0f} / "
                f"{r.output_tokens_mean:.1f} | {r.ttft_p50_ms / 1e3:.2f} s | "
                f"{r.ttft_p90_ms / 1e3:.2f} s | {r.itl_p50_ms:.1f} ms | {r.itl_p90_ms:.1f} ms | "
                f"{r.output_tok_s:.1f} | {r.successful} / {r.errored} / {r.incomplete} | "
                f"{r.load_1m:.1f} |"
            )
    lines += ["", "| process (after the runs) | RSS MiB |", "| --- | ---: |"]
    for run in runs:
        for title, mib in sorted(run.rss_mib.items()):
            lines.append(f"| {run.system}: {title} | {mib:,.0f} |")
    by = {(r.system, r.concurrency): r for run in runs for r in run.results}
    top, low = max(concurrencies), min(concurrencies)
    lines += [
        "",
        f"| raylm variant | output tok/s at {top} / llama.cpp's (target >= {TARGET_AGGREGATE}x) | "
        f"ITL p50 at {low} / llama.cpp's (target <= {TARGET_ITL}x) | TTFT p50 at {top} / "
        f"llama.cpp's | replica RSS MiB / {RSS_BEFORE_MIB:,.0f} (target <= {TARGET_RSS:.2f}) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for run in runs:
        if run.system == LLAMA_CPP or not run.results:
            continue
        cells = []
        for conc, metric in ((top, "output_tok_s"), (low, "itl_p50_ms"), (top, "ttft_p50_ms")):
            mine, theirs = by.get((run.system, conc)), by.get((LLAMA_CPP, conc))
            if mine is None or theirs is None:
                cells.append("-")
                continue
            cells.append(f"{ratio(getattr(mine, metric), getattr(theirs, metric)):.2f}x")
        rss = replica_rss_mib(run.rss_mib)
        cells.append(f"{rss:,.0f} ({rss / RSS_BEFORE_MIB:.2f})" if rss else "-")
        lines.append(f"| {run.system} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- running the servers


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def process_tree(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        root = psutil.Process(proc.pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def ray_actor_rss_mib(proc: subprocess.Popen) -> dict[str, float]:
    """Resident memory of the Ray worker processes under `serve run` (titled ray::<actor>),
    summed per title."""
    rss: dict[str, float] = {}
    for p in process_tree(proc)[1:]:
        try:
            title = (p.cmdline() or [""])[0]
            if title.startswith("ray::") and "IDLE" not in title:
                rss[title] = rss.get(title, 0.0) + p.memory_info().rss / 2**20
        except psutil.Error:
            pass
    return rss


def stop(proc: subprocess.Popen, grace_s: float = 60) -> None:
    """Stop a server and everything it started: SIGINT (Serve shuts down its app and Ray), then
    SIGTERM and SIGKILL to its session's processes by id."""
    tree = process_tree(proc)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)  # the session start_new_session gave it
    _, alive = psutil.wait_procs(tree, timeout=10)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


@contextlib.contextmanager
def server(
    cmd: list[str], url: str, log: Path, start_timeout_s: float
) -> Iterator[subprocess.Popen]:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            wait_ready(url, start_timeout_s, proc)
            yield proc
        finally:
            stop(proc)


def warm_up(url: str, model: str) -> None:
    """One short completion, so a first request's one-time costs fall outside the runs."""
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 4}).encode()
    req = Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urlopen(req, timeout=120) as r:
        r.read()


def measure(
    system: str,
    cmd: list[str],
    port: int,
    args: argparse.Namespace,
    tokenizer: str,
    tmp: Path,
    rss_of: object,
    runs: list[SystemRun],
) -> None:
    """Start the server, run GuideLLM at each concurrency, read RSS, stop it; the run is in
    `runs` from the start, so an interrupted one keeps what it measured."""
    run = SystemRun(system)
    runs.append(run)
    url = f"http://127.0.0.1:{port}"
    log = tmp / f"{system.replace('/', '_').replace('=', '_').replace(',', '_')}.log"
    try:
        with server(cmd, url, log, args.start_timeout_s) as proc:
            warm_up(url, MODEL)
            for conc in args.concurrency:
                ns = argparse.Namespace(**vars(args))
                ns.concurrency = conc
                try:
                    bench = guidellm_benchmark(
                        args.guidellm, url, tokenizer, ns, tmp / "guidellm.json", MODEL,
                        args.run_timeout_s, BACKEND_OPTIONS, args.max_seconds,
                    )  # fmt: skip
                except subprocess.SubprocessError as exc:  # past its timeout, or it failed
                    run.failed_runs.append(f"concurrency {conc}: {type(exc).__name__}")
                    print(f"# {system}, concurrency {conc}: {exc!r}", file=sys.stderr, flush=True)
                    continue
                result = parse_result(system, conc, bench)
                result.load_1m = os.getloadavg()[0]
                run.results.append(result)
                print(f"# {json.dumps(asdict(result))}", file=sys.stderr, flush=True)
            run.rss_mib = rss_of(proc)  # type: ignore[operator]
    except Exception as exc:  # one system's failure must not lose the others' figures
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        print(f"# {system} failed: {exc!r}\n{tail}", file=sys.stderr, flush=True)
        run.error = type(exc).__name__


def run_raylm(
    args: argparse.Namespace, variant: str, tokenizer: str, tmp: Path, runs: list[SystemRun]
) -> None:
    """`serve run` on deploy.yaml with the variant's app args, on a free port."""
    port = free_port()
    overrides = [*GUIDELLM_OVERRIDES, *(item for item in variant.split(",") if item)]
    path = deploy_file(overrides, tmp, port)
    serve_bin = str(Path(sys.executable).parent / "serve")
    system = f"raylm {variant or 'deploy.yaml'}"
    cmd = [serve_bin, "run", str(path)]
    measure(system, cmd, port, args, tokenizer, tmp, ray_actor_rss_mib, runs)


def run_llama_cpp(
    args: argparse.Namespace, gguf: Path, tokenizer: str, tmp: Path, runs: list[SystemRun]
) -> None:
    """llama.cpp's OpenAI server on the same GGUF file, under raylm's model name."""
    port = free_port()
    cmd = [
        args.llama_python, "-m", "llama_cpp.server", "--model", str(gguf),
        "--model_alias", MODEL, "--n_threads", str(args.threads),
        "--n_threads_batch", str(args.threads), "--n_ctx", "2048",
        "--host", "127.0.0.1", "--port", str(port),
        "--interrupt_requests", "False", "--verbose", "False",
    ]  # fmt: skip

    def own_rss(proc: subprocess.Popen) -> dict[str, float]:
        return {"llama_cpp.server": psutil.Process(proc.pid).memory_info().rss / 2**20}

    measure(LLAMA_CPP, cmd, port, args, tokenizer, tmp, own_rss, runs)


def _raise_exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--guidellm", required=True, help="the guidellm executable")
    parser.add_argument(
        "--llama-python", help="a Python with llama-cpp-python[server] (omit: raylm only)"
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=None,
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="a raylm run: deploy.yaml with these app args replaced (repeatable; '' is "
        "deploy.yaml as is; default: quantization=gguf and quantization=none)",
    )
    parser.add_argument("--skip-raylm", action="store_true", help="llama.cpp's server only")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    parser.add_argument("--start-timeout-s", type=float, default=300)
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="GuideLLM stops each run after this long and reports the requests it finished",
    )
    parser.add_argument("--run-timeout-s", type=float, default=600, help="per GuideLLM run")
    args = parser.parse_args()
    if args.max_seconds is not None:
        args.run_timeout_s = max(args.run_timeout_s, args.max_seconds + 120)
    # `timeout` and kill send SIGTERM: raise, so every server's cleanup runs.
    signal.signal(signal.SIGTERM, _raise_exit)
    variants = ["quantization=gguf", "quantization=none"] if args.variant is None else args.variant
    from workers.model_files import default_model_path, resolve_model

    gguf = default_model_path()  # deploy.yaml's `model: default`
    tokenizer = resolve_model("default")
    runs: list[SystemRun] = []
    try:
        with tempfile.TemporaryDirectory() as tmp_name:
            tmp = Path(tmp_name)
            if args.llama_python:  # first: the reference every raylm variant is read against
                run_llama_cpp(args, gguf, tokenizer, tmp, runs)
            for variant in [] if args.skip_raylm else variants:
                run_raylm(args, variant, tokenizer, tmp, runs)
    finally:  # interrupted (SIGTERM from a timeout) too: print what was measured
        print(
            f"GuideLLM: completions, streamed, {args.requests} requests per concurrency, "
            f"synthetic prompts of {args.prompt_tokens} tokens, {args.output_tokens} output "
            f"tokens; llama.cpp: {gguf.name}, {args.threads} threads"
        )
        print(render(runs, args.concurrency), flush=True)


if __name__ == "__main__":
    main()
