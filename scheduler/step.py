"""One step as the scheduler decides it (`Step`), and the SchedulerOutput it becomes."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.multimodal import encoder_tokens
from scheduler.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from scheduler.request import Request

NO_CAP = 1 << 62


def to_prompt_end(req: Request, computed: int) -> int:
    """How far a chunk starting at `computed` may go: to the prompt's end when it starts inside the
    prompt and tokens already chosen follow (a disaggregated decode, a migrated or recomputed
    request), else no limit. The prompt is then computed as the fresh prefill that chose those
    tokens computed it, and a single chosen token after it runs as the decode row it ran as there.
    Kernels that round activations to int8 turn the small rounding differences between those
    layouts into different seeded text."""
    prompt = req.num_prompt_tokens
    return prompt - computed if computed < prompt < req.num_tokens else NO_CAP


def finishes_on_pending(req: Request, max_model_len: int) -> bool:
    """Whether the tokens being sampled for req (at most its placeholders) take it to max_tokens
    or max_model_len: no step is scheduled for it until they are known (async overlap)."""
    pending = req.num_output_placeholders
    return (
        len(req.output_token_ids) + pending >= req.sampling_params.max_tokens
        or len(req.all_token_ids) + pending >= max_model_len
    )


@dataclass(slots=True)
class Step:
    """What one `schedule()` call has decided so far."""

    budget: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    start: dict[str, int] = field(default_factory=dict)  # num_computed_tokens before the step
    new_blocks: dict[str, list[int]] = field(default_factory=dict)
    new_reqs: list[Request] = field(default_factory=list)
    cached_reqs: list[Request] = field(default_factory=list)
    resumed: set[str] = field(default_factory=set)
    admitted: set[str] = field(default_factory=set)
    preempted: set[str] = field(default_factory=set)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    running_pass_preempted: bool = False
    # Image tokens the vision tower may still encode this step (scheduler/multimodal.py).
    encoder_budget: int = NO_CAP

    def take(self, req: Request, n: int, new_blocks: list[int]) -> int:
        """Schedule the next n tokens of req; returns where the chunk starts."""
        rid = req.request_id
        start = req.num_computed_tokens
        self.num_scheduled[rid] = n
        self.start[rid] = start
        self.new_blocks[rid] = new_blocks
        self.budget -= n
        if req.image_spans:
            self.encoder_budget -= encoder_tokens(req.image_spans, start, n)
        req.num_computed_tokens = start + n
        return start

    def give_back(self, req: Request) -> None:
        """Take req back out of the step (it is being preempted), if it was scheduled."""
        rid = req.request_id
        n = self.num_scheduled.pop(rid, None)
        if n is not None:
            req.num_computed_tokens = start = self.start.pop(rid)
            self.new_blocks.pop(rid)
            self.budget += n
            if req.image_spans:
                self.encoder_budget += encoder_tokens(req.image_spans, start, n)
            # Out of the runner's lists too (every request taken was sent), so that building them
            # needs no check per row; a preemption is rare, the list scan cheap beside it.
            sent = self.cached_reqs if req in self.cached_reqs else self.new_reqs
            sent.remove(req)

    def send(self, req: Request, resumed: bool) -> None:
        """req runs this step: in full when the runner has never seen it, else as a diff."""
        if req.known_to_runner:
            self.cached_reqs.append(req)
            if resumed:
                self.resumed.add(req.request_id)
        else:
            self.new_reqs.append(req)

    def new_request_data(self) -> list[NewRequestData]:
        """The requests the runner has not seen, in full; they count as synced from now on."""
        out = []
        for req in self.new_reqs:
            out.append(self._new_data(req))
            req.known_to_runner = True
            req.num_synced_tokens = req.num_tokens
        return out

    def _new_data(self, req: Request) -> NewRequestData:
        rid = req.request_id
        return NewRequestData(
            rid,
            req.prompt_token_ids,
            req.sampling_params,
            self.new_blocks[rid],
            self.start[rid],
            list(req.output_token_ids),
            req.eos_token_ids,
            req.spec.lora_name,
            req.spec.mm_inputs,
        )

    def cached_request_data(self) -> CachedRequestData:
        """The diffs of the requests the runner holds: tokens it has not seen, new blocks."""
        reqs = self.cached_reqs
        ids = [req.request_id for req in reqs]
        new_tokens = []
        for req in reqs:
            tokens = req.all_token_ids
            new_tokens.append(tokens[req.num_synced_tokens :])
            req.num_synced_tokens = len(tokens)
        resumed = self.resumed
        return CachedRequestData(
            ids,
            [rid in resumed for rid in ids] if resumed else [False] * len(ids),
            new_tokens,
            list(map(self.new_blocks.__getitem__, ids)),
            list(map(self.start.__getitem__, ids)),
        )

    def output(self, max_num_batched_tokens: int, finished: set[str]) -> SchedulerOutput:
        """The step as the runner gets it (the caller adds LoRA loads and KV transfers)."""
        return SchedulerOutput(
            scheduled_new_reqs=self.new_request_data(),
            scheduled_cached_reqs=self.cached_request_data(),
            num_scheduled_tokens=self.num_scheduled,
            total_num_scheduled_tokens=max_num_batched_tokens - self.budget,
            preempted_req_ids=self.preempted,
            finished_req_ids=finished,
            blocks_to_swap_out=self.swap_out,
            blocks_to_swap_in=self.swap_in,
        )
