"""Speculative decoding as a step feature: its token budget, KV accounting and settling.

The runner proposes tokens to follow what each request sampled (ModelRunnerOutput.spec_token_ids);
the next step a decoding request may run its last token and up to k of those proposals, k from
SpecPolicy (scheduler/speculative.py). Then, as in vLLM V1:
- the proposed tokens count in the step's token budget and in `num_scheduled_tokens`, and get KV
  slots like any scheduled token (never by preempting another request: k shrinks to what the free
  pool holds);
- after verification the request's `num_computed_tokens` goes back by the rejected tokens, whose
  slots are rewritten by later steps, and blocks past the next token's slot go back to the pool
  (`SchedulerOutput.truncated_block_tables` tells the runner);
- prefix-cache hashes are registered from the KV written after that rewind, over
  `all_token_ids`, which holds accepted tokens only: a rejected token is never hashed;
- preemption (recompute or swap) drops the request's proposals; it proposes again after it next
  samples.

With async overlap (`overlap`, scheduler/features_async.py) step N+1 is scheduled before step N's
proposals, or how many of N's drafts are accepted, are known. Its slots are then reserved
optimistically: as many as the request's last known proposal held, after a position that assumes
every draft in flight is accepted, sent as placeholders (-1). The runner, which runs the steps in
order, fills them with the proposals it made at step N and starts the row where N really ended
(workers/spec_async.py); the settle after each step rewinds `num_computed_tokens` by what was
rejected or left unused, so the count is exact once no step is in flight. Nothing proposed makes a
round trip through the scheduler before it runs.
"""

from __future__ import annotations

from collections import deque

from scheduler.features import StepFeature
from scheduler.outputs import ModelRunnerOutput, RequestOutput, SchedulerOutput
from scheduler.request import Request, RequestStatus
from scheduler.speculative import SpecPolicy, SpeculativeConfig
from scheduler.step import Step

_RUNNING = RequestStatus.RUNNING
_SETTLED = (RequestStatus.RUNNING, RequestStatus.SWAPPED)  # their KV position still counts
PLACEHOLDER = -1  # a draft slot the runner fills with its own proposal (overlap)


