"""A fake model runner that holds state only from SchedulerOutput diffs, as the real one must.

It simulates the paged KV cache: every scheduled token is "written" to its slot, and before a step
it checks that every earlier position of the request reads back the right token from the slots its
block table names. That proves prefix-cache hits, swap copies and block-table diffs are right.
Sampled tokens are a pure function of (request id, position), so the expected output of a request
does not depend on how it was scheduled.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler import ModelRunnerOutput, SchedulerOutput


def token_at(request_id: str, position: int, vocab: int = 50) -> int:
    """The token the fake model samples for a request at a sequence position."""
    digest = hashlib.blake2b(f"{request_id}:{position}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % vocab


@dataclass
class _State:
    token_ids: list[int]
    block_ids: list[int] = field(default_factory=list)
    computed: int = 0


class ContractRunner:
    """Executes SchedulerOutputs against simulated KV slots and checks the contract."""

    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        vocab: int = 50,
        appends_sampled: bool = False,
        proposer: Callable[[str, list[int]], list[int]] | None = None,
    ) -> None:
        self.block_size = block_size
        # Async scheduling: the runner appends what it samples, as workers.runner does then.
        self.appends_sampled = appends_sampled
        self.vocab = vocab
        self.gpu: list[list[int | None]] = [[None] * block_size for _ in range(num_gpu_blocks)]
        self.cpu: list[list[int | None]] = [[None] * block_size for _ in range(num_cpu_blocks)]
        self.states: dict[str, _State] = {}
        # Speculative decoding: (request id, its tokens) -> proposed next tokens, verified against
        # token_at like a model's samples.
        self.proposer = proposer
        # Both (workers/spec_async.py): a row starts where this runner's last step for it ended,
        # and its draft slots carry the proposal this runner made then.
        self.async_spec = appends_sampled and proposer is not None
        self.own_computed: dict[str, int] = {}
        self.own_proposals: dict[str, list[int]] = {}

    def _slot(self, state: _State, pos: int) -> tuple[int, int]:
        block = pos // self.block_size
        assert block < len(state.block_ids), (
            f"position {pos} has no block (table {state.block_ids})"
        )
        return state.block_ids[block], pos % self.block_size

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in out.finished_req_ids:
            self.states.pop(rid, None)
            self._forget(rid)
        for rid in out.preempted_req_ids:
            self._forget(rid)
            if rid in self.states:
                self.states[rid].block_ids = []
        for rid, keep in out.truncated_block_tables.items():
            if rid in self.states:
                del self.states[rid].block_ids[keep:]
        for gpu, cpu in out.blocks_to_swap_out:
            self.cpu[cpu] = list(self.gpu[gpu])
        for gpu, cpu in out.blocks_to_swap_in:
            self.gpu[gpu] = list(self.cpu[cpu])
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.states, f"{new.req_id} sent as new twice"
            tokens = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.states[new.req_id] = _State(tokens, list(new.block_ids))
            self.states[new.req_id].computed = new.num_computed_tokens
            self._forget(new.req_id)
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self.states[rid]
            if self.appends_sampled:
                assert not cached.new_token_ids[i], f"{rid}: a sampled token was sent back"
            state.token_ids.extend(cached.new_token_ids[i])
            if cached.resumed[i]:
                state.block_ids = list(cached.new_block_ids[i])
            else:
                state.block_ids.extend(cached.new_block_ids[i])
            state.computed = cached.num_computed_tokens[i]
            own = self.own_computed.pop(rid, None) if self.async_spec else None
            if own is not None and not cached.resumed[i]:
                assert own <= state.computed, f"{rid}: the scheduler is behind this runner"
                state.computed = own
        scheduled = [n.req_id for n in out.scheduled_new_reqs] + list(cached.req_ids)
        assert sorted(scheduled) == sorted(out.num_scheduled_tokens), "scheduled ids disagree"
        assert sum(out.num_scheduled_tokens.values()) == out.total_num_scheduled_tokens
        # Reads first (every context position must hold the right token), then writes.
        for rid in scheduled:
            state = self.states[rid]
            for pos in range(state.computed):
                b, off = self._slot(state, pos)
                assert self.gpu[b][off] == state.token_ids[pos], (
                    f"{rid}: KV slot for position {pos} holds {self.gpu[b][off]}, expected "
                    f"{state.token_ids[pos]}"
                )
        sampled: list[list[int]] = []
        for rid in scheduled:
            state = self.states[rid]
            n = out.num_scheduled_tokens[rid]
            assert n >= 1
            drafts = out.scheduled_spec_tokens.get(rid, [])
            if self.async_spec and drafts:
                assert set(drafts) == {-1}, f"{rid}: overlap sends placeholder drafts"
                slots, drafts = len(drafts), self.own_proposals.get(rid, [])[: len(drafts)]
                n -= slots - len(drafts)
            tokens = state.token_ids + drafts
            end = state.computed + n
            assert end <= len(tokens), f"{rid}: scheduled past its known tokens"
            assert not drafts or end == len(tokens), f"{rid}: proposals not at its end"
            for pos in range(state.computed, end):
                b, off = self._slot(state, pos)
                self.gpu[b][off] = tokens[pos]
            state.computed = end
            sampled.append(self._sample(rid, len(state.token_ids), drafts, end == len(tokens)))
            kept = len(sampled[-1]) - 1 if drafts else 0
            self.own_computed[rid] = end - len(drafts) + kept
        proposals = None
        if self.proposer is not None:
            proposals = [
                self.proposer(rid, self.states[rid].token_ids + new) if new else []
                for rid, new in zip(scheduled, sampled)
            ]
            self.own_proposals.update(zip(scheduled, proposals))
        if self.appends_sampled:  # after proposing, as workers.runner appends last in a step
            for rid, new in zip(scheduled, sampled):
                self.states[rid].token_ids.extend(new)
        return ModelRunnerOutput(scheduled, sampled, spec_token_ids=proposals)

    def _forget(self, rid: str) -> None:
        self.own_computed.pop(rid, None)
        self.own_proposals.pop(rid, None)

    def _sample(self, rid: str, length: int, drafts: list[int], samples: bool) -> list[int]:
        """The fake model's tokens: one at the end of the sequence, or a verify row's run (each
        proposed token kept while it is the model's, then one of the model's)."""
        if not samples:
            return []
        out = []
        for j in range(len(drafts) + 1):
            out.append(token_at(rid, length + j, self.vocab))
            if j == len(drafts) or drafts[j] != out[-1]:
                return out
        return out


def expected_output(
    request_id: str,
    prompt_len: int,
    max_tokens: int,
    eos: int | None,
    stop_ids: list[int],
    max_model_len: int,
    vocab: int = 50,
) -> tuple[list[int], str]:
    """What a request must produce under ContractRunner, whatever the scheduling."""
    out: list[int] = []
    while True:
        tok = token_at(request_id, prompt_len + len(out), vocab)
        out.append(tok)
        if tok == eos or tok in stop_ids:
            return out, "stop"
        if len(out) >= max_tokens or prompt_len + len(out) >= max_model_len:
            return out, "length"
