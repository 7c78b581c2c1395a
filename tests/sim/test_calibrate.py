"""bench/calibrate.py and sim.fit: the fit recovers known coefficients, and a real (tiny) engine
calibrates end to end without Ray."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from sim.cost import CostModel, load_profile
from sim.fit import Coefficients, StepSample, fit_coefficients, prediction_error, samples_from_json

ROOT = Path(__file__).resolve().parents[2]


def _grid(prefill, decode) -> list[tuple[int, int, int, int, int]]:
    """(prefill, decode, kv_read, seqs, pairs) of single-step prefills over seqs and of decode
    batches at a context."""
    rows = []
    for t, s in prefill:
        lens = [t // s + (1 if i < t % s else 0) for i in range(s)]
        rows.append((t, 0, 0, s, sum(n * (n + 1) // 2 for n in lens)))
    # Prefill chunks over prior context (as the setup of a decode shape runs them).
    rows += [(t, 0, t * c, 1, t * c + t * (t + 1) // 2) for t, c in prefill[:2]]
    # Decode batches, alone and beside one new 64-token prompt.
    rows += [(0, b, b * c, b, 0) for b, c in decode]
    return rows + [(64, b, b * c, b + 1, 64 * 65 // 2) for b, c in decode]


_CPU_SHAPES = _grid(
    ((16, 1), (64, 1), (256, 1), (1024, 1), (2048, 1), (256, 4), (2048, 8)),
    ((1, 32), (1, 320), (8, 32), (32, 320), (64, 32), (64, 320)),
)
_GPU_SHAPES = _grid(
    ((16, 1), (512, 1), (8192, 1), (512, 8), (8192, 32)),
    ((1, 128), (1, 2048), (32, 128), (64, 512), (256, 128), (256, 1024)),
)


# Ground truths with every term of the model in play: a CPU-like and a GPU-like device.
_TRUTHS = {
    "cpu": CostModel(
        "cpu",
        134.5e6,
        538e6,
        46080,
        flops_per_s=150e9,
        bytes_per_s=10e9,
        step_overhead_s=0.015,
        per_seq_overhead_s=1.2e-3,
        prefill_step_overhead_s=0.04,
        prefill_step_per_seq_s=6e-3,
        per_prefill_seq_overhead_s=2e-4,
        prefill_pair_s=4.5e-7,
    ),
    "gpu": CostModel(
        "gpu",
        134.5e6,
        269e6,
        23040,
        flops_per_s=494.5e12,
        bytes_per_s=1.53e12,
        step_overhead_s=3e-4,
        per_seq_overhead_s=1e-5,
        prefill_step_overhead_s=9e-4,
        prefill_step_per_seq_s=5e-5,
        per_prefill_seq_overhead_s=2e-4,
        prefill_pair_s=1.4e-10,
    ),
}


def _truth(name: str) -> CostModel:
    return _TRUTHS[name]


def _samples(model: CostModel, shapes) -> list[StepSample]:
    return [StepSample(p, d, r, n, model.step_time(p, d, r, n, q), q) for p, d, r, n, q in shapes]


@pytest.mark.parametrize("profile,shapes", [("cpu", _CPU_SHAPES), ("gpu", _GPU_SHAPES)])
def test_fit_recovers_the_coefficients_that_made_the_steps(profile, shapes):
    truth = _truth(profile)
    samples = _samples(truth, shapes)
    # Both regimes occur, or the test would not pin every coefficient.
    c = Coefficients.of(truth)
    regimes = {c.compute_bound(s) for s in samples}
    assert regimes == {True, False}
    fitted = fit_coefficients(samples)
    for name in Coefficients.__slots__:
        assert math.isclose(getattr(fitted, name), getattr(c, name), rel_tol=1e-6), name
    model = fitted.to_cost_model("fit", truth.num_params, truth.weight_bytes, "")
    for name in (
        "flops_per_s",
        "bytes_per_s",
        "kv_bytes_per_token",
        "step_overhead_s",
        "per_seq_overhead_s",
        "prefill_step_overhead_s",
        "per_prefill_seq_overhead_s",
        "prefill_pair_s",
    ):
        assert math.isclose(getattr(model, name), getattr(truth, name), rel_tol=1e-6), name


def test_fit_with_noise_stays_close_and_reports_its_error():
    truth = _truth("cpu")
    clean = _samples(truth, _CPU_SHAPES)
    # Deterministic +-3% multiplicative noise.
    noisy = [
        StepSample(
            s.prefill_tokens,
            s.decode_tokens,
            s.kv_read_tokens,
            s.num_seqs,
            s.seconds * (1.03 if i % 2 else 0.97),
        )
        for i, s in enumerate(clean)
    ]
    model = fit_coefficients(noisy).to_cost_model("fit", truth.num_params, truth.weight_bytes, "")
    err = prediction_error(model, clean)
    assert err.num_steps == len(clean)
    assert err.median_abs_pct < 5 and abs(err.total_pct) < 5


def test_fit_when_every_step_is_memory_bound_still_predicts_them():
    """Overhead and weight read are then one constant: the fit picks a split, the predictions
    hold."""
    truth = _truth("gpu")
    batches = (
        (1, 128),
        (4, 512),
        (16, 2048),
        (64, 128),
        (64, 1024),
        (8, 64),
        (2, 64),
        (32, 32),
        (128, 16),
    )
    samples = _samples(truth, [(0, b, b * c, b, 0) for b, c in batches])
    model = fit_coefficients(samples).to_cost_model("fit", truth.num_params, truth.weight_bytes, "")
    assert prediction_error(model, samples).p90_abs_pct < 1e-6
    # The split keeps the bandwidth finite: the overhead is read as part of the weight read.
    c = Coefficients.of(truth)
    assert model.step_overhead_s == 0
    assert math.isclose(
        model.bytes_per_s, truth.weight_bytes / (c.weight_read_s + c.step_overhead_s), rel_tol=1e-6
    )


def test_bad_samples_name_the_field():
    with pytest.raises(ValueError, match="seconds"):
        StepSample(1, 0, 0, 1, 0.0)
    with pytest.raises(ValueError, match="num_seqs"):
        StepSample(1, 0, 0, -1, 1.0)
    with pytest.raises(ValueError, match=r"samples\[1\]: .*seconds"):
        samples_from_json(
            [
                {
                    "prefill_tokens": 1,
                    "decode_tokens": 0,
                    "kv_read_tokens": 0,
                    "num_seqs": 1,
                    "seconds": 1.0,
                },
                {
                    "prefill_tokens": 1,
                    "decode_tokens": 0,
                    "kv_read_tokens": 0,
                    "num_seqs": 1,
                    "seconds": -2.0,
                },
            ]
        )
    with pytest.raises(ValueError, match="samples: need at least 9"):
        fit_coefficients([StepSample(1, 0, 0, 1, 1.0)])


def test_calibrate_times_a_real_engine_fits_and_loads_no_ray(tiny_checkpoint, tmp_path):
    """`python bench/calibrate.py` on a tiny random checkpoint, CPU, in a fresh process: no `ray`
    module loads."""
    model_dir, _ = tiny_checkpoint("llama")
    profile, samples = tmp_path / "p.json", tmp_path / "s.json"
    args = [
        "--model",
        model_dir,
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--threads",
        "1",
        "--repeats",
        "2",
        "--budget",
        "128",
        "--mixed-requests",
        "4",
        "--prefill-shapes",
        "16:1",
        "64:1",
        "128:1",
        "128:4",
        "--decode-shapes",
        "1:16",
        "4:16",
        "4:96",
        "8:48",
        "8:8",
        "--heldout-prefill-shapes",
        "32:1",
        "--heldout-decode-shapes",
        "2:64",
        "--output",
        str(profile),
        "--samples",
        str(samples),
    ]
    code = (
        f"import sys; sys.path.insert(0, 'bench'); from calibrate import main; main({args!r}); "
        "loaded = [m for m in sys.modules if m == 'ray' or m.startswith('ray.')]; "
        "print('ray modules:', loaded); sys.exit(3 if loaded else 0)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "held out, shapes:" in proc.stdout and "held out, mixed batch:" in proc.stdout
    fitted = load_profile(str(profile))
    assert fitted.name.startswith("cpu-tiny-llama") and fitted.name.endswith("-float32")
    assert fitted.num_params > 0 and fitted.weight_bytes == 4 * fitted.num_params  # fp32
    data = json.loads(samples.read_text())
    fit = samples_from_json(data["fit"])
    # The timed shapes are the ones asked for, counted as the simulator counts a step.
    assert [(s.prefill_tokens, s.num_seqs) for s in fit[:4]] == [
        (16, 1),
        (64, 1),
        (128, 1),
        (128, 4),
    ]
    assert [s.prefill_pairs for s in fit[:4]] == [
        16 * 17 // 2,
        64 * 65 // 2,
        128 * 129 // 2,
        4 * 32 * 33 // 2,
    ]
    decodes, mixed = fit[4::2], fit[5::2]
    assert [(s.decode_tokens, s.num_seqs, s.prefill_tokens) for s in decodes] == [
        (1, 1, 0),
        (4, 4, 0),
        (4, 4, 0),
        (8, 8, 0),
        (8, 8, 0),
    ]
    assert all(s.kv_read_tokens >= s.num_seqs * c for s, c in zip(decodes, (16, 16, 96, 48, 8)))
    # Beside each decode batch, one new prompt of a quarter of the budget or 64 tokens, by turns.
    assert [(s.decode_tokens, s.prefill_tokens, s.num_seqs) for s in mixed] == [
        (1, 32, 2),
        (4, 64, 5),
        (4, 32, 5),
        (8, 64, 9),
        (8, 32, 9),
    ]
    heldout = {k: samples_from_json(v) for k, v in data["heldout"].items()}
    assert len(heldout["shapes"]) == 3 and heldout["mixed batch"] and heldout["chunked prefill"]
    # Refitting the saved samples (no torch) gives the same profile.
    refit = tmp_path / "r.json"
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from calibrate import main
    finally:
        sys.path.remove(str(ROOT / "bench"))
    main(["--from-samples", str(samples), "--output", str(refit)])
    again = load_profile(str(refit))
    for name in (
        "flops_per_s",
        "bytes_per_s",
        "kv_bytes_per_token",
        "step_overhead_s",
        "per_seq_overhead_s",
    ):
        assert getattr(again, name) == getattr(fitted, name), name
