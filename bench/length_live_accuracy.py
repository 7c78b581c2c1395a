"""Accuracy of the live length predictor (the hidden-state probe as a replica runs it) against the
feature groups alone, on the evaluation set's held-out prompts.

    python -m bench.length_live_accuracy [--set sim/traces/length_eval.jsonl] [--dim 64]

Unlike bench/length_accuracy.py --probe (full hidden states from LLM.embed), the features here
come out of the serving path itself: each chat-templated prompt runs through an offline engine
with the probe on (max_tokens 1), and the runner's projected feature is read off the scheduler's
request, as a replica's scheduler holds it. The predictors are scheduler/length_live.py's
LivePredictor, fed Requests as the scheduler feeds it: trained on the training split's true
lengths in order (online, as requests finish), scored on the rest (bench/length_accuracy.py's
split and score: Kendall's tau, MAE of log length, upper-quantile exceedance). "Prequential"
rows run all prompts in a seeded order, each predicted after its prefill and before it is learned
(cold start included): what a replica sees. The offline probe on the full hidden states (cached
by bench/length_accuracy.py) is printed beside them for the same split when its cache exists.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from bench.length_accuracy import (
    MAX_TOKENS,
    Predict,
    Row,
    load_set,
    probe_predictor,
    score,
    split,
)
from scheduler import EngineRequest, Request, SamplingParams
from scheduler.length_live import LivePredictor
from scheduler.length_prediction import LengthEstimate
from scheduler.length_probe import ProbeConfig
from scheduler.request import RequestStatus
from sim.length_study import kendall_tau


def live_features(rows: list[Row], dim: int, cpu_threads: int) -> dict[int, list[float]]:
    """Each prompt's feature as the serving path makes it (one prefill each, max_tokens 1)."""
    from engine.llm import LLM

    llm = LLM(
        cpu_threads=cpu_threads,
        length_probe="on",
        length_feature_dim=dim,
        quantization="none",  # recorded figures: fp32
    )
    engine = llm.engine
    try:
        for r in rows:
            ids = llm.frontend.encode_chat(r.messages)
            engine.add_request(EngineRequest(f"r{r.id}", ids, SamplingParams(max_tokens=1)))
        while engine.has_unfinished_requests():
            engine.step()
        out = {}
        for r in rows:
            feature = engine.scheduler.requests[f"r{r.id}"].length_feature
            if feature is not None:
                out[r.id] = feature
        return out
    finally:
        llm.shutdown()


def request(r: Row, feature: list[float] | None, tenant: bool) -> Request:
    """The scheduler's request for a row: its prompt length, max_tokens and (tenant) kind."""
    spec = EngineRequest(
        f"r{r.id}",
        [1] * r.prompt_len,
        SamplingParams(max_tokens=MAX_TOKENS),
        tenant=r.kind if tenant else "default",
    )
    req = Request(spec)
    req.length_feature = feature
    return req


def learn(model: LivePredictor, r: Row, feature: list[float] | None, tenant: bool) -> None:
    req = request(r, feature, tenant)
    req.output_token_ids.extend([0] * r.output_len)
    req.status = (
        RequestStatus.FINISHED_LENGTH_CAPPED
        if r.output_len >= MAX_TOKENS
        else RequestStatus.FINISHED_STOPPED
    )
    model.observe_request(req)


def trained(
    train: list[Row], feats: dict[int, list[float]], dim: int | None, tenant: bool
) -> Predict:
    model = LivePredictor(dim)
    for r in train:
        learn(model, r, feats.get(r.id), tenant)
    return lambda r: model.predict_request(request(r, feats.get(r.id), tenant))


def prequential(
    rows: list[Row], feats: dict[int, list[float]], dim: int | None, tenant: bool, seed: int
) -> tuple[float, float, int]:
    """(tau, share answered by the probe, answered) over all rows, each predicted before it is
    learned, in a seeded order."""
    order = sorted(rows, key=lambda r: r.id)
    random.Random(seed).shuffle(order)
    model = LivePredictor(dim)
    got: list[tuple[LengthEstimate, int]] = []
    for r in order:
        est = model.predict_request(request(r, feats.get(r.id), tenant))
        if est is not None:
            got.append((est, r.output_len))
        learn(model, r, feats.get(r.id), tenant)
    tau = kendall_tau([e.median for e, _ in got], [float(n) for _, n in got])
    return tau, model.num_probe_answers / max(1, len(got)), len(got)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.length_live_accuracy", description=__doc__
    )
    parser.add_argument("--set", default="sim/traces/length_eval.jsonl")
    parser.add_argument("--test-share", type=float, default=1 / 3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dim", type=int, default=64, help="length_feature_dim")
    parser.add_argument("--cpu-threads", type=int, default=1)
    parser.add_argument("--features-cache", default="/tmp/length_eval_live_features.{dim}.json")
    parser.add_argument("--states-cache", default="/tmp/length_eval_states.json")
    a = parser.parse_args(argv)
    rows = load_set(a.set)
    train, test = split(rows, a.test_share, a.seed)
    cache = Path(a.features_cache.format(dim=a.dim))
    if cache.exists():
        feats = {int(k): v for k, v in json.loads(cache.read_text()).items()}
    else:
        feats = live_features(rows, a.dim, a.cpu_threads)
        cache.write_text(json.dumps({str(k): v for k, v in feats.items()}))
    print(f"{len(rows)} prompts ({len(feats)} with a live feature of {a.dim} floats): ")
    print(f"{len(train)} to train, {len(test)} held out (seed {a.seed})")
    table: dict[str, Predict] = {
        "feature groups (tenant default)": trained(train, feats, None, False),
        "feature groups (tenant = kind)": trained(train, feats, None, True),
        f"live probe, dim {a.dim} (tenant default)": trained(train, feats, a.dim, False),
        f"live probe, dim {a.dim} (tenant = kind)": trained(train, feats, a.dim, True),
    }
    states = Path(a.states_cache)
    if states.exists():
        full = {int(k): v for k, v in json.loads(states.read_text()).items()}
        cfg = ProbeConfig(rank=32, min_samples=1, seed=a.seed)
        table["offline probe, full state, rank 32 (reference)"] = probe_predictor(
            train, full, cfg, False
        )
    print("| predictor | Kendall's tau | MAE of log length | upper (0.9) exceeded | answered |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, predict in table.items():
        tau, mae, over, n = score(predict, test)
        print(f"| {name} | {tau:+.3f} | {mae:.3f} | {over:.1%} | {n} |")
    print()
    print("| prequential, all prompts (each predicted before learned) | tau | by the probe | n |")
    print("| --- | ---: | ---: | ---: |")
    for name, dim, tenant in [
        ("feature groups (tenant = kind)", None, True),
        (f"live probe, dim {a.dim} (tenant = kind)", a.dim, True),
        (f"live probe, dim {a.dim} (tenant default)", a.dim, False),
    ]:
        tau, share, n = prequential(rows, feats, dim, tenant, a.seed)
        print(f"| {name} | {tau:+.3f} | {share:.0%} | {n} |")


if __name__ == "__main__":
    main()
