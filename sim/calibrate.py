"""Fit a cost profile from timed real engine steps on this machine (imports torch lazily, here only)."""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict

from sim.cost import CostModel


def _timed_steps(engine, prompts: list[list[int]], max_tokens: int) -> list[tuple[int, int, int, float]]:
    """(prefill tokens, decode tokens, sequences, seconds) of each engine step until all finish."""
    from scheduler import Request, SamplingParams

    for i, prompt in enumerate(prompts):
        engine.add_request(Request(f"cal{time.monotonic_ns()}-{i}", prompt,
                                   SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
    rows = []
    sched = engine.scheduler
    while sched.has_unfinished_requests():
        t0 = time.perf_counter()
        out = sched.schedule()
        runner_out = engine.executor.execute_model(out)
        sched.update_from_output(out, runner_out)
        dt = time.perf_counter() - t0
        prefill = decode = 0
        for rid, n in out.num_scheduled_tokens.items():
            req = sched.requests.get(rid)
            if n == 1 and req is not None and req.num_computed_tokens - 1 >= req.num_prompt_tokens:
                decode += 1
            else:
                prefill += n
        rows.append((prefill, decode, len(out.num_scheduled_tokens), dt))
    return rows


def _slope_intercept(xs: list[float], ys: list[float]) -> tuple[float, float]:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return slope, my - slope * mx


def calibrate(model: str = "default", repeats: int = 3) -> CostModel:
    """Time prefills of growing length and decodes of growing batch; fit the roofline profile."""
    from cluster.config import EngineConfig
    from cluster.engine import EngineCore
    from scheduler import SchedulerConfig

    sched = SchedulerConfig(num_gpu_blocks=512, max_model_len=2048)
    engine = EngineCore(EngineConfig(model=model, load_progress=False, scheduler=sched))
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(engine.model_dir)
    vocab = int(engine.vocab_size)
    prompt = lambda n, k: [(7 * i + 13 * k + 1) % (vocab - 1) + 1 for i in range(n)]  # noqa: E731
    pre_x, pre_y = [], []
    for k in range(repeats):
        for n in (64, 128, 256, 512):
            rows = _timed_steps(engine, [prompt(n, 100 * k + n)], 1)
            pre_x.append(float(n))
            pre_y.append(rows[0][3])
    dec_x, dec_y = [], []
    for k in range(repeats):
        for b in (1, 4, 16, 32):
            rows = [r for r in _timed_steps(engine, [prompt(16, 1000 * k + 31 * b + j) for j in range(b)], 8)
                    if r[0] == 0 and r[1] == b]
            for r in rows:
                dec_x.append(float(b))
                dec_y.append(r[3])
    engine.shutdown()
    per_token, pre_intercept = _slope_intercept(pre_x, pre_y)
    per_seq, dec_intercept = _slope_intercept(dec_x, dec_y)
    num_params = float(sum(p.numel() for p in engine.executor.runner.model.parameters())) \
        if hasattr(getattr(engine.executor, "runner", None), "model") else 134.5e6
    layers, kv_heads = int(cfg.num_hidden_layers), int(getattr(cfg, "num_key_value_heads", cfg.num_attention_heads))
    head_dim = int(getattr(cfg, "head_dim", 0) or cfg.hidden_size // cfg.num_attention_heads)
    weight_bytes = num_params * 4  # float32 calibration
    overhead = max(0.0, pre_intercept - max(per_seq, 0.0))
    memory_s = max(dec_intercept - overhead, 1e-4)
    return CostModel(
        name=f"calibrated-{model}-fp32", num_params=num_params, weight_bytes=weight_bytes,
        kv_bytes_per_token=float(2 * layers * kv_heads * head_dim * 4), flops_per_s=2 * num_params / max(per_token, 1e-9),
        bytes_per_s=weight_bytes / memory_s, step_overhead_s=overhead, per_seq_overhead_s=max(per_seq, 0.0),
        source=f"sim calibrate on this machine: {len(pre_x)} prefill and {len(dec_x)} decode steps timed")


def profile_json(model: CostModel) -> dict:
    return asdict(model)
