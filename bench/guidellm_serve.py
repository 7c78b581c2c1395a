"""GuideLLM (a third-party benchmark client) against deploy.yaml as `make serve` runs it, and the
offline engine's decode step at the same batch, measured in the same invocation.

GuideLLM is a benchmark client, not a dependency: install it in its own virtualenv, pinned CPU torch
first (else pip pulls the CUDA build), and point --guidellm at its executable:

    python3 -m venv /tmp/guidellm && /tmp/guidellm/bin/pip install torch==2.13.0 guidellm==0.8.1
    python bench/guidellm_serve.py --guidellm /tmp/guidellm/bin/guidellm [--concurrency 8]
    [--requests 32]
        [--set replica_num_cpus=1 --set cpu_threads=1]   # A/B an app arg without editing
        deploy.yaml

It times the offline decode step (bench/step_profile.py's runner, batch = concurrency, contexts
spanning prompt to prompt + output), starts `serve run deploy.yaml` (RAY_AUTH_MODE=disabled), runs
GuideLLM at a fixed concurrency with synthetic prompts, stops Serve, times the offline step again,
and prints TTFT, ITL and the ratio of ITL to the faster of the two offline figures (on a machine
shared with other jobs, a loaded offline figure would flatter the ratio). Figures only; nothing
passes or fails here.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.request import urlopen

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
MODEL = "SmolLM2-135M-Instruct"
# App args every GuideLLM run sets beside --set: none. (GuideLLM 0.8.1 streams with vLLM's
# stream_options.continuous_usage_stats, which raylm implements.)
GUIDELLM_OVERRIDES: tuple[str, ...] = ()


def wait_ready(url: str, timeout_s: float = 300, proc: subprocess.Popen | None = None) -> None:
    """Wait for url's /v1/models to answer; stop early when the server `proc` has exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"the server for {url} exited with {proc.returncode} before it answered"
            )
        try:
            with urlopen(f"{url}/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError(f"{url} did not answer /v1/models within {timeout_s:.0f} s")


def guidellm_benchmark(
    exe: str,
    url: str,
    tokenizer: str,
    a: argparse.Namespace,
    out: Path,
    model: str = MODEL,
    timeout_s: float | None = None,
    backend_options: tuple[str, ...] = (),
    max_seconds: float | None = None,
) -> dict:
    """GuideLLM's one benchmark (metrics, request totals, timings) at a.concurrency streams of
    a.requests synthetic requests against url serving `model`; backend_options are more
    `key=value` settings of its openai_http backend (request_format, validate_backend, ...).
    With max_seconds GuideLLM itself stops sending after that long and reports the requests it
    finished (the ones in flight count as incomplete), so a slow run still gives figures."""
    cmd = [
        exe,
        "run",
        "--backend",
        ",".join([f"kind=openai_http,target={url},model={model}", *backend_options]),
        "--profile",
        f"kind=concurrent,streams={a.concurrency}",
        "--constraint",
        f"kind=max_requests,count={a.requests}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={a.prompt_tokens},output_tokens={a.output_tokens}",
        "--tokenizer",
        f"kind=huggingface_auto,model={tokenizer}",
        "--output",
        f"kind=json,path={out}",
        "--disable-progress",
    ]
    if max_seconds is not None:
        cmd += ["--constraint", f"kind=max_duration,seconds={max_seconds:g}"]
    # Its own session, so a run past timeout_s is stopped with the worker processes it forked.
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        code = proc.wait(timeout=timeout_s)
    except BaseException:  # past timeout_s, or this process interrupted
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if code != 0:
        raise subprocess.CalledProcessError(code, cmd)
    return json.loads(out.read_text())["benchmarks"][0]


def offline_step_ms(batch: int, context: tuple[int, int], repeats: int = 10) -> float:
    """Median of the offline engine's decode step (forward + logits) at this batch and context."""
    import torch

    from bench.step_profile import build_runner

    runner, step = build_runner("float32", batch, context)
    with torch.inference_mode():
        runner._forward(step)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            runner._forward(step)
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def deploy_file(overrides: list[str], tmp: Path, port: int | None = None) -> Path:
    """deploy.yaml itself, or a copy with `key=value` app args replaced (values parsed as YAML)
    and, with `port`, its HTTP port."""
    if not overrides and port is None:
        return ROOT / "deploy.yaml"
    config = yaml.safe_load((ROOT / "deploy.yaml").read_text())
    if port is not None:
        config["http_options"]["port"] = port
    args = config["applications"][0]["args"]
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set: expected key=value, got {item!r}")
        args[key] = yaml.safe_load(value)
    path = tmp / "deploy.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--guidellm", required=True, help="the guidellm executable (its own virtualenv)"
    )
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=158)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=8000, help="deploy.yaml's port")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one of deploy.yaml's app args (repeatable)",
    )
    args = parser.parse_args()
    from workers.model_files import resolve_model

    tokenizer = resolve_model("default")  # the directory the embedded GGUF is converted into
    url = f"http://127.0.0.1:{args.port}"
    context = (args.prompt_tokens, args.prompt_tokens + args.output_tokens)
    step_before = offline_step_ms(args.concurrency, context)
    serve_bin = str(Path(sys.executable).parent / "serve")
    tmp = tempfile.TemporaryDirectory()
    server = subprocess.Popen(
        [serve_bin, "run", str(deploy_file([*GUIDELLM_OVERRIDES, *args.set], Path(tmp.name)))],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_ready(url)
        metrics = guidellm_benchmark(
            args.guidellm, url, tokenizer, args, Path(tmp.name) / "guidellm.json"
        )["metrics"]
    finally:
        tmp.cleanup()
        server.terminate()
        server.wait(timeout=120)
        subprocess.run(
            [str(Path(sys.executable).parent / "ray"), "stop", "--force"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    ok = lambda name: metrics[name]["successful"]  # noqa: E731
    step_after = offline_step_ms(args.concurrency, context)
    step = min(step_before, step_after)
    itl, ttft = ok("inter_token_latency_ms"), ok("time_to_first_token_ms")
    print(
        f"GuideLLM concurrency {args.concurrency}, {args.requests} requests, {args.prompt_tokens} "
        "prompt / "
        f"{args.output_tokens} output tokens (synthetic), deploy.yaml {' '.join(args.set)}"
    )
    print(
        f"offline decode step at batch {args.concurrency}: {step_before:.1f} ms before serving, "
        f"{step_after:.1f} ms after; the ratio uses {step:.1f} ms"
    )
    print(
        "| TTFT p50 | TTFT p90 | ITL p50 | ITL p90 | TPOT p50 | output tok/s | offline decode "
        "step | ITL p50 / step |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(
        f"| {ttft['median'] / 1e3:.2f} s | {ttft['percentiles']['p90'] / 1e3:.2f} s | "
        f"{itl['median']:.1f} ms | "
        f"{itl['percentiles']['p90']:.1f} ms | {ok('time_per_output_token_ms')['median']:.1f} ms | "
        f"{ok('output_tokens_per_second')['mean']:.1f} | {step:.1f} ms | "
        f"{itl['median'] / step:.2f}x |"
    )


if __name__ == "__main__":
    main()
