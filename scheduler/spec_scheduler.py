"""SpecScheduler: the Scheduler with speculative decoding's token budget and KV accounting.

The runner proposes tokens to follow what each request sampled (ModelRunnerOutput.spec_token_ids);
the next step a decoding request may run its last token and up to k of those proposals, k from
SpecPolicy (scheduler/speculative.py). Then, as in vLLM V1:
- the proposed tokens count in the step's token budget and in `num_scheduled_tokens`, and get KV
  slots like any scheduled token (never by preempting another request: k shrinks to what the free
  pool holds);
- after verification the request's `num_computed_tokens` goes back by the rejected tokens, whose
  slots are rewritten by later steps, and blocks past the next token's slot go back to the pool
  (`SchedulerOutput.truncated_block_tables` tells the runner);
- prefix-cache hashes are registered from `num_computed_tokens` after that rewind, over
  `all_token_ids`, which holds accepted tokens only: a rejected token is never hashed;
- preemption (recompute or swap) drops the request's proposals; it proposes again after it next
  samples.
Async scheduling is refused with speculation (engine/config.py): the next step would be scheduled
before the proposals it runs are known.
"""

from __future__ import annotations

from dataclasses import replace

from scheduler.config import SchedulerConfig
from scheduler.outputs import ModelRunnerOutput, RequestOutput, SchedulerOutput, SchedulerStats
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import Scheduler, _Step
from scheduler.speculative import SpecPolicy, SpeculativeConfig

_RUNNING = RequestStatus.RUNNING


class SpecScheduler(Scheduler):
    """The Scheduler, letting a decode verify proposed tokens in the same step."""

    speculates = True

    def __init__(self, config: SchedulerConfig, spec: SpeculativeConfig) -> None:
        super().__init__(config)
        self.spec = spec
        self.policy = SpecPolicy(spec)
        self._proposals: dict[str, list[int]] = {}  # request id -> tokens to follow its last
        self._trims: dict[str, int] = {}  # block tables cut since the last step was emitted
        self.num_spec_proposed = 0
        self.num_spec_accepted = 0
        self.num_spec_rows = 0

    # ---- schedule ------------------------------------------------------------------------------
    def _num_spec_tokens(self, req: Request) -> int:
        rid = req.request_id
        proposal = self._proposals.get(rid)
        if not proposal:
            return 0
        k = self.policy.num_tokens(rid, len(self.running))
        if k == 0:
            self.policy.shadow(rid, proposal, req.num_tokens)
            return 0
        kv, bs = self.kv, self.kv.block_size
        # Speculation never preempts: keep a block free for each running request's own decode.
        spare = max(kv.num_free_blocks - len(self.running), 0)
        fits = (len(kv.blocks_of(rid)) + spare) * bs - req.num_computed_tokens - 1
        return max(
            0,
            min(
                k,
                len(proposal),
                fits,
                # Past max_tokens no proposal can be kept; past max_model_len it has no position.
                req.sampling_params.max_tokens - req.num_output_tokens - 1,
                self.max_model_len - req.num_tokens,
            ),
        )

    def _build_output(self, step: _Step) -> SchedulerOutput:
        out = super()._build_output(step)
        requests, start = self.requests, step.start
        spec = {}
        for rid, n in step.num_scheduled.items():
            extra = n - (requests[rid].num_tokens - start[rid])
            if extra > 0:
                spec[rid] = self._proposals[rid][:extra]
        out.scheduled_spec_tokens = spec
        out.truncated_block_tables, self._trims = self._trims, {}
        return out

    def _charge_input(self, req: Request, start: int, n: int) -> None:
        if start == req.num_tokens - 1:  # a decode and its proposals: charged as output, if kept
            return
        super()._charge_input(req, start, n)

    # ---- results -------------------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        if scheduler_output.scheduled_spec_tokens:
            self._settle(scheduler_output.scheduled_spec_tokens, runner_output)
        outputs = super().update_from_output(scheduler_output, runner_output)
        if scheduler_output.scheduled_spec_tokens and self.config.enable_prefix_caching:
            self._register_accepted(scheduler_output.scheduled_spec_tokens)
        proposals = runner_output.spec_token_ids
        if proposals is not None:
            self._take_proposals(runner_output.req_ids, proposals)
        return outputs

    def _settle(self, spec: dict[str, list[int]], runner_output: ModelRunnerOutput) -> None:
        """Give back the rejected tokens' slots, before the step's blocks are registered."""
        sampled_by = dict(zip(runner_output.req_ids, runner_output.sampled_token_ids))
        for rid, drafts in spec.items():
            req = self.requests.get(rid)
            if req is None or req.status is not _RUNNING:  # aborted or preempted meanwhile
                continue
            sampled = sampled_by.get(rid)
            accepted = len(sampled) - 1 if sampled else 0  # the rest is one token of its own
            req.num_computed_tokens -= len(drafts) - accepted
            # Keep the slot of the token sampled last: the next step computes it.
            keep = self.kv.trim(req, req.num_computed_tokens + 1)
            if keep is not None:
                self._trims[rid] = keep
            self.num_spec_proposed += len(drafts)
            self.num_spec_accepted += accepted
            self.num_spec_rows += 1
            self.policy.observe(rid, len(drafts), accepted)

    def _register_accepted(self, spec: dict[str, list[int]]) -> None:
        """Blocks that accepted tokens filled: registered now that those tokens are appended."""
        for rid in spec:
            req = self.requests.get(rid)
            if req is not None and req.status is _RUNNING:
                self.kv.register_computed_blocks(req)

    def _take_proposals(self, req_ids: list[str], proposals: list[list[int]]) -> None:
        requests, policy = self.requests, self.policy
        for rid, proposal in zip(req_ids, proposals):
            req = requests.get(rid)
            if req is None or req.status is not _RUNNING:
                continue
            policy.check_shadow(rid, req.all_token_ids)
            if proposal:
                self._proposals[rid] = proposal
            else:
                self._proposals.pop(rid, None)

    def _preempt(self, victim: Request, step: _Step) -> None:
        self._proposals.pop(victim.request_id, None)
        super()._preempt(victim, step)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        rid = req.request_id
        self._proposals.pop(rid, None)
        self._trims.pop(rid, None)
        self.policy.drop(rid)
        super()._finish(req, status)

    def stats(self) -> SchedulerStats:
        return replace(
            super().stats(),
            num_spec_proposed_tokens=self.num_spec_proposed,
            num_spec_accepted_tokens=self.num_spec_accepted,
            num_spec_verify_rows=self.num_spec_rows,
        )
