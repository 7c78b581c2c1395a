"""Prefix hits on a hybrid model (scheduler/state_checkpoints.py), checked the same way for each
family: a prompt computed cold, then again beside a longer new prompt that makes the pool preempt,
and a third prompt sharing only its first 30 tokens; every one gives transformers' greedy tokens.

The engine must run 8-token blocks, 16-token chunks, two sequences, 16 blocks and 8 state
checkpoints (a long prompt's chunks take one each; too few and it evicts the others): the cold
prompt (45 tokens) leaves checkpoints at 16, 32 and 40 (the last boundary of each chunk); run
again, its hit is its last full block (40 tokens) and it computes only the 5 after; the third
prompt finds 3 cached blocks (24 tokens) and rounds down to the checkpoint at 16.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from scheduler import SamplingParams
from tests.workers.greedy import assert_greedy_match, hf_greedy
from workers.linear_state import LinearStateFeature

BLOCK, CHUNK, SEQS, BLOCKS, CHECKPOINTS = 8, 16, 2, 16, 8


def _prompts() -> tuple[list[int], list[int], list[int]]:
    cold = [(13 * i) % 30000 + 500 for i in range(45)]
    shares_30 = cold[:30] + [(17 * i) % 30000 + 700 for i in range(20)]
    long = [(11 * i) % 30000 + 900 for i in range(70)]
    return cold, shares_30, long


def engine_kwargs(model: str, **extra: Any) -> dict[str, Any]:
    """An engine of the sizes above (fp32, 128 positions), with `extra`."""
    return dict(
        model=model,
        dtype="float32",
        max_num_batched_tokens=CHUNK,
        max_num_seqs=SEQS,
        block_size=BLOCK,
        num_gpu_blocks=BLOCKS,
        num_state_checkpoints=CHECKPOINTS,
        max_model_len=128,
        **extra,
    )


def engines(llm_factory, kwargs: dict[str, Any]) -> Iterator[Callable[[int], Any]]:
    """A module fixture's body (`yield from`): tp -> the engine of `kwargs` on tp ranks. TP=1 is
    the session's (llm_factory); TP > 1 runs over rank processes (gloo) with the experts split,
    built once and shut down with the module."""
    from engine.llm import LLM

    built: dict[int, LLM] = {}

    def get(tp: int) -> LLM:
        if tp == 1:
            return llm_factory(**kwargs)
        if tp not in built:
            more = dict(device="cpu", load_progress=False, expert_parallel=True)
            built[tp] = LLM(**kwargs, tensor_parallel_size=tp, **more)
        return built[tp]

    yield get
    for llm in built.values():
        llm.shutdown()


def check_prefix_hits(llm, hf_model, max_tokens: int) -> None:
    """The scenario above on `llm` (built with the sizes above), against hf_model."""
    engine = llm.engine
    sched = engine.scheduler
    assert (sched.config.block_size, sched.config.max_num_seqs) == (BLOCK, SEQS)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    cold, shares_30, long = _prompts()
    cold_ref, shares_ref, long_ref = (hf_greedy(hf_model, p, max_tokens) for p in _prompts())
    refs = [cold_ref, long_ref, cold_ref, shares_ref]
    first = llm.generate([cold], params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    before = sched.num_preemptions
    outs = [first, *llm.generate([long, cold, shares_30], params, use_tqdm=False)]
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert_greedy_match(out.token_ids, ref, f"prefix hits, output {i}")
    assert outs[2].num_cached_tokens == 40  # the cold prompt's last full block: 5 tokens computed
    assert outs[3].num_cached_tokens == 16  # 24 tokens cached, rounded down to a checkpoint
    assert sched.num_preemptions > before  # the long prompt and the hit grew past 16 blocks
    (feature,) = [f for f in sched.features if type(f).__name__ == "StateCheckpointFeature"]
    feature.pool.check()
    assert not feature.pool.pending
    assert sched.state_slots.num_free == SEQS
    ranks = engine.executor.call_ranks(num_checkpoints)
    assert ranks == [CHECKPOINTS] * len(ranks)  # allocated (and counted) at start, every rank


def num_checkpoints(runner) -> int:
    """A rank's state checkpoint slots (a call_ranks job: module-level, so it crosses to rank
    processes)."""
    return runner.feature(LinearStateFeature).store.num_checkpoints
