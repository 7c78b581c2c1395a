"""Output-length predictor accuracy on the evaluation set's held-out prompts, against baselines.

    python -m bench.length_accuracy [--set sim/traces/length_eval.jsonl] [--probe]

The set is split by a seeded shuffle: the predictors learn from the training prompts' true
lengths and are scored on the rest. For each: Kendall's tau between its median and the true
lengths, the mean absolute error of log length, and how often the true length exceeds its upper
quantile (0.9: 10% is calibrated). Baselines: prompt length only (a log-log fit on the training
prompts, its residuals' 0.9 quantile as the upper bound), the per-kind (tenant) mean and the
global median (each with the training set's 0.9 quantile as its upper bound). The cheap-feature
LengthPredictor sees kind, chat, prompt length and max_tokens. --probe also trains the
hidden-state probe (scheduler/length_probe.py) on the embedded model's final hidden state at each
prompt's last token (LLM.embed, pooling "last"), alone and with the kind's one-hot appended.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from scheduler.length_prediction import LengthEstimate, LengthFeatures, LengthPredictor
from scheduler.length_probe import HiddenStateProbe, ProbeConfig
from sim.length_study import kendall_tau

MAX_TOKENS = 256  # the cap the set was generated with (its header says so)


@dataclass(frozen=True, slots=True)
class Row:
    """One prompt of the set."""

    id: int
    kind: str
    messages: list[dict[str, str]]
    prompt_len: int
    output_len: int


def load_set(path: str | Path) -> list[Row]:
    rows = []
    with open(path) as f:
        for line in f:
            obj = json.loads(line)
            if "header" not in obj:
                rows.append(
                    Row(
                        obj["id"],
                        obj["kind"],
                        obj["messages"],
                        obj["prompt_len"],
                        obj["output_len"],
                    )
                )
    return rows


def split(rows: list[Row], test_share: float, seed: int) -> tuple[list[Row], list[Row]]:
    order = sorted(rows, key=lambda r: r.id)
    random.Random(seed).shuffle(order)
    n_test = round(len(order) * test_share)
    return order[n_test:], order[:n_test]


def _q(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


Predict = Callable[[Row], LengthEstimate | None]


def prompt_length_only(train: list[Row]) -> Predict:
    """log(out) = a + b log(prompt) by least squares; the upper bound from its residuals."""
    xs = [math.log(r.prompt_len) for r in train]
    ys = [math.log(r.output_len) for r in train]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    a = my - b * mx
    up = _q([y - (a + b * x) for x, y in zip(xs, ys)], 0.9)
    return lambda r: LengthEstimate(
        math.exp(a + b * math.log(r.prompt_len)), math.exp(a + b * math.log(r.prompt_len) + up)
    )


def kind_mean(train: list[Row]) -> Predict:
    by: dict[str, list[float]] = {}
    for r in train:
        by.setdefault(r.kind, []).append(r.output_len)
    est = {k: LengthEstimate(sum(v) / len(v), _q(v, 0.9)) for k, v in by.items()}
    return lambda r: est.get(r.kind)


def global_median(train: list[Row]) -> Predict:
    lengths = [float(r.output_len) for r in train]
    est = LengthEstimate(_q(lengths, 0.5), _q(lengths, 0.9))
    return lambda r: est


def features(r: Row) -> LengthFeatures:
    return LengthFeatures(r.prompt_len, MAX_TOKENS, tenant=r.kind, chat=True)


def cheap_predictor(train: list[Row]) -> Predict:
    p = LengthPredictor()
    for r in train:
        p.observe(features(r), r.output_len)
    return lambda r: p.predict(features(r))


def probe_predictor(
    train: list[Row], states: dict[int, list[float]], config: ProbeConfig, with_kind: bool
) -> Predict:
    kinds = sorted({r.kind for r in train})

    def state(r: Row) -> list[float]:
        h = states[r.id]
        return [*h, *(1.0 if r.kind == k else 0.0 for k in kinds)] if with_kind else h

    probe = HiddenStateProbe(len(state(train[0])), config)
    for r in train:
        probe.observe(state(r), r.output_len)
    return lambda r: probe.predict(state(r), MAX_TOKENS)


def out_of_fold(
    rows: list[Row], states: dict[int, list[float]], folds: int, config: ProbeConfig
) -> dict[int, float]:
    """Each prompt's probe median (with the kind appended), from a probe trained on the other
    folds only: estimates a study may use without having seen the prompt's own length."""
    order = sorted(rows, key=lambda r: r.id)
    random.Random(config.seed).shuffle(order)
    out: dict[int, float] = {}
    for k in range(folds):
        held = order[k::folds]
        train = [r for i, r in enumerate(order) if i % folds != k]
        predict = probe_predictor(train, states, config, with_kind=True)
        for r in held:
            est = predict(r)
            if est is not None:
                out[r.id] = round(est.median, 2)
    return out


