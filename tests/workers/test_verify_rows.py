"""Verify rows attend as decode rows (workers/verify_rows.py): the layout, and on the tiny random
models on CPU, a verify step's k + 1 positions reach the paged-decode kernel as k + 1 decode rows
whose logits equal the prefill-style (mixed) layout's."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from scheduler import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from scheduler.speculative import SpeculativeConfig
from workers.layers.backends.torch_ref import TorchBackend
from workers.runner import ModelRunner
from workers.verify_rows import (
    MAX_SPEC_GRAPH_ROWS,
    attention_rows,
    graph_batch_size,
    logits_positions,
    token_offsets,
)

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


def test_verify_rows_become_one_decode_row_per_token():
    # A decode, a verify row (last token + 3 proposed at position 30), a prefill chunk.
    rows = attention_rows([12, 30, 0], [1, 4, 20], verify=[1])
    assert rows.batch_rows == [0, 1, 1, 1, 1, 2]
    assert rows.starts == [12, 30, 31, 32, 33, 0]
    assert rows.query_lens == [1, 1, 1, 1, 1, 20]
    assert not rows.all_decodes
    assert attention_rows([12, 30], [1, 4], verify=[1]).all_decodes
    assert attention_rows([12, 30], [1, 4], verify=()).query_lens == [1, 4]  # mixed layout


def test_logits_positions_are_each_verify_rows_last_k_plus_one_tokens():
    offsets = token_offsets([1, 4, 20, 3])
    assert offsets == [0, 1, 5, 25, 28]
    # Row 2 is a partial prefill (no sample); row 3 verifies 2 proposed tokens.
    assert logits_positions(offsets, [0, 1, 3], [0, 3, 0, 2]) == [0, 1, 2, 3, 4, 25, 26, 27]


def test_graphs_are_captured_for_a_speculating_batch_within_bounds():
    assert graph_batch_size(256, 8192, None) == 256
    spec = SpeculativeConfig(num_tokens=8, max_batch_size=8)
    assert graph_batch_size(8, 2048, spec) == 72  # 8 requests x 9 rows
    assert graph_batch_size(256, 8192, spec) == 256  # max_num_seqs already holds 8 x 9
    assert graph_batch_size(4, 32, spec) == 32  # never more rows than the token budget
    adaptive = SpeculativeConfig(num_tokens=4, max_num_tokens=12, max_batch_size=8)
    assert graph_batch_size(8, 2048, adaptive) == 104  # the longest a request verifies: 13 rows
    wide = SpeculativeConfig(num_tokens=16, max_batch_size=1 << 16)
    assert graph_batch_size(1024, 1 << 20, wide) == 1024
    assert graph_batch_size(64, 1 << 20, wide) == MAX_SPEC_GRAPH_ROWS


class RecordingBackend(TorchBackend):
    """The torch backend (with the CPU paged kernel where the head size has one), recording the
    sequence lengths of the decode rows each layer's decode entry receives (the kernel, or the
    gather path's `decode`) and the metadata each step prepares."""

    def __init__(self) -> None:
        super().__init__(paged_kernel=True)
        self.decode_calls: list[list[int]] = []
        self.steps: list[tuple[int, list[int]]] = []
        kernel = self.kernel
        if kernel is not None:

            def recording(out, q, k_cache, v_cache, block_tables, seq_lens, *rest):
                self.decode_calls.append(seq_lens.tolist())
                return kernel(out, q, k_cache, v_cache, block_tables, seq_lens, *rest)

            self.kernel = recording

    def decode(self, q, meta, kv):
        self.decode_calls.append(meta.seq_lens_cpu[: q.shape[0]])
        return super().decode(q, meta, kv)

    def prepare(self, meta) -> None:
        self.steps.append((meta.num_decodes, list(meta.seq_lens_cpu)))
        super().prepare(meta)


@pytest.fixture(scope="module", params=["llama", "mistral_window"])
def runner(request, tiny_checkpoint):
    path, _ = tiny_checkpoint(request.param)
    r = ModelRunner(
        EngineConfig(model=path, device="cpu", load_progress=False).runner_config(
            path, max_model_len=512
        )
    )
    r.init_kv_cache(64, 8)
    r.backend = RecordingBackend()
    for layer in r.layers:
        layer.backend = r.backend
    return r


def _prompt(seed: int, n: int = 30) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (n,), generator=gen).tolist()


def test_a_verify_step_runs_decode_rows_with_the_mixed_layouts_logits(runner):
    """Requests a and b verify 3 and 2 proposed tokens beside a plain decode c and a prefill
    chunk d: the kernel gets one decode row per verify position, with context lengths
    ctx + i + 1, and the logits equal the mixed layout's."""
    blocks = {"a": [1, 2, 3], "b": [4, 5, 6], "c": [7, 8, 9], "d": [10, 11]}
    first = SchedulerOutput(
        [NewRequestData(r, _prompt(i), GREEDY, blocks[r], 0) for i, r in enumerate("abc")],
        CachedRequestData(),
        {r: 30 for r in "abc"},
        90,
    )
    sampled = dict(zip("abc", (t[0] for t in runner.execute_model(first).sampled_token_ids)))
    drafts = {"a": [5, 6, 7], "b": [8, 9]}
    scheduled = {"a": 4, "b": 3, "c": 1, "d": 20}
    verify = SchedulerOutput(
        [NewRequestData("d", _prompt(3), GREEDY, blocks["d"], 0)],
        CachedRequestData(
            list("abc"), [False] * 3, [[sampled[r]] for r in "abc"], [[]] * 3, [30] * 3
        ),
        scheduled,
        sum(scheduled.values()),
        scheduled_spec_tokens=drafts,
    )
    runner._update_states(verify)
    batch = runner._build_batch(verify)
    assert batch.req_ids == ["c", "a", "b", "d"]  # decodes, verify rows, prefill chunks
    backend = runner.backend
    backend.steps.clear()
    backend.decode_calls.clear()
    decode_logits = runner._forward(batch)
    # 1 + 4 + 3 decode rows, then d's chunk; each verify position sees the context up to itself.
    decode_lens = [31, 31, 32, 33, 34, 31, 32, 33]
    assert backend.steps == [(8, decode_lens + [20])]
    assert backend.decode_calls == [decode_lens] * len(runner.layers)
    runner.verify_as_decodes = False
    try:
        mixed_logits = runner._forward(batch)
    finally:
        runner.verify_as_decodes = True
    assert backend.steps[-1] == (1, [31, 34, 33, 20])  # only c decodes in the mixed layout
    assert decode_logits is not None and mixed_logits is not None
    assert decode_logits.shape == mixed_logits.shape == (4 + 3 + 1, decode_logits.shape[1])
    torch.testing.assert_close(decode_logits, mixed_logits, rtol=1e-4, atol=1e-4)
    output = runner._sample(batch, decode_logits)  # the step completes as any other
    assert all(len(t) >= 1 for t in output.sampled_token_ids[:3])  # c, a, b sample
    assert output.sampled_token_ids[3] == []  # d's prompt is not complete yet
    runner.execute_model(
        SchedulerOutput([], CachedRequestData(), {}, 0, finished_req_ids=set("abcd"))
    )
