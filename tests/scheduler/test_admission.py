"""Admission with foresight: it defers a request whose predicted growth would run the pool dry,
admits by the greedy rule without estimates or with nothing running, and cuts preemptions where
greedy admission has to take them back."""

from __future__ import annotations

import pytest

from scheduler import EngineRequest, Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.admission import ForesightAdmission, make_admission
from scheduler.length_prediction import LengthEstimate, LengthPredictor
from scheduler.predicted_load import PredictedLoad
from scheduler.queues import FCFSQueue, SRPTQueue
from tests.scheduler.contract_runner import ContractRunner


class Oracle:
    """Each request's remaining output, from its max_tokens (the contract runner never samples
    EOS here, so every request runs to max_tokens)."""

    def predict_request(self, request: Request) -> LengthEstimate | None:
        n = request.sampling_params.max_tokens - request.num_output_tokens
        return LengthEstimate(n, n)

    def observe_request(self, request: Request) -> None:
        pass


def req(rid: str, prompt: int, max_tokens: int) -> Request:
    return Request(EngineRequest(rid, list(range(1, prompt + 1)), SamplingParams(max_tokens)))


def test_defers_a_request_whose_growth_would_not_fit_and_admits_when_nothing_runs():
    foresight = ForesightAdmission(Oracle(), 8, 4, 64, owns_predictor=False)
    a, b = req("a", 4, 12), req("b", 4, 12)  # each peaks at 16 tokens: 4 blocks
    assert foresight.fits(a, [], 0)
    assert foresight.fits(b, [a], 0)  # 4 + 4 blocks: the pool exactly
    c = req("c", 4, 12)  # 12 blocks at the peak
    assert not foresight.fits(c, [a, b], 0) and foresight.num_deferred == 1
    assert not foresight.fits(req("c", 1, 1), [a, b], 4)  # the reserve counts
    assert foresight.fits(req("d", 1, 1), [a], 0)


class Spread:
    """A median of 1 and an upper quantile of 12 for every request."""

    def predict_request(self, request: Request) -> LengthEstimate | None:
        return LengthEstimate(1, 12)

    def observe_request(self, request: Request) -> None:
        pass


def test_the_upper_estimate_is_the_more_cautious():
    a, b = req("a", 4, 12), req("b", 4, 12)
    median = ForesightAdmission(Spread(), 4, 4, 64, owns_predictor=False, estimate="median")
    upper = ForesightAdmission(Spread(), 4, 4, 64, owns_predictor=False, estimate="upper")
    assert median.fits(b, [a], 0) and not upper.fits(b, [a], 0)


def test_without_estimates_the_greedy_rule_decides():
    cold = ForesightAdmission(LengthPredictor(), 2, 4, 64, owns_predictor=True)
    assert cold.fits(req("a", 4, 100), [req("b", 4, 100)], 0)


def test_the_predictor_is_the_queues_or_its_own():
    srpt = SRPTQueue(LengthPredictor())
    shared = make_admission("foresight", srpt, 8, 4, 64)
    assert shared is not None and shared.predictor is srpt.predictor and not shared.owns_predictor
    own = make_admission("foresight", FCFSQueue(), 8, 4, 64)
    assert own is not None and own.owns_predictor
    assert make_admission("greedy", FCFSQueue(), 8, 4, 64) is None
    with pytest.raises(ValueError, match="admission"):
        SchedulerConfig(num_gpu_blocks=8, max_model_len=16, admission="maybe")


def run(admission: str) -> tuple[int, dict[str, list[int]]]:
    cfg = SchedulerConfig(
        num_gpu_blocks=12, max_model_len=40, block_size=4, max_num_seqs=8, admission=admission
    )
    s = Scheduler(cfg)
    if s.admission is not None:
        s.admission.predictor = Oracle()
    runner = ContractRunner(cfg.block_size, 12, 0)
    for i in range(6):
        s.add_request(req(f"r{i}", 4, 16))
    tokens: dict[str, list[int]] = {}
    while s.has_unfinished_requests():
        out = s.schedule()
        for o in s.update_from_output(out, runner.execute(out)):
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return s.num_preemptions, tokens


def test_foresight_cuts_preemptions_and_keeps_every_output():
    greedy, greedy_tokens = run("greedy")
    foresight, foresight_tokens = run("foresight")
    assert greedy > 0 and foresight == 0
    assert foresight_tokens == greedy_tokens


def test_the_predicted_load_is_cold_at_first_then_the_learned_remainder_capped_by_max_tokens():
    """What a replica reports for the router's predicted_tokens load (scheduler/predicted_load.py):
    nothing sized before the predictor has seen a request finish, even under FCFS (the scheduler
    then keeps a predictor of its own); after, each request's median remaining output, never more
    than its max_tokens allows."""
    cfg = SchedulerConfig(num_gpu_blocks=64, max_model_len=64, block_size=4, max_num_seqs=8)
    s = Scheduler(cfg)
    runner = ContractRunner(cfg.block_size, 64, 0)
    for i in range(3):
        s.add_request(req(f"r{i}", 4, 16))
    assert s.predicted_load() == PredictedLoad(0, 0)
    while s.has_unfinished_requests():
        s.update_from_output(out := s.schedule(), runner.execute(out))
    s.add_request(req("long", 4, 40))
    s.add_request(req("short", 4, 3))
    assert s.predicted_load() == PredictedLoad(16 + 3, 2)