def score(predict: Predict, test: list[Row]) -> tuple[float, float, float, int]:
    """(tau, MAE of log length, upper-quantile exceedance, prompts answered)."""
    pairs = [(predict(r), r.output_len) for r in test]
    got = [(e, n) for e, n in pairs if e is not None]
    med = [e.median for e, _ in got]
    true = [float(n) for _, n in got]
    tau = kendall_tau(med, true)
    mae = sum(abs(math.log(max(m, 1.0)) - math.log(t)) for m, t in zip(med, true)) / len(true)
    over = sum(1 for (e, n) in got if n > e.upper) / len(got)
    return tau, mae, over, len(got)


def hidden_states(rows: list[Row], cache: Path, cpu_threads: int) -> dict[int, list[float]]:
    """The final hidden state at each chat-templated prompt's last token, cached in a file (only
    the prompts missing from it are computed)."""
    states: dict[int, list[float]] = {}
    if cache.exists():
        states = {int(k): v for k, v in json.loads(cache.read_text()).items()}
    missing = [r for r in rows if r.id not in states]
    if missing:
        from engine.llm import LLM

        llm = LLM(cpu_threads=cpu_threads, quantization="none")  # recorded figures: fp32
        ids = [llm.frontend.encode_chat(r.messages) for r in missing]
        states.update(zip((r.id for r in missing), llm.embed(ids, pooling="last")))
        llm.shutdown()
        cache.write_text(json.dumps({str(k): v for k, v in states.items()}))
    return states


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.length_accuracy", description=__doc__)
    parser.add_argument("--set", default="sim/traces/length_eval.jsonl")
    parser.add_argument("--test-share", type=float, default=1 / 3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--probe", action="store_true", help="also the hidden-state probe")
    parser.add_argument("--rank", type=int, default=32, help="the probe's projected dimensions")
    parser.add_argument("--states-cache", default="/tmp/length_eval_states.json")
    parser.add_argument("--cpu-threads", type=int, default=1)
    parser.add_argument(
        "--write-oof", help="write 3-fold out-of-fold probe medians (id -> tokens) here, as JSON"
    )
    a = parser.parse_args(argv)
    rows = load_set(a.set)
    train, test = split(rows, a.test_share, a.seed)
    print(f"{len(rows)} prompts: {len(train)} to train, {len(test)} held out (seed {a.seed})")
    table: dict[str, Predict] = {
        "LengthPredictor (cheap features)": cheap_predictor(train),
        "prompt length only (log-log fit)": prompt_length_only(train),
        "per-kind mean": kind_mean(train),
        "global median": global_median(train),
    }
    if a.probe:
        states = hidden_states(rows, Path(a.states_cache), a.cpu_threads)
        cfg = ProbeConfig(rank=a.rank, min_samples=1, seed=a.seed)
        table[f"hidden-state probe (rank {a.rank})"] = probe_predictor(train, states, cfg, False)
        table[f"hidden-state probe + kind (rank {a.rank})"] = probe_predictor(
            train, states, cfg, True
        )
        if a.write_oof:
            oof = out_of_fold(rows, states, 3, cfg)
            Path(a.write_oof).write_text(json.dumps({str(k): v for k, v in sorted(oof.items())}))
    print("| predictor | Kendall's tau | MAE of log length | upper (0.9) exceeded | answered |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, predict in table.items():
        tau, mae, over, n = score(predict, test)
        print(f"| {name} | {tau:+.3f} | {mae:.3f} | {over:.1%} | {n} |")


if __name__ == "__main__":
    main()