class SpecDecoding(StepFeature):
    """A decode may verify proposed tokens in the same step."""

    def __init__(self, spec: SpeculativeConfig, overlap: bool = False) -> None:
        self.spec = spec
        self.overlap = overlap
        self.policy = SpecPolicy(spec)
        self._proposals: dict[str, list[int]] = {}  # request id -> tokens to follow its last
        self._trims: dict[str, int] = {}  # block tables cut since the last step was emitted
        # Per step with verify rows, not yet updated: its output, their requests and draft slots.
        self._in_flight: deque[tuple[SchedulerOutput, dict[str, tuple[Request, int]]]] = deque()
        self.num_spec_proposed = 0
        self.num_spec_accepted = 0
        self.num_spec_rows = 0

    # ---- schedule ------------------------------------------------------------------------------
    def num_spec_tokens(self, req: Request) -> int:
        rid = req.request_id
        proposal = self._proposals.get(rid)
        # Under overlap a request's first decodes are scheduled before any proposal of it is
        # known: they get the full k, so that the runner proposes and verifies from the start.
        if not proposal and not (self.overlap and proposal is None):
            return 0
        sched = self.sched
        k = self.policy.num_tokens(rid, len(sched.running))
        if k == 0:
            if proposal:
                self.policy.shadow(rid, proposal, req.num_tokens)
            return 0
        known = k if proposal is None else len(proposal)
        return max(0, min(k, known, self._room(req)))

    def _room(self, req: Request) -> int:
        """Proposed tokens the request can take this step: within its blocks and the free ones
        (without preempting), its max_tokens and max_model_len."""
        sched = self.sched
        kv, bs = sched.kv, sched.kv.block_size
        # Speculation never preempts: keep a block free for each running request's own decode.
        spare = max(kv.num_free_blocks - len(sched.running), 0)
        fits = (len(kv.blocks_of(req.request_id)) + spare) * bs - req.num_computed_tokens - 1
        pending = req.num_output_placeholders  # tokens in flight count as if all were kept
        # Past max_tokens no proposal can be kept; past max_model_len it has no position.
        outputs_left = req.sampling_params.max_tokens - req.num_output_tokens - pending - 1
        positions_left = sched.max_model_len - req.num_tokens - pending
        return min(fits, outputs_left, positions_left)

    def after_schedule(self, step: Step, out: SchedulerOutput) -> None:
        requests, start = self.sched.requests, step.start
        spec: dict[str, list[int]] = {}
        rows: dict[str, tuple[Request, int]] = {}
        for rid, n in step.num_scheduled.items():
            req = requests[rid]
            extra = n - (req.num_tokens + req.num_output_placeholders - start[rid])
            if extra > 0:
                spec[rid] = [PLACEHOLDER] * extra if self.overlap else self._proposals[rid][:extra]
                rows[rid] = (req, extra)
        out.scheduled_spec_tokens = spec
        out.truncated_block_tables, self._trims = self._trims, {}
        if rows:  # a step without verify rows has nothing to settle
            self._in_flight.append((out, rows))

    # ---- results -------------------------------------------------------------------------------
    def before_update(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> tuple[ModelRunnerOutput, list[RequestOutput]]:
        in_flight = self._in_flight
        if any(out is sched_out for out, _ in in_flight):
            while in_flight[0][0] is not sched_out:  # scheduled, never updated: dropped
                in_flight.popleft()
            self._settle(in_flight.popleft()[1], runner_out)
        return runner_out, []

    def _settle(self, rows: dict[str, tuple[Request, int]], runner_out: ModelRunnerOutput) -> None:
        """Give back the rejected (or unused) draft slots, before the step's blocks are
        registered; a request swapped out meanwhile rewinds too (its position is kept)."""
        sampled_by = dict(zip(runner_out.req_ids, runner_out.sampled_token_ids))
        requests, kv = self.sched.requests, self.sched.kv
        for rid, (req, drafts) in rows.items():
            if requests.get(rid) is not req or req.status not in _SETTLED:
                continue  # finished (aborted, failed) or preempted to recompute meanwhile
            sampled = sampled_by.get(rid)
            accepted = len(sampled) - 1 if sampled else 0  # the rest is one token of its own
            req.num_computed_tokens -= drafts - accepted
            self.num_spec_proposed += drafts
            self.num_spec_accepted += accepted
            self.num_spec_rows += 1
            self.policy.observe(rid, drafts, accepted)
            if req.status is _RUNNING:
                # Keep the slot of the token sampled last: the next step computes it.
                keep = kv.trim(req, req.num_computed_tokens + 1)
                if keep is not None:
                    self._trims[rid] = keep

    def after_update(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> None:
        if sched_out.scheduled_spec_tokens and self.sched.config.enable_prefix_caching:
            self._register_accepted(sched_out.scheduled_spec_tokens)
        if runner_out.spec_token_ids is not None:
            self._take_proposals(runner_out.req_ids, runner_out.spec_token_ids)

    def _register_accepted(self, spec: dict[str, list[int]]) -> None:
        """Blocks that accepted tokens filled: registered now that those tokens are appended."""
        requests, kv = self.sched.requests, self.sched.kv
        ahead = self.sched.tokens_in_flight()
        for rid in spec:
            req = requests.get(rid)
            if req is not None and req.status is _RUNNING:
                kv.register_computed_blocks(req, req.num_computed_tokens - ahead.get(rid, 0))

    def _take_proposals(self, req_ids: list[str], proposals: list[list[int]]) -> None:
        requests, policy = self.sched.requests, self.policy
        for rid, proposal in zip(req_ids, proposals):
            req = requests.get(rid)
            if req is None or req.status is not _RUNNING:
                continue
            policy.check_shadow(rid, req.all_token_ids)
            if proposal or self.overlap:  # overlap: an empty one is known to be empty
                self._proposals[rid] = proposal
            else:
                self._proposals.pop(rid, None)

    def on_preempt(self, req: Request) -> None:
        self._proposals.pop(req.request_id, None)

    def on_finish(self, req: Request) -> None:
        rid = req.request_id
        self._proposals.pop(rid, None)
        self._trims.pop(rid, None)
        self.policy.drop(rid)

    def stats(self) -> dict[str, int]:
        return dict(
            num_spec_proposed_tokens=self.num_spec_proposed,
            num_spec_accepted_tokens=self.num_spec_accepted,
            num_spec_verify_rows=self.num_spec_rows,
        )
