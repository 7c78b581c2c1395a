"""Time real engine steps on this machine and fit the simulator's cost profile.

    python bench/calibrate.py [--model default|DIR | --random-shape NAME] [--device cpu|cuda] ...
    python bench/calibrate.py --from-samples SAMPLES.json --output PROFILE.json   (refit; no torch)


The engine is built in this process (TP=1, LocalExecutor), so no Ray is needed: the GPU machine
has CUDA torch, transformers and safetensors only. Each step is timed as the simulator counts one
(schedule + forward + sample + update_from_output). Before anything is timed, one large prefill,
one full decode batch and a small mixed batch run untimed (allocator, oneDNN primitives, GPU kernel
compilation); each shape then runs one more untimed step before `repeats` timed ones, and the fit
takes their median.

Held out from the fit, and reported: a second grid of shapes, the chunked-prefill steps that set up
the decode shapes (prefill chunks over prior context, mixed with decodes), and a small mixed batch
of requests of random lengths run to completion.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# Run as a script from anywhere (the GPU machine has the tree, not an install).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler import EngineRequest, SamplingParams, SchedulerConfig
from sim.cost import PROFILE_DIR, CostModel
from sim.fit import (
    FitError,
    StepSample,
    fit_coefficients,
    prediction_error,
    samples_from_json,
    samples_to_json,
)
from sim.replica import step_shape

logger = logging.getLogger(__name__)

# (prefill tokens, sequences they are split over), (decode batch, context tokens per sequence).
_CPU_GRID = dict(
    prefill=(
        (16, 1),
        (64, 1),
        (256, 1),
        (512, 1),
        (1024, 1),
        (2048, 1),
        (256, 4),
        (1024, 4),
        (2048, 8),
    ),
    decode=((1, 32), (1, 320), (8, 32), (8, 320), (32, 32), (32, 320), (64, 32), (64, 320)),
    heldout_prefill=((128, 1), (768, 2), (1536, 1)),
    heldout_decode=((4, 160), (16, 192), (48, 256)),
    budget=2048,
)
_CUDA_GRID = dict(
    prefill=((16, 1), (128, 1), (512, 1), (2048, 1), (8192, 1), (512, 8), (2048, 16), (8192, 32)),
    decode=(
        (1, 128),
        (1, 2048),
        (8, 128),
        (8, 2048),
        (32, 128),
        (32, 2048),
        (64, 512),
        (128, 128),
        (128, 2048),
        (256, 128),
        (256, 1024),
    ),
    heldout_prefill=((256, 1), (1024, 4), (4096, 2)),
    heldout_decode=((4, 1024), (16, 512), (96, 768), (192, 256)),
    budget=8192,
)


@dataclass(slots=True)
class CalibrationConfig:
    """What to build and which step shapes to time (empty shape lists: the device's default
    grid)."""

    model: str = "default"
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = None  # CPU: torch intra-op threads (None: what the process has)
    repeats: int = 3  # timed steps per shape; the fit uses their median
    prefill: tuple[tuple[int, int], ...] = ()
    decode: tuple[tuple[int, int], ...] = ()
    heldout_prefill: tuple[tuple[int, int], ...] = ()
    heldout_decode: tuple[tuple[int, int], ...] = ()
    budget: int = 0  # max_num_batched_tokens (0: the grid's)
    workload_requests: int = 24  # the held-out mixed batch (0: none)
    seed: int = 0
    label: str = ""  # model name in the profile's name (default: derived from model)

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device: must be cpu or cuda, got {self.device!r}")
        if self.repeats < 1:
            raise ValueError(f"repeats: must be >= 1, got {self.repeats}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads: must be >= 1, got {self.threads}")
        grid = _CUDA_GRID if self.device == "cuda" else _CPU_GRID
        for name in ("prefill", "decode", "heldout_prefill", "heldout_decode", "budget"):
            if not getattr(self, name):
                setattr(self, name, grid[name])
        for name in ("prefill", "heldout_prefill"):
            for tokens, seqs in getattr(self, name):
                if not 1 <= seqs <= tokens <= self.budget:
                    raise ValueError(
                        f"{name}: need 1 <= seqs <= tokens <= budget ({self.budget}), got "
                        f"{(tokens, seqs)}"
                    )
        for name in ("decode", "heldout_decode"):
            if any(b < 1 or c < 1 for b, c in getattr(self, name)):
                raise ValueError(f"{name}: batch and context must be >= 1")
        if len(self.prefill) + 2 * len(self.decode) < 9:
            raise ValueError(
                "prefill/decode: need at least 9 fitted steps (a decode shape gives two) "
                "for 9 coefficients"
            )


@dataclass(slots=True)
class Calibration:
    """The fitted profile, the samples behind it, and its error on steps it never saw."""

    profile: CostModel
    fit_samples: list[StepSample]
    heldout: dict[str, list[StepSample]]  # "shapes", "chunked prefill", "mixed batch"

    def errors(self) -> dict[str, FitError]:
        return {name: prediction_error(self.profile, s) for name, s in self.heldout.items() if s}

    def report(self) -> str:
        lines = [
            f"fit: {prediction_error(self.profile, self.fit_samples)} (the "
            f"{len(self.fit_samples)} fitted shapes)"
        ]
        lines += [f"held out, {name}: {err}" for name, err in self.errors().items()]
        return "\n".join(lines)


class StepTimer:
    """Runs an engine's steps one at a time, timing each as the simulator counts a step."""

    def __init__(self, engine, seed: int) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self.num_requests = 0

    def add(self, prompt_len: int, max_tokens: int) -> str:
        """A request with a fresh random prompt (no prefix-cache hit), greedy, ignoring EOS."""
        self.num_requests += 1
        rid = f"cal-{self.num_requests}"
        vocab = int(self.engine.vocab_size)
        prompt = [self.rng.randrange(3, vocab) for _ in range(prompt_len)]
        self.engine.add_request(
            EngineRequest(
                rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            )
        )
        return rid

    def step(self) -> StepSample | None:
        sched = self.engine.scheduler
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        if out.is_empty:
            return None
        prefill, decode, kv_read, pairs = step_shape(
            out, sched.requests
        )  # not timed: the engine does not do it
        t2 = time.perf_counter()
        runner_out = self.engine.executor.execute_model(out)
        sched.update_from_output(out, runner_out)
        seconds = (t1 - t0) + (time.perf_counter() - t2)
        return StepSample(prefill, decode, kv_read, len(out.num_scheduled_tokens), seconds, pairs)

    def drain(self) -> list[StepSample]:
        out = []
        while self.engine.has_unfinished_requests():
            s = self.step()
            if s is not None:
                out.append(s)
        return out

    def prefill(self, tokens: int, seqs: int, repeats: int) -> list[StepSample]:
        """repeats + 1 runs of one step prefilling `tokens` over `seqs` new requests (the first
        untimed)."""
        runs = []
        for _ in range(repeats + 1):
            for i in range(seqs):
                self.add(tokens // seqs + (1 if i < tokens % seqs else 0), max_tokens=1)
            first = self.step()
            self.drain()
            if first is None or first.prefill_tokens != tokens:
                raise RuntimeError(f"prefill shape {(tokens, seqs)}: the step ran {first}")
            runs.append(first)
        return runs[1:]

    def decode(
        self, batch: int, context: int, repeats: int, budget: int, mixed_prompt: int
    ) -> tuple[list[StepSample], list[StepSample], list[StepSample]]:
        """`batch` requests at ~`context` tokens: (timed pure-decode steps, timed steps that also
        prefill
        one new `mixed_prompt`-token request, the setup steps before them); the first of each
        untimed."""
        max_tokens = _decode_max_tokens(batch, context, repeats, budget)
        ids = [self.add(context, max_tokens) for _ in range(batch)]
        setup, timed, mixed = [], [], []
        while len(timed) < repeats + 1:
            s = self._step_or_fail(batch, context)
            if s.prefill_tokens == 0 and s.decode_tokens == batch:
                timed.append(s)
            else:
                setup.append(s)
        for _ in range(repeats + 1):
            self.add(mixed_prompt, max_tokens=1)  # done in its prefill step
            s = self._step_or_fail(batch, context)
            if (s.prefill_tokens, s.decode_tokens) != (mixed_prompt, batch):
                raise RuntimeError(
                    f"decode shape {(batch, context)} beside a {mixed_prompt}-token prompt: ran {s}"
                )
            mixed.append(s)
        self.engine.abort_requests(ids)
        return timed[1:], mixed[1:], setup

    def _step_or_fail(self, batch: int, context: int) -> StepSample:
        s = self.step()
        if s is None:
            raise RuntimeError(f"decode shape {(batch, context)}: ran out of work")
        return s

    def mixed_batch(self, num: int, budget: int, seed: int) -> list[StepSample]:
        """num requests of random lengths (prompts 20-400, outputs 8-64; the same for a seed), run
        to completion."""
        rng = random.Random(seed)
        for _ in range(num):
            self.add(rng.randint(20, min(400, budget)), rng.randint(8, 64))
        return self.drain()


def _median_sample(runs: list[StepSample]) -> StepSample:
    """The middle run's shape with the median time of all runs."""
    mid = runs[len(runs) // 2]
    sample = StepSample(
        mid.prefill_tokens,
        mid.decode_tokens,
        mid.kv_read_tokens,
        mid.num_seqs,
        statistics.median(s.seconds for s in runs),
        mid.prefill_pairs,
    )
    logger.info(
        "step of %d prefill + %d decode tokens, %d KV read, %d seqs: median %.1f ms of %s",
        sample.prefill_tokens,
        sample.decode_tokens,
        sample.kv_read_tokens,
        sample.num_seqs,
        sample.seconds * 1e3,
        [round(s.seconds * 1e3, 1) for s in runs],
    )
    return sample


def _mixed_prompt(i: int, batch: int, budget: int) -> int:
    """The prompt prefilled beside a decode batch: a quarter of the budget, or 64 tokens, by
    turns."""
    return max(1, min(budget - batch, budget // 4 if i % 2 == 0 else 64))


def _decode_max_tokens(batch: int, context: int, repeats: int, budget: int) -> int:
    """Outputs a decode shape's requests may reach: the early ones decode while the rest prefill."""
    return math.ceil(batch * context / budget) + 2 * repeats + 8


def _build_engine(cfg: CalibrationConfig):
    from engine.config import EngineConfig
    from engine.core import EngineCore

    shapes = [*cfg.decode, *cfg.heldout_decode]
    lens = [c + _decode_max_tokens(b, c, cfg.repeats, cfg.budget) for b, c in shapes]
    max_len = math.ceil(max([*lens, cfg.budget + 1, 400 + 64]) / 16) * 16
    blocks = max(b * math.ceil(n / 16) for (b, _), n in zip(shapes, lens))
    seqs = max(
        [b + 1 for b, _ in shapes]
        + [n for _, n in (*cfg.prefill, *cfg.heldout_prefill)]
        + [cfg.workload_requests]
    )
    sched = SchedulerConfig(
        num_gpu_blocks=max(blocks, 2 * cfg.budget // 16) + 64,
        max_model_len=max_len,
        max_num_seqs=seqs,
        max_num_batched_tokens=cfg.budget,
        enable_prefix_caching=False,
    )
    return EngineCore(
        EngineConfig(
            model=cfg.model,
            dtype=cfg.dtype,
            device=cfg.device,
            cpu_threads=cfg.threads,
            seed=cfg.seed,
            load_progress=False,
            quantization="none",  # the simulator's shipped profiles are the fp32 path's
            scheduler=sched,
        )
    )


def _model_label(cfg: CalibrationConfig) -> str:
    if cfg.label:
        return cfg.label
    return (
        "smollm2-135m" if cfg.model == "default" else os.path.basename(os.path.normpath(cfg.model))
    )


def calibrate(cfg: CalibrationConfig) -> Calibration:
    """Build the engine, time the grid (and the held-out steps), fit the profile."""
    import torch

    load_before = os.getloadavg()[0]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    engine = _build_engine(cfg)
    params = list(engine.executor.runner.model.parameters())
    num_params = float(sum(p.numel() for p in params))
    weight_bytes = float(sum(p.numel() * p.element_size() for p in params))
    timer = StepTimer(engine, cfg.seed)
    t0 = time.perf_counter()
    _warm_up(timer, cfg)
    fit_samples, setup = _time_fit_shapes(timer, cfg)
    heldout = _time_heldout(timer, cfg)
    heldout["chunked prefill"] = setup + heldout["chunked prefill"]
    elapsed = time.perf_counter() - t0
    engine.shutdown()
    coeffs = fit_coefficients(fit_samples)
    where = (
        f"{torch.get_num_threads()} threads"
        if cfg.device == "cpu"
        else torch.cuda.get_device_name(0)
    )
    name = f"{cfg.device}-{_model_label(cfg)}-{cfg.dtype}"
    source = (
        f"bench/calibrate.py on {where}, {cfg.dtype}, {started}, load average {load_before:.1f} -> "
        f"{os.getloadavg()[0]:.1f}; {len(fit_samples)} shapes fitted (median of {cfg.repeats} "
        "steps each) "
        f"in {elapsed:.0f} s"
    )
    cal = Calibration(
        coeffs.to_cost_model(name, num_params, weight_bytes, source), fit_samples, heldout
    )
    held = "; ".join(f"{k}: {e}" for k, e in cal.errors().items())
    cal.profile = coeffs.to_cost_model(
        name, num_params, weight_bytes, f"{source}; held-out error, {held}"
    )
    return cal


def _warm_up(timer: StepTimer, cfg: CalibrationConfig) -> None:
    """Untimed: the largest prefill, the largest decode batch (set up by prefill chunks over prior
    context) and a mixed batch; a GPU compiles kernels for each new kind of step."""
    timer.prefill(cfg.budget, 1, 1)
    big = max(cfg.decode)
    timer.decode(
        big[0], min(big[1], max(64, 2 * cfg.budget // big[0])), 2, cfg.budget, cfg.budget // 4
    )
    timer.mixed_batch(8, cfg.budget, cfg.seed + 1)


def _time_fit_shapes(
    timer: StepTimer, cfg: CalibrationConfig
) -> tuple[list[StepSample], list[StepSample]]:
    """The fitted medians, and the setup steps of the decode shapes (held out; CPU only: on a GPU
    they are first encounters of their shapes, timed with kernel compilation)."""
    fit = [_median_sample(timer.prefill(t, s, cfg.repeats)) for t, s in cfg.prefill]
    chunked = []
    for i, (b, c) in enumerate(cfg.decode):
        timed, mixed, setup = timer.decode(
            b, c, cfg.repeats, cfg.budget, _mixed_prompt(i, b, cfg.budget)
        )
        fit += [_median_sample(timed), _median_sample(mixed)]
        chunked += setup if cfg.device != "cuda" else []
    return fit, chunked


def _time_heldout(timer: StepTimer, cfg: CalibrationConfig) -> dict[str, list[StepSample]]:
    """Held-out shapes and the mixed batch. A GPU compiles kernels for shapes it meets first (up to
    a second a step): there the decode shapes and the mixed batch run twice, the second reported."""
    shapes = [_median_sample(timer.prefill(t, s, cfg.repeats)) for t, s in cfg.heldout_prefill]
    for _ in range(2 if cfg.device == "cuda" else 1):
        decodes, chunked = [], []
        for i, (b, c) in enumerate(cfg.heldout_decode):
            timed, mixed, setup = timer.decode(
                b, c, cfg.repeats, cfg.budget, _mixed_prompt(i + 1, b, cfg.budget)
            )
            decodes += [_median_sample(timed), _median_sample(mixed)]
            chunked += setup
        batch = (
            timer.mixed_batch(cfg.workload_requests, cfg.budget, cfg.seed + 2)
            if cfg.workload_requests
            else []
        )
    return {"shapes": shapes + decodes, "chunked prefill": chunked, "mixed batch": batch}


def _shape(text: str) -> tuple[int, int]:
    a, _, b = text.partition(":")
    try:
        return int(a), int(b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B integers, got {text!r}") from None


def cmd_calibrate(a: argparse.Namespace) -> None:
    """Time real engine steps (or refit saved ones), fit a profile, print its held-out error, write
    it."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if a.from_samples:
        if not a.output:
            raise ValueError(
                "output: --from-samples needs --output (the device's default profile is not "
                "replaced)"
            )
        data = json.loads(Path(a.from_samples).read_text())
        cal = _refit(data, samples_from_json)
    elif a.random_shape:
        import tempfile

        # torch and transformers: loaded here only
        from tests.random_checkpoint import SHAPES, write_random_checkpoint

        with tempfile.TemporaryDirectory() as tmp:
            path = str(Path(tmp) / a.random_shape)
            ckpt = write_random_checkpoint(SHAPES[a.random_shape], path, device=a.device)
            cal = _calibrate(a, ckpt.path, label=f"{a.random_shape}-random")
    else:
        cal = _calibrate(a, a.model, label="")
    profile = profile_json(cal.profile)
    out = Path(a.output or PROFILE_DIR / f"{a.device}.json")
    out.write_text(json.dumps(profile, indent=1) + "\n")
    if a.samples:
        Path(a.samples).write_text(json.dumps(_samples_json(cal), indent=1) + "\n")
    print(json.dumps(profile, indent=1))
    print(cal.report())
    print(f"written to {out}")


def _calibrate(a: argparse.Namespace, model: str, label: str):
    cfg = CalibrationConfig(
        model=model,
        device=a.device,
        dtype=a.dtype,
        threads=a.threads,
        repeats=a.repeats,
        prefill=tuple(a.prefill_shapes or ()),
        decode=tuple(a.decode_shapes or ()),
        heldout_prefill=tuple(a.heldout_prefill_shapes or ()),
        heldout_decode=tuple(a.heldout_decode_shapes or ()),
        budget=a.budget,
        workload_requests=a.mixed_requests,
        label=label,
    )
    return calibrate(cfg)


def _samples_json(cal) -> dict:
    p = cal.profile
    return {
        "name": p.name,
        "num_params": p.num_params,
        "weight_bytes": p.weight_bytes,
        "source": p.source,
        "fit": samples_to_json(cal.fit_samples),
        "heldout": {k: samples_to_json(v) for k, v in cal.heldout.items()},
    }


def _refit(data: dict, parse):
    """A Calibration refitted from a --samples file (no torch needed)."""
    if not isinstance(data, dict):
        raise ValueError("samples file: expected a JSON object")
    for key in ("name", "num_params", "weight_bytes", "fit", "heldout"):
        if key not in data:
            raise ValueError(f"samples file, field {key!r}: missing")
    fit = parse(data["fit"])
    source = data.get("source", "").split("; held-out error")[0] + " (refitted from saved samples)"
    profile = fit_coefficients(fit).to_cost_model(
        data["name"], data["num_params"], data["weight_bytes"], source
    )
    return Calibration(profile, fit, {k: parse(v) for k, v in data["heldout"].items()})


def profile_json(model: CostModel) -> dict:
    return asdict(model)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python bench/calibrate.py",
        description="time real engine steps here and fit a profile",
    )
    cal = parser
    cal.add_argument(
        "--model", default="default", help='"default" (the embedded SmolLM2) or an HF directory'
    )
    cal.add_argument(
        "--random-shape",
        help="calibrate a random-weight checkpoint of this shape "
        "(tests/random_checkpoint.py SHAPES, e.g. smollm2-135m), written to a temporary directory",
    )
    cal.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    cal.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    cal.add_argument(
        "--threads", type=int, help="CPU: torch threads (default: what the process has)"
    )
    cal.add_argument(
        "--repeats", type=int, default=3, help="timed steps per shape (the fit takes the median)"
    )
    cal.add_argument(
        "--budget",
        type=int,
        default=0,
        help="max_num_batched_tokens (default: 2048 cpu, 8192 cuda)",
    )
    cal.add_argument(
        "--mixed-requests", type=int, default=24, help="requests in the held-out mixed batch"
    )
    for kind, meta in (("prefill", "TOKENS:SEQS"), ("decode", "BATCH:CONTEXT")):
        cal.add_argument(
            f"--{kind}-shapes",
            type=_shape,
            nargs="+",
            metavar=meta,
            help="fitted (default: a grid)",
        )
        cal.add_argument(
            f"--heldout-{kind}-shapes", type=_shape, nargs="+", metavar=meta, help="held out"
        )
    cal.add_argument("--output", help="profile JSON path (default sim/profiles/<device>.json)")
    cal.add_argument(
        "--samples", help="also write the timed steps here (JSON), to refit with --from-samples"
    )
    cal.add_argument(
        "--from-samples", help="refit a --samples file instead of timing (no torch needed)"
    )
    a = parser.parse_args(argv)
    try:
        cmd_calibrate(a)
    except ValueError as exc:
        parser.exit(2, f"error: {exc}\n")


if __name__ == "__main__":
    main()
