"""ModelRunner follows SchedulerOutput diffs: new requests, chunks, resumption and finishing."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from scheduler import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from workers.runner import BlockTableRows, ModelRunner, RequestState

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
PROMPT = list(range(200, 230))  # 30 tokens: two blocks of 16


@pytest.fixture(scope="module")
def runner(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama")
    r = ModelRunner(
        EngineConfig(model=path, device="cpu", load_progress=False).runner_config(
            path, max_model_len=512
        )
    )
    r.init_kv_cache(64, 8)
    return r


def new(rid: str, blocks: list[int], n: int, computed: int = 0) -> SchedulerOutput:
    req = NewRequestData(rid, PROMPT, GREEDY, blocks, computed)
    return SchedulerOutput([req], CachedRequestData(), {rid: n}, n)


def cached(
    rid: str, n: int, computed: int, tokens=(), blocks=(), resumed=False, finished=()
) -> SchedulerOutput:
    data = CachedRequestData([rid], [resumed], [list(tokens)], [list(blocks)], [computed])
    return SchedulerOutput([], data, {rid: n}, n, finished_req_ids=set(finished))


def test_chunked_prompt_samples_once_the_prompt_is_complete(runner):
    whole = runner.execute_model(new("whole", [1, 2], 30))
    assert whole.req_ids == ["whole"] and len(whole.sampled_token_ids[0]) == 1
    first = runner.execute_model(new("chunked", [3, 4], 20))
    assert first.sampled_token_ids == [[]]  # the prompt is not complete yet
    second = runner.execute_model(cached("chunked", 10, 20))
    assert second.sampled_token_ids == whole.sampled_token_ids


def test_outputs_arrive_through_new_token_ids(runner):
    token = runner.execute_model(new("decode", [5, 6], 30)).sampled_token_ids[0][0]
    runner.execute_model(cached("decode", 1, 30, tokens=[token]))
    state = runner.requests["decode"]
    assert state.token_ids == PROMPT + [token]
    assert state.sampling.output_token_ids == [token]


def test_resumed_request_replaces_its_block_table_and_finished_is_dropped(runner):
    token = runner.execute_model(new("moved", [7, 8], 30)).sampled_token_ids[0][0]
    # Preempted (recompute): back with fresh blocks, the prompt and its first output recomputed.
    out = runner.execute_model(
        cached("moved", 31, 0, tokens=[token], blocks=[20, 21], resumed=True)
    )
    assert runner.requests["moved"].block_ids == [20, 21]
    # The same sequence decoded without preemption gives the same next token.
    first = runner.execute_model(new("again", [9, 10], 30)).sampled_token_ids[0][0]
    assert first == token
    assert (
        out.sampled_token_ids
        == runner.execute_model(cached("again", 1, 30, tokens=[first])).sampled_token_ids
    )
    runner.execute_model(
        SchedulerOutput([], CachedRequestData(), {}, 0, finished_req_ids={"moved", "again"})
    )
    assert "moved" not in runner.requests and "again" not in runner.requests


def test_block_table_rows_follow_appends_resumption_and_finishing():
    rows = BlockTableRows(max_blocks_per_seq=4, rows=1)
    a = RequestState([0] * 20, [7, 3], 0, None)
    b = RequestState([0] * 20, [5], 0, None)
    ra, rb = rows.sync("a", a), rows.sync("b", b)  # b needs a second row: the table doubles
    assert ra != rb and rows.table.shape[0] == 2
    a.block_ids.append(9)
    rows.sync("a", a)
    assert rows.select([rb, ra], 3).tolist() == [[5, 0, 0], [7, 3, 9]]
    a.block_ids, a.num_synced_blocks = [2], 0  # resumed with a fresh table, as _update_states does
    rows.sync("a", a)
    assert rows.select([ra], 1).tolist() == [[2]]
    rows.release(a)
    c = RequestState([0] * 20, [1, 6], 0, None)
    assert rows.sync("c", c) == ra  # the finished request's row is reused, its old entries cleared
    assert rows.select([ra], 3).tolist() == [[1, 6, 0]]
    with pytest.raises(ValueError, match="block_ids"):
        rows.sync("d", RequestState([0] * 20, [1] * 5, 0, None))


def test_finished_requests_give_their_table_rows_back(runner):
    runner.execute_model(new("row", [11, 12], 30))
    row = runner.requests["row"].table_row
    assert row >= 0
    runner.execute_model(SchedulerOutput([], CachedRequestData(), {}, 0, finished_req_ids={"row"}))
    assert row in runner.block_tables.free
