"""Bulk work (embedding prompts, prompt-logprob rows) takes a bounded share of a step while a
neighbour streams, and the whole budget when nothing else runs (scheduler/bulk_budget.py)."""

from __future__ import annotations

from scheduler import (
    EngineRequest,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from scheduler.bulk_budget import PROMPT_LOGPROB_ROW_COST, BulkBudget, bulk_share, is_bulk
from tests.scheduler.contract_runner import ContractRunner

BUDGET = 512
SHARE = bulk_share(BUDGET)
ROWS = SHARE // PROMPT_LOGPROB_ROW_COST  # prompt-logprob rows a step beside a neighbour


def make(policy: str = "fcfs") -> tuple[Scheduler, ContractRunner]:
    cfg = SchedulerConfig(
        max_num_batched_tokens=BUDGET,
        block_size=16,
        num_gpu_blocks=1024,
        max_model_len=4096,
        policy=policy,
    )
    return Scheduler(cfg), ContractRunner(cfg.block_size, cfg.num_gpu_blocks, cfg.cpu_blocks)


def req(rid: str, n: int, max_tokens: int = 1, tenant: str = "t", **params: object) -> Request:
    prompt = [100 + (i % 1000) for i in range(n)]
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params)  # type: ignore[arg-type]
    return Request(EngineRequest(rid, prompt, sp, tenant=tenant))


def run_step(sched: Scheduler, runner: ContractRunner) -> dict[str, int]:
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    return dict(out.num_scheduled_tokens)


def start_neighbour(sched: Scheduler, runner: ContractRunner) -> None:
    sched.add_request(req("neighbour", 8, max_tokens=400))
    run_step(sched, runner)  # its prefill: from now on it decodes


def test_share_is_a_fraction_of_the_budget_with_a_floor() -> None:
    assert bulk_share(8192) == 32
    assert bulk_share(2048) == 8
    assert bulk_share(512) == 8
    assert bulk_share(1) == 8  # bulk work always moves
    assert bulk_share(2048, configured=300) == 300  # SchedulerConfig.bulk_tokens_per_step


def test_the_configured_share_caps_an_embedding_beside_a_neighbour() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=BUDGET,
        block_size=16,
        num_gpu_blocks=1024,
        max_model_len=4096,
        bulk_tokens_per_step=40,
    )
    sched, runner = Scheduler(cfg), ContractRunner(16, 1024, cfg.cpu_blocks)
    start_neighbour(sched, runner)
    sched.add_request(req("e", 1000, pooling="mean"))
    assert run_step(sched, runner) == {"neighbour": 1, "e": 40}


def test_which_chunks_are_bulk() -> None:
    embedding = req("e", 100, pooling="mean")
    scored = req("p", 100, prompt_logprobs=5)
    plain = req("x", 100)
    assert is_bulk(embedding, 0) and is_bulk(embedding, 99)
    assert is_bulk(scored, 0) and is_bulk(scored, 98)
    assert not is_bulk(scored, 99)  # the last prompt token's row is the sampler's, not scored
    assert not is_bulk(plain, 0)


def test_prompt_logprobs_beside_a_decode_take_the_share_each_step() -> None:
    sched, runner = make()
    start_neighbour(sched, runner)
    sched.add_request(req("p", 300, prompt_logprobs=20))
    chunks = []
    while sched.requests["p"].num_output_tokens == 0:
        step = run_step(sched, runner)
        assert step["neighbour"] == 1  # the neighbour decodes in every step
        chunks.append(step.get("p", 0))
    # The 300-token prompt in chunks of the share (a scored row counts double), the last one
    # ending at the sampler's row.
    assert chunks == [min(ROWS, 300 - start) for start in range(0, 300, ROWS)]


def test_prompt_logprobs_alone_take_the_whole_budget() -> None:
    sched, runner = make()
    sched.add_request(req("p", 900, prompt_logprobs=20))
    assert run_step(sched, runner) == {"p": BUDGET}


def test_many_embedding_inputs_share_one_allowance() -> None:
    sched, runner = make()
    start_neighbour(sched, runner)
    for i in range(8):
        sched.add_request(req(f"e{i}", 200, pooling="mean"))
    steps = 0
    while any(not sched.requests[f"e{i}"].is_finished for i in range(8)):
        step = run_step(sched, runner)
        steps += 1
        assert step["neighbour"] == 1
        assert sum(n for rid, n in step.items() if rid != "neighbour") <= SHARE
    assert steps >= 8 * 200 // SHARE  # split over many steps, the neighbour decoding in each


def test_embeddings_get_the_whole_budget_once_the_neighbour_is_gone() -> None:
    sched, runner = make()
    for i in range(3):
        sched.add_request(req(f"e{i}", 300, pooling="mean"))
    step = run_step(sched, runner)
    assert sum(step.values()) == BUDGET


def test_a_plain_prefill_beside_a_decode_is_not_capped() -> None:
    sched, runner = make()
    start_neighbour(sched, runner)
    sched.add_request(req("x", 900))
    assert run_step(sched, runner) == {"neighbour": 1, "x": BUDGET - 1}


def test_budget_left_never_goes_below_zero_as_a_cap() -> None:
    budget = BulkBudget(left=3)
    embedding = req("e", 100, pooling="mean")
    budget.charge(embedding, 0, 5)
    assert budget.cap(embedding, 5) == 0


def test_embedding_tokens_count_in_their_tenants_fair_share() -> None:
    sched, runner = make(policy="fair")
    start_neighbour(sched, runner)
    sched.add_request(req("e", 200, tenant="bulk", pooling="mean"))
    charged = sched.waiting.counters  # type: ignore[attr-defined]
    before = charged.get("bulk", 0.0)
    for _ in range(3):
        run_step(sched, runner)
    # Three chunks of the share, each charged as input (fair_input_weight 1) to its tenant.
    assert charged["bulk"] - before == 3 * SHARE


def test_a_scored_row_counts_double_an_embedding_token() -> None:
    budget = BulkBudget(left=8)
    scored, embedding = req("p", 100, prompt_logprobs=1), req("e", 100, pooling="last")
    assert budget.cap(scored, 0) == 4 and budget.cap(embedding, 0) == 8
    budget.charge(scored, 0, 3)
    assert budget.cap(embedding, 0) == 2 and budget.cap(scored, 3) == 1
    assert budget.cap(req("x", 100), 0) > 1 << 40  # not bulk: no cap
